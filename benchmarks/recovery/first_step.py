"""What Adam's first step does to a compressed model, by parameter group: why one learning rate cannot fit every model.

Adam's first update (bias-corrected) is lr · g / (|g| + eps): about the rate for every entry with a gradient,
whatever the entry's size. A rate swept on one model is then a step of a different share of another model's
weights. This measures it directly, without a Trainer, a schedule or a compression search:

Protocol: a bundled model less one layer (`--drop`, default 16: the same crude student on every model, no
calibration), the dense model as teacher; one batch of 2 rows of 128 tokens of the healing text (pre-2000 speeches
outside calibration's windows, `run.training_texts`, its first 10 texts), float32, CPU. The gradient of the
distillation loss (`recovery.distill.DistillationLoss`, KL at T = 1) is taken once; then, for each rate and each
parameter group (every parameter, the MLP matrices, the attention matrices, the embeddings, the LM head, the norms,
the biases), Adam's first step is applied to that group alone and the batch's KL measured in eval mode, then undone.
Also recorded: the model's weight scale (`recovery.rate.weight_scale`, the median root-mean-square entry of its
weight matrices) and the default rate of `full` it gives (`RecoveryConfig.rate_for`), which is among the rates.

Usage: python -m benchmarks.recovery.first_step --model qwen2.5-0.5b --rates 6e-5 1e-5
Writes benchmarks/results/first_step_<model>.json.
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import torch

from benchmarks.recovery import run  # (benchmarks/recovery/run.py: the same bundled models and healing text)

#: Parameter groups by name, for the models measured (LLaMA-style names).
GROUPS = {
    "mlp": lambda n: ".mlp." in n,
    "attention matrices": lambda n: ".self_attn." in n and n.endswith("weight"),
    "embeddings": lambda n: "embed_tokens" in n,
    "lm_head": lambda n: n.startswith("lm_head"),
    "norms": lambda n: "norm" in n,
    "biases": lambda n: n.endswith("bias"),
}


def main() -> None:
    from optimum_flatten import bundled
    from optimum_flatten.options.recovery import RecoveryConfig
    from optimum_flatten.recovery.distill import DistillationLoss
    from optimum_flatten.recovery.rate import weight_scale

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-0.5b", choices=sorted(run.DEPTHS))
    parser.add_argument("--drop", type=int, default=16, help="the layer the student lacks")
    parser.add_argument("--rates", type=float, nargs="+", default=[6e-5, 1e-5])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dense, tokenizer = bundled.load_bundled(args.model)
    dense.eval().requires_grad_(False)
    student = copy.deepcopy(dense)
    del student.model.layers[args.drop]
    student.config.num_hidden_layers = len(student.model.layers)
    student.requires_grad_(True)
    scale = weight_scale(student)
    default = RecoveryConfig(mode="full").rate_for(scale)
    texts, _ = run.training_texts(tokenizer)
    ids = tokenizer("\n\n".join(texts[:10]), return_tensors="pt").input_ids[0]
    batch = {
        "input_ids": torch.stack([ids[:128], ids[128:256]]),
        "attention_mask": torch.ones(2, 128, dtype=torch.long),
    }
    loss = DistillationLoss(teacher=dense)
    student.train()
    parts = loss(student, batch)
    parts.total.backward()
    student.eval()
    params = {n: p for n, p in student.named_parameters() if p.grad is not None}
    rows = []
    for rate in sorted({*args.rates, default}, reverse=True):
        for group, pick in [("every parameter", lambda n: True), *GROUPS.items()]:
            names = [n for n in params if pick(n)]
            if not names:
                continue
            saved = {n: params[n].detach().clone() for n in names}
            with torch.no_grad():
                for n in names:
                    g = params[n].grad
                    params[n].sub_(rate * g / (g.abs() + 1e-8))
                kl = loss(student, batch).kl
                for n in names:
                    params[n].copy_(saved[n])
            rows.append({"rate": rate, "group": group, "tensors": len(names), "kl_after": kl})
            print(json.dumps(rows[-1]), flush=True)
    result = {
        "model": args.model,
        "student": f"the dense model less layer {args.drop}",
        "batch": "2 x 128 tokens of the healing text (run.training_texts, first 10 texts), float32, CPU",
        "step": "Adam's bias-corrected first update, lr * g / (|g| + 1e-8), on one group at a time, then undone",
        "weight_scale": scale,
        "default_full_rate": default,
        "kl_before": parts.kl,
        "rows": rows,
        "threads": args.threads,
    }
    out = Path(args.out or f"benchmarks/results/first_step_{args.model}.json")
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
