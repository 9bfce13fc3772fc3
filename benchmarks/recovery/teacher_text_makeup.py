"""What the dense model wrote when it healed its student: the rows of a teacher-text cache counted by script.

The teacher's own text is the teacher's distribution, whatever that is. A general English model writes English; the
bundled Qwen2.5 is the *Coder*-Instruct model, and from a bare start token it writes code and Chinese. The share of
each decides what healing on that text can teach about English prose, so the pages report it beside the rows.

Each row (``train.safetensors`` of a `--teacher-text-cache` folder, decoded with the model's tokenizer) is one of:

- **CJK**: at least 10% of its non-space characters are CJK ideographs, kana or hangul;
- **code or markup**: else at least 4% are code punctuation (``{}[]()<>;=#/\\*_|`$``; of 2,027 paragraphs of the
  first 50 speeches none reached 4%, the highest 3.8%, the median 0);
- **prose**: the rest (Latin-script text, mostly English).

The thresholds are a reading aid stated here, not a tuned classifier; a few decoded rows of each kind are written to
the JSON so that anyone can check the split by eye.

Beside the kinds, how much the rows repeat themselves: the figure `recover` prints for its teacher's text
(`optimum_flatten.recovery.text_repetition`: the share of a row's 4-grams, after its start and prompt, that stood
earlier in the row; a row over 25% loops). `--speeches` measures the same on the healing speeches themselves (the
pre-2000 speeches outside calibration's windows, in rows of 256 tokens of the model's tokenizer): written text's
figure, for comparison.

`--sample N` has the dense model write N rows here (seed 0 unless `--seed`, rows of 256 tokens, from `--start`, with
a `--top-p` cut if asked; `recovery.teacher_text.sample_teacher_rows`, kept in `--sample-cache` when given, so that
the same command reads them back): what a sampling setting would give, before any healing is run on it.

    python -m benchmarks.recovery.teacher_text_makeup --model qwen2.5-0.5b --cache DIR [--label prompted]
    python -m benchmarks.recovery.teacher_text_makeup --model qwen2.5-0.5b --speeches
    python -m benchmarks.recovery.teacher_text_makeup --model qwen2.5-0.5b --sample 32 --start chat --top-p 0.9 \
        --label chat_top_p0.9

`--score N` has the dense model score the first N rows it wrote, with full forwards and no KV cache: whether its
loops are what the model predicts, or what a wrong sampler wrote (`sampled_probability`).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections import Counter
from pathlib import Path

import torch

CJK_SHARE = 0.10
CODE_SHARE = 0.04
CODE_CHARACTERS = frozenset("{}[]()<>;=#/\\*_|`$")


def _is_cjk(character: str) -> bool:
    point = ord(character)
    return (
        0x4E00 <= point <= 0x9FFF  # CJK unified ideographs
        or 0x3400 <= point <= 0x4DBF  # extension A
        or 0x3040 <= point <= 0x30FF  # hiragana, katakana
        or 0xAC00 <= point <= 0xD7AF  # hangul syllables
    )


def kind(text: str) -> str:
    """The row's kind by the shares above."""
    characters = [c for c in text if not c.isspace()]
    if not characters:
        return "prose"
    if sum(map(_is_cjk, characters)) >= CJK_SHARE * len(characters):
        return "CJK"
    if sum(c in CODE_CHARACTERS for c in characters) >= CODE_SHARE * len(characters):
        return "code or markup"
    return "prose"


def makeup(texts: list[str], examples: int = 2) -> dict:
    """Counts of each kind, and the first `examples` rows of each (their first 200 characters)."""
    kinds = [kind(text) for text in texts]
    shown: dict[str, list[str]] = {}
    for text, label in zip(texts, kinds, strict=True):
        if len(shown.setdefault(label, [])) < examples:
            shown[label].append(text[:200])
    return {"rows": len(texts), "counts": dict(Counter(kinds)), "examples": shown}


def cached_rows(folder: Path, tokenizer: object) -> tuple[torch.Tensor, dict, int]:
    """A teacher-text cache's training rows, its key, and the tokens each row held before the teacher sampled (its
    start and prompt, as `sample_teacher_rows` counts them)."""
    from safetensors.torch import load_file

    from optimum_flatten.recovery.teacher_start import checked_start

    ids = load_file(str(folder / "train.safetensors"))["input_ids"]
    key = json.loads((folder / "train.json").read_text())
    prompted = bool(key.get("prompts"))
    start = key.get("start") if key.get("start") in ("chat", "random") else "bos"
    skip = checked_start(tokenizer, start, int(key["seqlen"]), int(key.get("prompt_tokens") or 0), prompted)[3]
    return ids, key, skip


def sampled_rows(model_key: str, rows: int, start: str, top_p: float | None, seed: int, folder: Path) -> None:
    """`rows` rows of 256 tokens the bundled dense model writes into the cache `folder` (read back when its key
    matches), 32 a batch on one thread."""
    from optimum_flatten import bundled
    from optimum_flatten.recovery.teacher_text import sample_teacher_rows

    torch.set_num_threads(1)
    model, tokenizer = bundled.load_bundled(model_key)
    sample_teacher_rows(
        model, tokenizer, rows, 256, seed=seed, top_p=top_p, start=start, batch_size=32, cache_dir=folder,
        progress=False,
    )  # fmt: skip


