"""Prints the markdown tables of benchmarks/RESULTS.md from the JSON files in benchmarks/results/.

Usage: python -m benchmarks.render [--write]   (--write fills the markers of RESULTS.template.md into RESULTS.md, the
product page, and of NOTEBOOK.template.md into NOTEBOOK.md, the lab notebook; README.md quotes the product page's
first table between its ``<!-- results:NAME -->`` and ``<!-- /results -->`` lines, refreshed too)
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from benchmarks.recovery import protocol as recovery_protocol  # the healing benchmark's default rows and seed
from optimum_flatten.options.recovery import RecoveryConfig

RESULTS = Path(__file__).parent / "results"


def _default_rate(h: dict) -> bool:
    """Whether a healing run trained at its mode's default rate, which follows the model's weight scale
    (`RecoveryConfig.rate_for`). Runs from before that (no weight scale in their log) had the unscaled defaults,
    which are the defaults only on SmolLM2, the model they were swept on."""
    scale = h["recovery"].get("weight_scale")
    if scale is None and h.get("model", "smollm2") != "smollm2":
        return False
    config = RecoveryConfig(mode=h["mode"])
    default = config.rate_for(scale) if scale else config.rate
    return abs(h["recovery"]["learning_rate"] - default) <= 1e-9 * default


def _ratio(result: dict, dense: dict, key: str) -> str:
    """result[key] / dense[key] to 3 decimals, or an empty cell when either was not measured (older JSON files)."""
    if result.get(key) is None or dense.get(key) is None:
        return ""
    return f"{result[key] / dense[key]:.3f}"


def _fidelity(result: dict, measure: str, digits: int) -> str:
    """'SOTU / KJV' of one fidelity measure; empty for the dense row and for rows measured before fidelity existed."""
    texts = result.get("fidelity") or {}
    cells = [f"{texts[t][measure]:.{digits}f}" if measure in texts.get(t, {}) else "" for t in ("sotu", "kjv")]
    return " / ".join(cells) if any(cells) else ""


def depth_table(path: Path) -> str:
    data = json.loads(path.read_text())
    results = data["results"]
    dense = next(r for r in results if r["variant"] == "dense")
    lines = [f"- {k}: {v}" for k, v in data.get("protocol", {}).items()]
    header = [
        "variant",
        "layers",
        "params (M)",
        "perplexity",
        "PPL ratio SOTU≥2000",
        "PPL ratio KJV (out of domain)",
        "KL (SOTU / KJV)",
        "top-1 (SOTU / KJV)",
        "compress s",
        "stack passes",
        "peak RSS MB",
        "plan",
    ]
    lines += ["", "| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['variant']} | failed: {r['error']} |" + " |" * (len(header) - 2))
            continue
        lines.append(
            f"| {r['variant']} | {r['layers']} | {r['parameters'] / 1e6:.1f} | {r['perplexity']:.2f} | "
            f"{_ratio(r, dense, 'perplexity')} | {_ratio(r, dense, 'perplexity_kjv')} | "
            f"{_fidelity(r, 'kl', 4)} | {_fidelity(r, 'top1_agreement', 3)} | {r.get('compress_seconds', 0):.0f} | "
            f"{r.get('cost_stack_passes', '')} | {r['peak_rss_mb']:.0f} | {r.get('plan', '')} |"
        )
    return "\n".join(lines)


def scale_table(path: Path) -> str:
    """Offloaded vs in-memory compression, cost per phase in forward passes, and the extrapolation."""
    d = json.loads(path.read_text())
    mem, off = d["runs"]["in_memory"], d["runs"]["offloaded"]
    forward, stack = mem["dense_forward_seconds"], mem["stack_forward_seconds"]
    lines = [f"- {k}: {v}" for k, v in d["protocol"].items()]
    lines += [
        "",
        "| run | checkpoint GB | resident weights after load GB | after compress GB | peak RSS GB | compress s |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in (("in memory", mem), ("offloaded", off)):
        lines.append(
            f"| {name} | {r['checkpoint_bytes'] / 2**30:.2f} | {r['resident_bytes_after_load'] / 2**30:.2f} | "
            f"{r['resident_bytes_after_compress'] / 2**30:.2f} | {r['peak_rss_mb'] / 1024:.2f} | "
            f"{r['compress_seconds']:.0f} |"
        )
    lines += [
        "",
        f"Same groups, kept KV groups and channels: {d['same_groups_heads_channels']}; "
        f"max abs weight difference between the two saved checkpoints: {d['max_abs_weight_difference']:.3g}. "
        f"Offloaded to disk: {', '.join(off.get('offloaded_to_disk', [])) or 'nothing'}.",
        "",
        f"Cost of the in-memory run per phase, in dense forward passes over the same {mem['calibration_tokens']} "
        f"calibration tokens (full model {forward:.1f} s; decoder stack alone {stack:.1f} s):",
        "",
        "| phase | seconds | / full forward | / stack forward |",
        "|---|---|---|---|",
    ]
    phases = ["selection", "propagate", "flatten", "head_scoring", "covariance", "solve", "export_prep"]
    for phase in phases:
        seconds = mem["timings"].get(phase, 0.0)
        lines.append(f"| {phase} | {seconds:.1f} | {seconds / forward:.2f} | {seconds / stack:.2f} |")
    total = mem["compress_seconds"]
    lines.append(f"| **total compress** | {total:.1f} | {total / forward:.2f} | {total / stack:.2f} |")
    lines += [
        "",
        "Extrapolated from the costs fitted on this run (same machine, float16 weights, "
        f"{d['protocol']['extrapolation_tokens']} calibration tokens; see `extrapolate` in the script):",
        "",
        "| model | layers | hours here | in dense stack forwards | share forwards/products/solves | "
        "weights fp16 GB | peak workspace GB |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, e in d["extrapolated"].items():
        lines.append(
            f"| {name} | {e['layers']} | {e['hours_on_this_machine']} | {e['in_dense_stack_forwards']} | "
            f"{e['share_forwards_products_solves']} | {e['weights_fp16_gb']} | {e['peak_workspace_gb']} |"
        )
    return "\n".join(lines)


def _cell(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.4f}" if abs(value) < 100 else f"{value:.1f}"
    if isinstance(value, int):
        return f"{value:,}"
    return "" if value is None else str(value).replace("|", "/")


def section_table(section: dict) -> str:
    """One section of benchmarks/results/families.json: its protocol, then one row per variant (or its refusal)."""
    columns = section["columns"]
    lines = [f"#### {section['title']}", ""]
    lines += [f"- {k}: {v}" for k, v in section["protocol"].items()]
    if "library" in section:
        lines.append(f"- library: {section['library']}")
    lines += ["", "| variant | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for r in section["results"]:
        if "refused" in r:
            lines.append(f"| {r['variant']} | refused: {_cell(r['refused'])} |" + " |" * (len(columns) - 1))
            continue
        lines.append(f"| {r['variant']} | " + " | ".join(_cell(r.get(c)) for c in columns) + " |")
        if "collapse_refused" in r:
            lines.append(f"| ↳ collapse step | refused: {_cell(r['collapse_refused'])} |" + " |" * (len(columns) - 1))
    if "section_seconds" in section:
        lines += ["", f"Section wall time: {section['section_seconds']:.0f} s."]
    return "\n".join(lines)


def families_table(path: Path) -> str:
    """Every section of the families benchmark (BERT, GPT-2, ViT, Marian), as markdown."""
    data = json.loads(path.read_text())
    lines = [f"- {k}: {v}" for k, v in data.get("protocol", {}).items()]
    for section in data.get("sections", {}).values():
        lines += ["", section_table(section)]
    return "\n".join(lines)


def speed_table(path: Path) -> str:
    d = json.loads(path.read_text())
    lines = [
        f"#### {d['model']}: {d['layers'][0]} -> {d['layers'][1]} layers",
        "",
        "| | dense tok/s | compressed tok/s | measured speed-up | ideal L/L' |",
        "|---|---|---|---|---|",
    ]
    for kind in ("prefill", "decode"):
        key = f"{kind}_tokens_per_second"
        lines.append(
            f"| {kind} | {d['dense'][key]:.0f} | {d['compressed'][key]:.0f} | {d[f'{kind}_speedup']:.3f} | "
            f"{d['ideal_speedup']:.3f} |"
        )
    lines += ["", f"protocol: {d['protocol']}"]
    return "\n".join(lines)


def clients_table(path: Path) -> str:
    """benchmarks/results/clients.json: one row per checkpoint x client, with the verdict and why.

    A skipped client shows its reason and a failed one its error: neither ever reads as passed.
    """
    data = json.loads(path.read_text())
    lines = [f"- {k}: {v}" for k, v in data.get("protocol", {}).items()]
    lines.append("- versions: " + ", ".join(f"{k} {v}" for k, v in data.get("versions", {}).items()))
    for name, checkpoint in data.get("checkpoints", {}).items():
        text = checkpoint if isinstance(checkpoint, str) else checkpoint["description"]
        lines.append(f"- {name}: {text}")
    header = ["checkpoint", "client", "result", "max abs Δlogit", "greedy identical", "detail"]
    lines += ["", "| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    for r in data["results"]:
        if r["status"] == "skipped":
            cells = [f"skipped: {r['reason']}", "", "", ""]
        elif r["status"] == "failed":
            cells = ["**failed**", "", "", r["error"][:300]]
        else:
            greedy = {True: "yes", False: "**no**", None: "n/a"}[r.get("greedy_identical")]
            cells = [
                "passed" if r["passed"] else "**not passed**",
                f"{r['max_abs_logit_diff']:.1e}",
                greedy,
                r.get("detail", ""),
            ]
        lines.append("| " + " | ".join([r["checkpoint"], r["client"], *(_cell(c) for c in cells)]) + " |")
    counts = {s: sum(1 for r in data["results"] if _outcome(r) == s) for s in ("passed", "not passed", "skipped")}
    lines += ["", ", ".join(f"{n} {s}" for s, n in counts.items()) + f"; run in {data.get('total_seconds', '?')} s."]
    return "\n".join(lines)


def curve_table(model: str) -> str:
    """Ratio to dense (SOTU >= 2000 / KJV) by layers removed, one row per method (the PNG's numbers)."""
    from benchmarks.depth.curve import curve_points

    points = curve_points(model)
    depths = sorted({n for by_depth in points.values() for n in by_depth})
    lines = ["| variant | " + " | ".join(f"{n} removed" for n in depths) + " |", "|---" * (len(depths) + 1) + "|"]
    for variant, by_depth in points.items():
        cells = [f"{by_depth[n][0]:.3f} / {by_depth[n][1]:.3f}" if n in by_depth else "" for n in depths]
        lines.append(f"| {variant} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def cost_table(paths: list[Path]) -> str:
    """Compression cost in dense forwards over the same tokens, one row per JSON (before/after a change)."""
    lines = []
    header = [
        "run",
        "device",
        "dtype",
        "threads",
        "calibration",
        "dense forward s",
        "compress s",
        "ratio",
        "stack passes",
        "largest phases (in dense forwards)",
        "plan",
    ]
    lines += ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    for path in paths:
        d = json.loads(path.read_text())
        phases = sorted(
            ((k, v) for k, v in d["phases_in_dense_forwards"].items() if k != "plan"), key=lambda kv: -kv[1]
        )[:3]
        lines.append(
            f"| {d['protocol'].get('label', path.stem)} | {d['device']} | {d['dtype']} | {d['threads']} | "
            f"{d['shapes']['calibration']} | {d['dense_forward_seconds']:.1f} | {d['compress_seconds']:.1f} | "
            f"{d['compress_in_dense_forwards']:.2f}× | {d['stack_passes']} | "
            + ", ".join(f"{k} {v:.2f}" for k, v in phases)
            + f" | {d['plan']} |"
        )
    return "\n".join(lines)


#: The GPU runs the product page shows: the latest call of each row at each shape, on the device it ran on (the H200
#: call of 2026-11-28 measured every row but float32 and tf32, which stay the H100's; the notebook has every run).
GPU_SUMMARY_RUNS = (
    "cost_gpu_llama-2-7b_defaults_h200",
    "cost_gpu_llama-2-7b_float32",
    "cost_gpu_llama-2-7b_tf32",
    "cost_gpu_llama-2-7b_replaceme_h200",
    "cost_gpu_llama-2-7b_replaceme_held_h200",
    "cost_gpu_llama-2-70b_4_layers_h200",
)


def gpu_cost_table(paths: list[Path]) -> str:
    """`benchmarks/cost/gpu_shape.py`: cost in dense forwards and accelerator memory at a real model shape, measured
    against the estimate of the same model, method and calibration; one row per JSON, with its code state."""
    header = [
        "run",
        "device (torch)",
        "dtype",
        "shape",
        "calibration",
        "dense forward s",
        "compress s",
        "ratio",
        "largest phases (in dense forwards)",
        "weights GiB",
        "workspace GiB: measured / estimated",
        "largest phases' workspace GiB: measured / estimated",
        "prefill tok/s: dense → compressed",
    ]
    lines = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    gib = 2**30
    for path in paths:
        d = json.loads(path.read_text())
        shapes = d["shapes"]
        phases = sorted(
            ((k, v) for k, v in d["phases_in_dense_forwards"].items() if k not in ("plan", "apply")),
            key=lambda kv: -kv[1],
        )[:3]
        estimate = d["estimate"]["workspace_bytes"]
        measured = d["memory"].get("phase_workspace_gib", {})
        by_phase = sorted(estimate["phases"].items(), key=lambda kv: -kv[1])[:3]
        phase_cells = ", ".join(
            f"{k} {measured[k]:.1f} / {v / gib:.1f}" if k in measured else f"{k} — / {v / gib:.1f}" for k, v in by_phase
        )
        prefill = d.get("prefill")
        prefill_cell = (
            f"{prefill['dense']['tokens_per_second']:.0f} → {prefill['compressed']['tokens_per_second']:.0f} "
            f"(1 × {prefill['dense']['seqlen']})"
            if prefill
            else ""
        )
        cells = [
            d["protocol"]["label"],
            f"{d['device']} ({d['torch']})",
            d["dtype"],
            f"{shapes['shape']}: {shapes['num_hidden_layers']} layers, hidden {shapes['hidden_size']}, "
            f"MLP {shapes['intermediate_size']}, {shapes['num_attention_heads']}/{shapes['num_key_value_heads']} heads",
            shapes["calibration"],
            f"{d['dense_forward_seconds']:.2f}",
            f"{d['compress_seconds']:.1f}",
            f"{d['compress_in_dense_forwards']:.2f}×",
            ", ".join(f"{k} {v:.2f}" for k, v in phases),
            f"{d['weights_bytes'] / gib:.1f}",
            f"{d['memory']['workspace_gib']:.1f} / {estimate['peak'] / gib:.1f}",
            phase_cells,
            prefill_cell,
        ]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def search_table(path: Path) -> str:
    """The search methods' cost (`benchmarks/cost/search.py`): one row per labelled run, with what was skipped."""
    header = [
        "run",
        "method",
        "options",
        "device",
        "threads",
        "calibration",
        "compress s",
        "stack passes",
        "exhaustive search (stack passes)",
        "skipped",
        "plan",
    ]
    lines = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    for label, run in json.loads(path.read_text()).items():
        report = run.get("method_report", {})
        if "sleb_early_exits" in report:
            skipped = (
                f"{report['sleb_early_exits']} candidate-batches stopped early, "
                f"{report['sleb_resumed_batches']} resumed"
            )
        elif "ffn_search" in report:
            search = report["ffn_search"]
            skipped = f"{search['early_exits']} stack-batches stopped early, {search['resumed_batches']} resumed"
        else:
            skipped = ""
        groups = report.get("ffn_groups")
        plan = run["plan"] + (f"; MLPs shared {' '.join(str(g['layers']) for g in groups)}" if groups else "")
        cells = [
            label,
            run["protocol"]["method"],
            json.dumps(run["protocol"]["method_args"]) if run["protocol"]["method_args"] else "defaults",
            run["device"],
            run["threads"],
            run["shapes"]["calibration"],
            f"{run['compress_seconds']:.1f}",
            run["stack_passes"],
            run.get("stack_passes_exhaustive_search", ""),
            skipped,
            plan,
        ]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def kv_search_table(path: Path) -> str:
    """`benchmarks/cost/kv_search.py`: FlattenGPT's greedy KV-group search, one downdated factorisation (the code)
    against one factorisation a step and one refit per candidate, one row per labelled run (a search a run left out
    is an empty cell; runs before 2026-11-27 timed no downdated search)."""
    header = ["run", "device", "threads", "KV groups → kept", "o_proj input × hidden"]
    header += ["s, one downdated", "s, one a step", "s, one per candidate", "same groups"]
    lines = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    for label, r in json.loads(path.read_text()).items():
        z, t = r["shapes"], r["seconds"]
        cells = [
            label,
            f"{r['device']} (torch {r['torch']}, {r['dtype']})",
            r["threads"],
            f"{z['kv_groups']} → {z['kept']}",
            f"{z['o_proj_input_width']} × {z['hidden']}",
            *(
                f"{t[name]:.2f}" if name in t else ""
                for name in ("one_factorisation_downdated", "one_factorisation_a_step", "one_refit_per_candidate")
            ),
            "yes" if r["same_groups"] else "**no**",
        ]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def _outcome(row: dict) -> str:
    if row["status"] == "skipped":
        return "skipped"
    return "passed" if row["status"] == "ok" and row["passed"] else "not passed"


#: The rows of the summary: what a user choosing a method compares (variant name in the depth tables -> label).
GLANCE_ROWS = {
    "auto_down_todays_flattengpt": "`auto` (six of its eight default candidates)",
    "auto_ten_candidates": "`auto` with the ten candidates before",
    "replaceme_lstsq_down": '`replaceme`, `estimator="lstsq_down"`',
    "replaceme": "`replaceme` (the paper's)",
    "flattengpt_defaults_lstsq_down": '`flattengpt` + `linear_replacement="lstsq_down"`',
    "flattengpt": "`flattengpt` (defaults)",
    "sleb_first_2_sequences": "`sleb`",
    "come": "`come`",
    "shortgpt": "`shortgpt`",
}


def glance_table(paths: dict[str, Path]) -> str:
    """One row per method a user would pick from, per model: quality on both texts, fidelity and cost."""
    header = (
        "| model (layers removed) | method | PPL ratio SOTU ≥ 2000 | PPL ratio KJV | KL SOTU / KJV | "
        "top-1 SOTU / KJV | stack passes |\n|---|---|---|---|---|---|---|"
    )
    rows = []
    for label, path in paths.items():
        data = json.loads(path.read_text())
        results = {r["variant"]: r for r in data["results"] if "error" not in r}
        dense = results["dense"]
        removed = data.get("protocol", {}).get("num_layers_to_remove", "")
        for variant, name in GLANCE_ROWS.items():
            r = results.get(variant)
            if r is None:
                continue
            rows.append(
                f"| {label} ({removed} of {dense['layers']}) | {name} | {_ratio(r, dense, 'perplexity')} | "
                f"{_ratio(r, dense, 'perplexity_kjv')} | {_fidelity(r, 'kl', 3)} | {_fidelity(r, 'top1_agreement', 3)} "
                f"| {r.get('cost_stack_passes') or ''} |"
            )
    return header + "\n" + "\n".join(rows)


#: The product page's rows: each method at its defaults (variant name in the depth tables -> label), plus the
#: variants a user is told to prefer. Ablations stay on the notebook page.
#: (The compensated drops, `uidl`/`shortgpt` with `compensation="scale"`, are in the notebook's tables.)
PRODUCT_ROWS = {
    "auto_default_candidates": "`auto`",
    "auto_down_todays_flattengpt": "`auto` (six of its eight default candidates)",
    "replaceme_lstsq_down": '`replaceme`, `estimator="lstsq_down"`',
    "replaceme": "`replaceme`",
    "replaceme_diagonal": '`replaceme`, `estimator="diagonal"`',
    "shortgpt_diagonal": '`shortgpt`, `linear_replacement="diagonal"`',
    "sleb_first_2_sequences_diagonal": '`sleb`, `linear_replacement="diagonal"`',
    "flattengpt_defaults_lstsq_down": '`flattengpt`, `linear_replacement="lstsq_down"`',
    "flattengpt": "`flattengpt`",
    "sleb_first_2_sequences": "`sleb`",
    "uidl": "`uidl`",
    "shortgpt": "`shortgpt`",
    "come": "`come`",
}

#: Healing rows on the product page: (method, mode, loss) -> label; the largest budget measured is shown. The other
#: modes (LoRA distilled, the changed weights, `local` without its global phase, which local then global passed at
#: every budget both ran, and a global phase of every weight, within 0.01 of the same-blocks one) are in the
#: notebook's healing table.
PRODUCT_HEALING = {
    ("flattengpt", "full", "distillation"): "`flattengpt`, healed: every weight distilled",
    ("shortgpt", "local", "distillation"): "`shortgpt`, healed: changed spans distilled locally",
    ("flattengpt", "lora", "lm"): "`flattengpt`, healed: LoRA on the LM loss",
    ("replaceme_lstsq_down", "full", "distillation"): '`replaceme`, `estimator="lstsq_down"`, healed: every weight '
    "distilled",
    ("flattengpt", "local_then_global", "distillation"): "`flattengpt`, healed: changed spans distilled locally, "
    "then together on the output",
    ("replaceme_lstsq_down", "local_then_global", "distillation"): '`replaceme`, `estimator="lstsq_down"`, healed: '
    "its bridged block distilled locally, then on the output",
    ("sleb_first_2_sequences_diagonal", "full", "distillation"): '`sleb`, `linear_replacement="diagonal"`, healed: '
    "every weight distilled",
}


def _product_mode(run: dict) -> str:
    """A run's mode on the product page: `local` with a global phase after it is a mode of its own there, and one
    whose global phase trained every weight (`global_scope="all"`) another."""
    phase = run["recovery"].get("global_phase")
    if not phase:
        return run["mode"]
    return "local_then_global_all" if phase.get("trained") == "every parameter" else "local_then_global"


def _kilo_tokens(count: int) -> str:
    """2¹⁰ tokens as "K", 2²⁰ as "M" (the budgets the issue names: 64K, 256K, 1M)."""
    return f"{count // 2**20}M" if count >= 2**20 and count % 2**20 == 0 else f"{count // 1024}K"


def _budget_words(run: dict) -> str:
    """The tokens a run trained on: one budget, or the local and the global phase's."""
    phase = run["recovery"].get("global_phase")
    total = run["recovery"]["tokens_trained"]
    if not phase:
        return f"{_kilo_tokens(total)} tokens"
    return f"{_kilo_tokens(total - phase['tokens_trained'])} + {_kilo_tokens(phase['tokens_trained'])} tokens"


def _geomean(a: float, b: float) -> float:
    return (a * b) ** 0.5


def product_table(quality: Path, healing: list[Path]) -> str:
    """One model and depth: each method at its defaults and the healed rows, sorted by the geometric mean of the two
    perplexity ratios (in and out of domain, so that a row cannot win by fitting the calibration's genre); the best
    training-free row is marked as the recommendation."""
    data = json.loads(quality.read_text())
    results = {r["variant"]: r for r in data["results"] if "error" not in r}
    dense = results["dense"]
    rows = []
    for variant, label in PRODUCT_ROWS.items():
        r = results.get(variant)
        if r is None or r.get("perplexity_kjv") is None:
            continue
        sotu, kjv = r["perplexity"] / dense["perplexity"], r["perplexity_kjv"] / dense["perplexity_kjv"]
        rows.append(
            dict(
                label=label,
                sotu=sotu,
                kjv=kjv,
                kl=_fidelity(r, "kl", 3),
                top1=_fidelity(r, "top1_agreement", 3),
                passes=str(r.get("cost_stack_passes") or ""),
                seconds=f"{r['compress_seconds']:.0f}",
                rss=f"{r['peak_rss_mb']:.0f}",
                trained=False,
            )
        )
    best: dict[tuple, dict] = {}
    match = re.search(r"(\d+) scored tokens", data.get("protocol", {}).get("evaluation", ""))
    scored = int(match.group(1)) if match else None
    for path in healing:  # per method, mode and loss the largest budget; at equal budgets the best held-out run
        h = json.loads(path.read_text())
        key = (h["method"], _product_mode(h), h["loss"])
        if scored is not None and h["healed"]["sotu_from_2000"].get("scored_tokens") != scored:
            continue  # measured on other tokens than the table's rows: not comparable with them (the notebook has it)
        if not recovery_protocol.is_default(h.get("settings", {})):
            continue  # other rows or another seed: its gate held out other rows, so its objective ranks nothing here
        if key in PRODUCT_HEALING and (key not in best or _budget_then_gate(h) > _budget_then_gate(best[key])):
            best[key] = h
    for key, h in best.items():
        after = h["healed"]
        kept = "; no step beat the input: the gate kept it" if h["recovery"].get("gate") == "kept input weights" else ""
        rate = h["recovery"].get("learning_rate")
        rate = "" if rate is None or _default_rate(h) else f", lr {rate:.2g}"
        given = h.get("settings", {}).get("global_learning_rate")  # the global phase's, given by hand
        rate += f", global lr {given:.2g}" if given is not None else ""
        rate += _training_rows(h)
        sotu, kjv = after["sotu_from_2000"], after["bible_kjv"]
        rows.append(
            dict(
                label=f"{PRODUCT_HEALING[key]} ({_budget_words(h)}{rate}{kept})",
                sotu=sotu["ppl_ratio"],
                kjv=kjv["ppl_ratio"],
                kl=f"{sotu['kl']:.3f} / {kjv['kl']:.3f}",
                top1=f"{sotu['top1_agreement']:.3f} / {kjv['top1_agreement']:.3f}",
                passes="",
                seconds=f"{h['compress_seconds']:.0f} + {h['heal_seconds']:.0f} healing",
                rss=f"{h['peak_rss_mb']:.0f}",
                trained=True,
            )
        )
    # Equal quality goes to the cheaper search (auto finds ReplaceMe's model by compressing a copy with each candidate).
    rows.sort(key=lambda row: (round(_geomean(row["sotu"], row["kjv"]), 3), float(row["passes"] or 0)))
    untrained = [row for row in rows if not row["trained"]]
    recommended = untrained[0]["label"] if untrained else None
    lines = [
        "| method | PPL ratio SOTU ≥ 2000 | PPL ratio KJV | KL SOTU / KJV | top-1 SOTU / KJV | stack passes "
        "| compress s | peak RSS MB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        label = f"**{row['label']}** (recommended)" if row["label"] == recommended else row["label"]
        lines.append(
            f"| {label} | {row['sotu']:.3f} | {row['kjv']:.3f} | {row['kl']} | {row['top1']} | {row['passes']} "
            f"| {row['seconds']} | {row['rss']} |"
        )
    return "\n".join(lines)


def _budget_then_gate(run: dict) -> tuple[int, float]:
    """A healing run's rank among runs of one method, mode and loss: the tokens it trained on (both phases of a
    local run with a global phase), then its gate's held-out objective on the training text (lower is better; the
    evaluation texts do not choose)."""
    after = (run["recovery"].get("heldout_after") or {}).get("objective", float("inf"))
    return run["recovery"].get("tokens_trained", run["max_tokens"]), -after


def _training_rows(run: dict) -> str:
    """A healing run's training rows when they are not the default protocol's (length and rows per step), and its
    healing seed when not the default's (the held-out rows and the order of the training rows), and frozen
    embeddings, else nothing."""
    settings = run.get("settings", {})
    rows = recovery_protocol.training_rows(settings)
    default = rows == recovery_protocol.TRAINING_ROWS
    label = "" if default else f", rows of {rows['seqlen']} × {rows['batch_size']} a step"
    label += ", embeddings and LM head frozen" if recovery_protocol.frozen_embeddings(settings) else ""
    hidden = settings.get("hidden_weight") or 0.0
    label += f", hidden-state terms (weight {hidden:g}, each block against the teacher's state)" if hidden else ""
    label += f", healed on {text}" if (text := recovery_protocol.healing_text(settings)) else ""
    label += f", optimiser {optim}" if (optim := recovery_protocol.optimiser(settings)) else ""
    label += f", calibrated on {choice}" if (choice := recovery_protocol.calibration(settings)) else ""
    seed = recovery_protocol.seed(settings)
    return label + (f", healing seed {seed}" if seed != recovery_protocol.SEED else "")


def _state_loss(run: dict) -> str:
    """The state loss of a local run when it is not the default pooled one (runs before the option had none)."""
    loss = run["recovery"].get("state_loss")
    return f" ({loss} state loss)" if loss not in (None, "pooled") else ""


def _global_phase(run: dict) -> str:
    """A local run's global phase, when it had one: its tokens and rate (the tokens column counts both phases)."""
    phase = run["recovery"].get("global_phase")
    if not phase:
        return ""
    rate = phase.get("learning_rate") or run["recovery"].get("learning_rate")
    every = " of every weight" if phase.get("trained") == "every parameter" else ""
    return f", then global distillation{every} ({phase['tokens_trained']:,} tokens, lr {rate:.2g})"


def healing_table(paths: list[Path]) -> str:
    """benchmarks/recovery/run.py: each method × mode × loss × budget, before and after healing, on both texts."""
    header = (
        "| compressed by | trained | loss | tokens | scored per text | PPL ratio SOTU ≥ 2000 | PPL ratio KJV | "
        "KL SOTU / KJV | top-1 SOTU / KJV | greedy agreement SOTU / KJV | lr | gate | heal min | peak RSS MB |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    sotu, kjv = "sotu_from_2000", "bible_kjv"

    def pair(block: dict, key: str, digits: int) -> str:
        values = [block[text].get(key) for text in (sotu, kjv)]
        return " / ".join("–" if v is None else f"{v:.{digits}f}" for v in values)

    rows = []
    for path in paths:
        r = json.loads(path.read_text())
        before, after = r["untrained"], r["healed"]

        rows.append(
            f"| {r['method']} | {r['mode']}{_state_loss(r)}{_global_phase(r)}{_training_rows(r)} | {r['loss']} | "
            f"{r['recovery']['tokens_trained']:,} "
            f"| {after[sotu].get('scored_tokens', 0):,} "
            f"| {before[sotu]['ppl_ratio']:.3f} → **{after[sotu]['ppl_ratio']:.3f}** "
            f"| {before[kjv]['ppl_ratio']:.3f} → **{after[kjv]['ppl_ratio']:.3f}** "
            f"| {pair(after, 'kl', 4)} | {pair(after, 'top1_agreement', 3)} "
            f"| {pair(before, 'greedy_token_agreement', 3)} → {pair(after, 'greedy_token_agreement', 3)} "
            f"| {r['recovery']['learning_rate']:.2g} "
            f"| {r['recovery']['gate']} | {r['heal_seconds'] / 60:.1f} | {r['peak_rss_mb']:.0f} |"
        )
    return header + "\n" + "\n".join(rows)


def sampling_cell(record: dict) -> str:
    """The seconds a run's teacher text took to sample. Rows read back from a cache took none in that run: the seconds
    of the run that wrote them where the cache kept them, else "cached" rather than 0; empty without teacher text."""
    if record.get("cached"):
        first = (record.get("sampled") or {}).get("seconds")
        return "cached" if first is None else f"{first:.0f} (cached)"
    return "" if record.get("seconds") is None else f"{record['seconds']:.0f}"


def _kl_removed(run: dict, text: str) -> str:
    """The share of the untrained model's KL on `text` that the healing of `run` removed, as a percentage."""
    return f"{1 - run['healed'][text]['kl'] / run['untrained'][text]['kl']:.0%}"


def healing_text_table(paths: list[Path]) -> str:
    """The healing text compared on the same compression, mode and budget (`benchmarks/recovery/run.py
    --teacher-text`): the speeches, the dense model's own text and a mix, every healing seed a row, the default rows
    and AdamW only, so that the rows differ by the text alone. Runs whose compression, mode or budget has a single
    text are left out (the notebook's table has them). "KL removed" is the share of the untrained model's KL to the
    dense model that the healing took away on each text: how far it moved the student towards the teacher there,
    whatever the text's distance to start with."""
    groups: dict[tuple, list[dict]] = {}
    for path in paths:
        r = json.loads(path.read_text())
        settings = r.get("settings", {})
        rows = recovery_protocol.training_rows(settings)
        if rows != recovery_protocol.TRAINING_ROWS or recovery_protocol.frozen_embeddings(settings):
            continue
        if not recovery_protocol.default_loss(settings):
            continue
        if recovery_protocol.optimiser(settings) or r["recovery"].get("global_phase") or r["loss"] != "distillation":
            continue
        if recovery_protocol.calibration(settings):  # another untrained model than the group's (the notebook's)
            continue
        if not _default_rate(r):
            continue
        groups.setdefault((r["method"], r["mode"], r["recovery"]["tokens_trained"]), []).append(r)
    header = (
        "| compressed by | trained, tokens | healing text | seed | PPL ratio SOTU ≥ 2000 | PPL ratio KJV | geo. mean | "
        "KL SOTU / KJV | KL removed SOTU / KJV | top-1 SOTU / KJV | sampling s | heal min | peak RSS MB |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    lines = []
    for (method, mode, tokens), runs in sorted(groups.items()):
        if len({recovery_protocol.healing_text(r.get("settings", {})) for r in runs}) < 2:
            continue
        untrained = runs[0]["untrained"]
        lines.append(
            f"| {method} | untrained | – | – | {untrained['sotu_from_2000']['ppl_ratio']:.3f} "
            f"| {untrained['bible_kjv']['ppl_ratio']:.3f} "
            f"| {_geomean(untrained['sotu_from_2000']['ppl_ratio'], untrained['bible_kjv']['ppl_ratio']):.3f} "
            f"| {untrained['sotu_from_2000']['kl']:.3f} / {untrained['bible_kjv']['kl']:.3f} | – | – | – | – | – |"
        )
        runs.sort(
            key=lambda r: (
                recovery_protocol.healing_text(r.get("settings", {})),
                recovery_protocol.seed(r.get("settings", {})),
            )
        )
        for r in runs:
            settings = r.get("settings", {})
            after = r["healed"]
            sotu, kjv = after["sotu_from_2000"], after["bible_kjv"]
            sampling = sampling_cell(r.get("teacher_text") or {})
            lines.append(
                f"| {method} | {mode}, {tokens:,} | {recovery_protocol.healing_text(settings) or 'the speeches'} "
                f"| {recovery_protocol.seed(settings)} | {sotu['ppl_ratio']:.3f} | {kjv['ppl_ratio']:.3f} "
                f"| {_geomean(sotu['ppl_ratio'], kjv['ppl_ratio']):.3f} "
                f"| {sotu['kl']:.3f} / {kjv['kl']:.3f} "
                f"| {_kl_removed(r, 'sotu_from_2000')} / {_kl_removed(r, 'bible_kjv')} "
                f"| {sotu['top1_agreement']:.3f} / {kjv['top1_agreement']:.3f} "
                f"| {sampling} | {r['heal_seconds'] / 60:.1f} "
                f"| {r['peak_rss_mb']:.0f} |"
            )
    return header + "\n" + "\n".join(lines)


def makeup_table(paths: list[Path]) -> str:
    """`benchmarks/recovery/teacher_text_makeup.py`: what the dense model wrote, its training rows counted by script
    (the module's docstring states the rule) and by how much they repeat themselves, the healing speeches last for
    comparison."""
    header = (
        "| teacher | started from | rows | prose | code or markup | CJK | repeated 4-grams, median | rows looping |\n"
        "|---|---|---|---|---|---|---|---|"
    )
    rows = []
    runs = [json.loads(path.read_text()) for path in paths]
    for run in sorted(runs, key=lambda run: run["teacher"] is None):  # stable: the teachers in file order first
        sampling = run["sampling"]
        if run["teacher"] is None:
            teacher, start = f"– (the healing speeches, {run['model']}'s tokens)", "–"
        else:
            teacher = run["teacher"]
            start = {
                "chat": "the chat template's assistant turn",
                "random": "the BOS token, a word drawn from the vocabulary, 4 greedy words",
            }.get(sampling.get("start"), "the BOS token")
            start = f"{start}, then the speeches' paragraphs" if sampling.get("prompts") else start
            start = f"{start}, top-p {sampling['top_p']}" if sampling.get("top_p") else start
        counts = run["counts"]
        repetition = run.get("repetition")
        repeated = f"{repetition['median']:.1%} | {repetition['looping_rows']}" if repetition else "– | –"
        rows.append(
            f"| {teacher} | {start} | {run['rows']} | "
            + " | ".join(str(counts.get(k, 0)) for k in ("prose", "code or markup", "CJK"))
            + f" | {repeated} |"
        )
    return header + "\n" + "\n".join(rows)


def footprint_table(paths: list[Path]) -> str:
    """`benchmarks/recovery/footprint.py`: what `mode='full'` added to the process's memory against the estimate the
    default mode follows (`recovery.footprint`), one row per model, dtype and batch."""
    header = (
        "| model | dtype | layers removed | batch × seqlen | student weights GiB | measured GiB | estimated GiB "
        "(state + activations) | measured / estimated |\n|---|---|---|---|---|---|---|---|"
    )
    rows = []
    gib = 2**30
    for path in paths:
        run = json.loads(path.read_text())
        for point in run["points"]:
            estimated = point["estimated"]
            rows.append(
                f"| {run['model']} | {run['dtype']} | {run['layers_removed']} | {point['batch']} × {point['seqlen']} "
                f"| {point['student_weight_bytes'] / gib:.2f} | {point['measured_bytes'] / gib:.2f} "
                f"| {point['estimated_bytes'] / gib:.2f} ({estimated['state'] / gib:.2f} + "
                f"{estimated['activations'] / gib:.2f}) | {point['measured_bytes'] / point['estimated_bytes']:.2f} |"
            )
    return header + "\n" + "\n".join(rows)


def heal_gpu_table(paths: list[Path]) -> str:
    """`benchmarks/cost/heal_shape.py`: what each healing mode held and how fast it trained at a real model shape on a
    GPU, with the footprint the default mode follows as the code estimates it today (`footprint_today`), and the
    teacher's sampling speed where the run measured it."""
    from benchmarks.cost.heal_shape import default_today, footprint_today

    header = (
        "| run | device | dtype | student | rows × tokens a step | mode | optimiser | embeddings | steps | train tok/s "
        "| rise GiB: allocated / reserved | estimate today GiB (state + activations) | estimate / reserved |\n"
        + "|---" * 13
        + "|"
    )
    rows, sampling, defaults = [], [], []
    for path in paths:
        run = json.loads(path.read_text())
        shapes = run["shapes"]
        name = path.stem.removeprefix("heal_gpu_")
        student = f"{shapes['student_layers']} of {shapes['num_hidden_layers']} layers, {run['student_gib']:.1f} GiB"
        for label, mode in run["modes"].items():
            reserved = mode.get("reserved_rise_gib")
            estimate = ratio = "–"
            if mode["mode"] == "full":
                today = footprint_today(run, label)
                estimate = f"{(today.state + today.activations) / 2**30:.1f} ({today.state / 2**30:.1f} + "
                estimate += f"{today.activations / 2**30:.1f})"
                if reserved:
                    ratio = f"{(today.state + today.activations) / 2**30 / reserved:.2f}"
            rows.append(
                f"| {name} | {run['device']} | {run['dtype']} | {student} | {shapes['rows_per_step']} × "
                f"{shapes['seqlen']} | {mode['mode']} | {mode['optimizer']} | {mode['embeddings'].split(' ')[0]} | "
                f"{mode['steps']} | {mode['train_tokens_per_second']:.0f} | {mode['rise_gib']:.1f} / "
                f"{f'{reserved:.1f}' if reserved else '–'} | {estimate} | {ratio} |"
            )
        if run.get("sampling"):
            got = run["sampling"]
            sampling.append(
                f"{name}: {got['rows']} rows of {got['seqlen']} tokens from a random first token in one batch, "
                f"{got['seconds']:.1f} s, {got['generated_tokens_per_second']:.0f} generated tokens/s, "
                f"{got['rise_gib']:.1f} GiB above the teacher"
            )
        if not defaults:  # at the default batch whatever the run's, so one reading: the shapes are the same
            defaults = [f"{total} GiB → {default_today(run, total)}" for total in (80, 141)]
    return (
        header
        + "\n"
        + "\n".join(rows)
        + "\n\nThe teacher's sampling (`sample_teacher_rows`, the batch sized to the free memory): "
        + "; ".join(sampling)
        + ".\n\nThe mode `recover` picks by default today (4 rows of 256 tokens a step) on a device that holds the "
        + "teacher and the student: "
        + "; ".join(defaults)
        + "."
    )


def tables() -> dict[str, str]:
    """Every table, by the marker name that `RESULTS.template.md` uses (``<!-- table:NAME -->``)."""
    renderers = {"depth": depth_table, "quality": depth_table, "speed": speed_table, "scale": scale_table}
    out = {}
    for path in sorted(RESULTS.glob("*.json")):
        kind, _, model = path.stem.partition("_")
        if path.stem in ("smollm2", "qwen2.5-0.5b"):
            out[f"depth:{path.stem}"] = depth_table(path)
        elif kind in renderers and model:
            out[f"{kind}:{model}"] = renderers[kind](path)
        elif kind == "search" and model:
            out[f"search:{model}"] = search_table(path)
    if (RESULTS / "families.json").exists() and "families_table" in globals():
        out["families"] = globals()["families_table"](RESULTS / "families.json")
    # By shape, then the runs before a change first, as they were measured.
    gpu_runs = sorted(RESULTS.glob("cost_gpu_*.json"), key=lambda p: ("70b" in p.stem, "before" not in p.stem, p.stem))
    if gpu_runs:
        out["cost:gpu"] = gpu_cost_table(gpu_runs)
        latest = [p for p in gpu_runs if p.stem in GPU_SUMMARY_RUNS]
        if latest:
            out["cost:gpu-summary"] = gpu_cost_table(latest)
    for model in sorted({p.stem.split("_")[1] for p in RESULTS.glob("cost_*.json")} - {"gpu"}):
        runs = sorted(RESULTS.glob(f"cost_{model}*.json"), key=lambda p: (not p.stem.endswith("before"), p.stem))
        out[f"cost:{model}"] = cost_table(runs)
    for model in sorted({p.stem.split("_")[1] for p in RESULTS.glob("curve_*_*.json")}):
        out[f"curve:{model}"] = curve_table(model)
    quality = {"SmolLM2-135M": RESULTS / "quality_smollm2.json", "Qwen2.5-0.5B": RESULTS / "quality_qwen2.5-0.5b.json"}
    if all(path.exists() for path in quality.values()):
        out["glance"] = glance_table(quality)
    for model in ("smollm2", "qwen2.5-0.5b", "gemma3-270m"):
        if (RESULTS / f"quality_{model}.json").exists():
            out[f"product:{model}"] = product_table(
                RESULTS / f"quality_{model}.json", sorted(RESULTS.glob(f"recovery_{model}_*.json"))
            )
    for model in ("smollm2", "qwen2.5-0.5b", "gemma3-270m"):
        if healing := sorted(RESULTS.glob(f"recovery_{model}_*.json")):
            out[f"healing:{model}"] = healing_table(healing)
            out[f"healing_text:{model}"] = healing_text_table(healing)
    if makeups := sorted(RESULTS.glob("teacher_text_makeup_*.json")):
        out["teacher_text_makeup"] = makeup_table(makeups)
    if heals := sorted(RESULTS.glob("heal_gpu_*.json")):
        out["heal:gpu"] = heal_gpu_table(heals)
    if footprints := sorted(RESULTS.glob("footprint_*.json")):
        out["footprint"] = footprint_table(footprints)
    if (RESULTS / "clients.json").exists():
        out["clients"] = clients_table(RESULTS / "clients.json")
    if (RESULTS / "kv_search.json").exists():
        out["kv_search"] = kv_search_table(RESULTS / "kv_search.json")
    return out


#: Each page and the template it is filled from: the product page (one table per model and depth) and the notebook
#: (every ablation, protocol detail and the dated history), both from the same JSON.
PAGES = {"RESULTS.md": "RESULTS.template.md", "NOTEBOOK.md": "NOTEBOOK.template.md"}


def write_results() -> list[Path]:
    """Fills each template's markers with the tables and writes its page (commentary stays by hand)."""
    rendered = tables()
    written = []
    for page, template_name in PAGES.items():
        template = (Path(__file__).parent / template_name).read_text()
        missing = [m for m in re.findall(r"<!-- table:([^ ]+) -->", template) if m not in rendered]
        if missing:
            raise SystemExit(f"no results for {missing} ({template_name}); run the benchmarks that produce them first")
        out = Path(__file__).parent / page
        out.write_text(re.sub(r"<!-- table:([^ ]+) -->", lambda m: rendered[m.group(1)], template))
        written.append(out)
    readme = Path(__file__).parents[1] / "README.md"
    text = readme.read_text()
    quoted = re.sub(
        r"(<!-- results:([^ ]+) -->\n)(?:.*?\n)?(<!-- /results -->)",
        lambda m: m.group(1) + rendered[m.group(2)] + "\n" + m.group(3),
        text,
        flags=re.S,
    )
    if quoted != text:
        readme.write_text(quoted)
        written.append(readme)
    return written


def main() -> None:
    if "--write" in sys.argv:
        print("wrote " + ", ".join(str(path) for path in write_results()))
        return
    for name, table in tables().items():
        print(f"### {name}\n\n{table}\n")


if __name__ == "__main__":
    main()
