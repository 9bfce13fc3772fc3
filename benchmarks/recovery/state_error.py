"""Is a state loss a good proxy for the model's output? Where the error of a compressed block sits, and what it costs.

Protocol: compress a bundled model as benchmarks/recovery/run.py does (`--method`, the depth of `run.DEPTHS`,
calibration `run.CALIBRATION`); take 4 rows of 256 tokens of the healing text (pre-2000 speeches outside calibration's
windows, `run.training_texts`, texts 5-6); for each changed span (`recovery.selection.changed_spans`) feed the
student block the dense model's state entering the span and compare its output with the dense state leaving it:
- the share of the pooled squared error, and of the target's pooled square, held by the first position of each row
  (the attention sink), and the mean relative error per position at the sink and elsewhere;
- for the first span: KL(dense ‖ compressed) of the whole compressed model on those rows (positions 1.., float64
  softmax), as it is and with the block's output perturbed by random directions of relative size eps per position,
  at the sink only or at every other position (seeded), to compare with what the block's own error costs.

Usage: python -m benchmarks.recovery.state_error --model qwen2.5-0.5b --method replaceme_lstsq_down
Writes benchmarks/results/state_error_<model>_<method>.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from benchmarks.recovery import run  # (benchmarks/recovery/run.py: the same compression, calibration and healing text)

EPSILONS = (0.001, 0.01, 0.1)


def main() -> None:
    from optimum_flatten import FlattenConfig, FlattenQuantizer, bundled
    from optimum_flatten.evaluation import tokenize_corpus
    from optimum_flatten.recovery.local import LocalSpanLoss
    from optimum_flatten.recovery.selection import changed_spans

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-0.5b", choices=sorted(run.DEPTHS))
    parser.add_argument("--method", default="replaceme_lstsq_down")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dense, tokenizer = bundled.load_bundled(args.model)
    model, _ = bundled.load_bundled(args.model)
    options = {"num_layers_to_remove": run.DEPTHS[args.model], **run.CALIBRATION, **run.VARIANTS[args.method]}
    quantizer = FlattenQuantizer(FlattenConfig(**options), progress=False)
    quantizer.compress(model, tokenizer)
    texts, _ = run.training_texts(tokenizer)
    ids = tokenize_corpus(tokenizer, texts[5:7])[: 4 * 256].view(4, 256)
    spans = changed_spans(model, quantizer.report)
    local = LocalSpanLoss(model, dense, spans)
    result = {"model": args.model, "method": args.method, "plan": quantizer.report["plan_summary"], "spans": []}
    with torch.no_grad():
        pairs, _ = local.span_outputs({"input_ids": ids})  # what the local mode compares, on the same calls
        for span, (output, target) in zip(local.spans, pairs, strict=True):
            output, target = output.double(), target.double()
            error, size = (output - target).pow(2).sum(-1), target.pow(2).sum(-1)
            result["spans"].append(
                {
                    "block": span.block,
                    "original_layers": [span.start, span.end - 1],
                    "sink_share_of_pooled_error": float(error[:, 0].sum() / error.sum()),
                    "sink_share_of_target_square": float(size[:, 0].sum() / size.sum()),
                    "relative_error_sink": float((error[:, 0] / size[:, 0]).mean()),
                    "relative_error_others": float((error[:, 1:] / size[:, 1:]).mean()),
                    "pooled_normalised_mse": float(error.sum() / size.sum()),
                }
            )
        reference = torch.log_softmax(dense(ids).logits.double(), -1)
        block = local.blocks[0]

        def kl(where: str, eps: float) -> float:
            generator = torch.Generator().manual_seed(0)

            def perturb(_module, _args, out):
                state = out[0] if isinstance(out, tuple) else out
                noise = torch.randn(state.shape, generator=generator)
                noise = noise / noise.norm(dim=-1, keepdim=True) * state.norm(dim=-1, keepdim=True) * eps
                chosen = torch.zeros(state.shape[:2], dtype=torch.bool)
                chosen[:, 0] = where == "sink"
                chosen[:, 1:] = where == "others"
                state = state + noise * chosen[..., None]
                return (state, *out[1:]) if isinstance(out, tuple) else state

            handle = block.register_forward_hook(perturb)
            try:
                logp = torch.log_softmax(model(ids).logits.double(), -1)
            finally:
                handle.remove()
            return float((reference.exp() * (reference - logp)).sum(-1)[:, 1:].mean())

        result["kl_as_compressed"] = kl("none", 0.0)
        result["kl_perturbed_first_span"] = [
            {"eps": eps, "sink_only": kl("sink", eps), "others_only": kl("others", eps)} for eps in EPSILONS
        ]
    result["protocol"] = (
        "4 x 256 tokens of the healing text (texts 5-6 of run.training_texts), float32 model, float64 statistics; "
        "perturbations: random directions (seed 0) scaled to eps x each position's state norm, on the first span's "
        "block output"
    )
    out = Path(__file__).resolve().parents[1] / "results" / f"state_error_{args.model}_{args.method}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