@torch.no_grad()
def sampled_probability(model_key: str, ids: torch.Tensor, skip: int, batch_size: int = 4) -> dict:
    """How likely the dense model finds the tokens it sampled, each row scored by one full forward with no KV cache
    (not the path ``generate`` took): the mean probability of the sampled tokens after the row's opening, of those
    that continue a repeated 4-gram (the loops) and of the rest. Had the sampler's cached path disagreed with the
    model, what it wrote would be unlikely under the full forward; a model that loops gives its loops a high
    probability. Also whether greedy decoding from the first row's opening is the same with and without the cache."""
    from optimum_flatten import bundled
    from optimum_flatten.recovery.text_repetition import repeated_mask

    model, _ = bundled.load_bundled(model_key)
    model.eval()
    probabilities = []
    for first in range(0, ids.shape[0], batch_size):
        rows = ids[first : first + batch_size]
        logits = model(input_ids=rows, use_cache=False).logits[:, :-1].float()
        probabilities.append(torch.softmax(logits, -1).gather(-1, rows[:, 1:, None])[..., 0])
    p = torch.cat(probabilities)[:, skip - 1 :]  # column i: the token at i + 1; the sampled ones from `skip` on
    loops = repeated_mask(ids)[:, skip:]  # a repeat may reach back into the opening, as scored when measured
    opening = ids[:1, : max(skip, 1)]
    cached, uncached = (
        model.generate(input_ids=opening, attention_mask=torch.ones_like(opening), do_sample=False, max_new_tokens=32,
                       min_new_tokens=32, eos_token_id=None, use_cache=flag)
        for flag in (True, False)
    )  # fmt: skip
    return {
        "rows_scored": int(ids.shape[0]),
        "protocol": "one forward a row without a KV cache, float32; the probability of each sampled token after the "
        "opening; a loop token ends a 4-gram already in its row",
        "mean": round(float(p.mean()), 4),
        "loop_tokens": int(loops.sum()),
        "mean_in_loops": round(float(p[loops].mean()), 4) if loops.any() else None,
        "mean_elsewhere": round(float(p[~loops].mean()), 4) if (~loops).any() else None,
        "greedy_cached_equals_uncached": bool(torch.equal(cached, uncached)),
    }


def speech_rows(tokenizer: object, seqlen: int = 256) -> torch.Tensor:
    """The healing speeches (`run.training_texts`) as consecutive rows of `seqlen` tokens."""
    from benchmarks.recovery.run import training_texts
    from optimum_flatten.evaluation import tokenize_corpus

    stream = tokenize_corpus(tokenizer, training_texts(tokenizer)[0])
    return stream[: (stream.numel() // seqlen) * seqlen].view(-1, seqlen)


def main() -> None:
    from transformers import AutoTokenizer

    from optimum_flatten import bundled
    from optimum_flatten.recovery.text_repetition import repetition_summary

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, choices=sorted(bundled.BUNDLED_MODELS))
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--cache", help="a --teacher-text-cache folder (train.safetensors, train.json)")
    source.add_argument("--speeches", action="store_true", help="the healing speeches, for comparison")
    source.add_argument("--sample", type=int, metavar="N", help="rows the dense model writes here")
    parser.add_argument("--start", choices=["bos", "chat", "random"], default="bos", help="with --sample")
    parser.add_argument("--top-p", type=float, default=None, help="with --sample: a top-p cut (default none)")
    parser.add_argument("--seed", type=int, default=0, help="with --sample")
    parser.add_argument("--sample-cache", default=None, help="with --sample: keep the rows here")
    parser.add_argument(
        "--score", type=int, default=0, metavar="N",
        help="score the first N rows with the dense model (`sampled_probability`; not with --speeches)",
    )  # fmt: skip
    parser.add_argument("--label", default="", help="a suffix for the result's file name (e.g. prompted)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(bundled.bundled_model_path(args.model))
    if args.speeches:
        ids, key, skip = speech_rows(tokenizer), {"teacher": None}, 0
        args.label = args.label or "speeches"
    elif args.sample:
        folder = Path(args.sample_cache or tempfile.mkdtemp(prefix="makeup-"))
        sampled_rows(args.model, args.sample, args.start, args.top_p, args.seed, folder)
        ids, key, skip = cached_rows(folder, tokenizer)
    else:
        ids, key, skip = cached_rows(Path(args.cache), tokenizer)
    texts = [tokenizer.decode(row, skip_special_tokens=True) for row in ids.tolist()]
    result = {
        "model": args.model,
        "teacher": key.get("teacher"),
        "text": "the healing speeches" if args.speeches else "the teacher's samples",
        "sampling": {k: key.get(k) for k in ("seed", "seqlen", "temperature", "top_k", "top_p", "start", "prompts")},
        "rule": f"CJK: >= {CJK_SHARE:.0%} of non-space characters; else code or markup: >= {CODE_SHARE:.0%} code "
        "punctuation; else prose",
        **makeup(texts),
        "repetition": {**repetition_summary(ids, skip=skip), "skipped_tokens": skip},
    }
    if args.score and not args.speeches:
        result["sampled_probability"] = sampled_probability(args.model, ids[: args.score], skip)
    suffix = f"_{args.label}" if args.label else ""
    out = Path(args.out or f"benchmarks/results/teacher_text_makeup_{args.model}{suffix}.json")
    out.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")
    print(json.dumps({k: result[k] for k in ("teacher", "rows", "counts", "repetition")}), f"-> {out}")


if __name__ == "__main__":
    main()
