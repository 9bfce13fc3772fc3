"""The README.md model card written beside a compressed checkpoint, generated from the report."""

from __future__ import annotations

from typing import Any


def render_model_card(report: dict[str, Any]) -> str:
    """Markdown card: base model, method, what was merged or removed, calibration, measured quality, how to load."""
    plan = report.get("plan", {})
    groups = plan.get("groups", [])
    merged = [g for g in groups if len(g) > 1]
    calibration = report.get("calibration", {})
    base, on_hub = card_base_name(report)
    lines = [
        "---",
        # Only a Hub id: the Hub links `base_model` to that repo, and a local folder name would point at a stranger's.
        *([f"base_model: {base}"] if on_hub else []),
        *([f"license: {report['license']}"] if report.get("license") else []),
        "library_name: transformers",
        "tags:",
        "- optimum-flatten",
        f"- {report.get('method', 'unknown')}",
        "- depth-compression",
        "---",
        "",
        f"# {base} compressed with optimum-flatten ({report.get('method', '?')})",
        "",
        _summary(report),
        "",
        "## What was done",
        "",
        f"- Method: `{report.get('method')}` with options `{report.get('method_args', {})}`",
    ]
    if not on_hub and base != "unknown":
        lines.append(f"- Base model: `{base}`, a local checkpoint folder (not a Hub repo)")
    if report.get("plan_summary"):
        lines.append(f"- Plan: {report['plan_summary']}")
    for stack, layout in (report.get("mlp_layout") or {}).items():
        lines.append(
            f"- {stack}: MLPs collapsed into one linear map in layers {layout['collapsed']}"
            + (f", learned linearity alpha still in layers {layout['linearisable']}" if layout["linearisable"] else "")
        )
    if merged:
        lines.append(f"- Merged groups (original 0-based layer indices): {merged}")
    for group in report.get("ffn_groups") or []:
        lines.append(f"- Feed-forward sublayers shared by layers {group['layers']} ({group.get('stack', 'decoder')})")
    dropped = sorted(set(range(plan.get("num_layers", 0))) - {i for g in groups for i in g})
    if dropped:
        lines.append(f"- Removed layers (original 0-based indices): {dropped}")
    lines += _correction_lines(report)
    lines += _method_lines(report)
    lines.append(f"- Parameters: {describe_parameters(report)}")
    if calibration:
        lines.append(
            f"- Calibration: {calibration.get('dataset')}, {calibration.get('nsamples')} sequences x "
            f"{calibration.get('seqlen')} tokens ({calibration.get('tokens')} tokens), seed {calibration.get('seed')}"
        )
    if report.get("total_seconds") is not None:
        lines.append(f"- Compression wall time: {report['total_seconds']} s")
    lines.append("")
    if report.get("similarity") is not None:
        lines += ["![Layer-input similarity, merged groups outlined](similarity_heatmap.png)", ""]
    evaluation = report.get("evaluation")
    if evaluation:
        lines += ["## Measured", "", "| model | perplexity | protocol |", "|---|---|---|"]
        for name in ("dense", "compressed"):
            if name in evaluation:
                entry = evaluation[name]
                lines.append(f"| {name} | {entry['perplexity']:.3f} | {entry.get('protocol', '')} |")
        agreement = evaluation.get("fidelity")
        if agreement:
            lines += [
                "",
                f"Fidelity to the dense model on the same tokens: mean KL(dense ‖ compressed) "
                f"{agreement['kl']:.4f} nats per token, top-1 next-token agreement {agreement['top1_agreement']:.3f}.",
            ]
        lines.append("")
    loader, remote = _loader(report), bool((report.get("load_with") or {}).get("trust_remote_code"))
    lines += [
        "## How to load",
        "",
        "```python",
        f"from transformers import {loader}, AutoTokenizer",
        f'model = {loader}.from_pretrained("path/or/repo"{", trust_remote_code=True" if remote else ""})',
        'tokenizer = AutoTokenizer.from_pretrained("path/or/repo")',
        "```",
        "",
        "## Licence",
        "",
        (
            f"{report['license']}, carried over from the base model."
            if report.get("license")
            else "The licence of the base model applies to this derivative."
        ),
        "",
        "`flatten_report.json` holds the full plan, scores, similarity matrix and timings.",
        "",
    ]
    return "\n".join(lines)


def card_base_name(report: dict[str, Any]) -> tuple[str, bool]:
    """(name, on_hub) of the base model for the card: its Hub id, else its folder name, never an absolute path.

    Reports written by this version carry ``base_model_on_hub``; for an older report (which may hold the absolute
    local path the model was loaded from) the name is cleaned here, so such a path never reaches a published card.
    """
    from ..utils.loading import public_base_name

    name = str(report.get("base_model") or "unknown")
    if name == "unknown":
        return name, False
    if "base_model_on_hub" in report:
        return public_base_name(name)[0] if not report["base_model_on_hub"] else name, bool(report["base_model_on_hub"])
    return public_base_name(name)


def _summary(report: dict[str, Any]) -> str:
    architecture = report.get("architecture", "transformers")
    if report.get("export_format") == "remote_code":
        # LayerCollapse with per-layer MLP shapes: the modelling file beside the weights subclasses the stock class.
        return (
            f"This checkpoint is `{architecture}` with some MLPs collapsed into one linear map (or carrying a learned "
            "linearity alpha), which no stock config can describe. The modelling file in this directory (listed in "
            "config.json's `auto_map`) subclasses the stock class; load it with `trust_remote_code=True`. It needs "
            "torch and transformers only, not optimum-flatten."
        )
    if report.get("export_format") == "stock":
        return (
            f"This is an ordinary `{architecture}` checkpoint whose MLPs are each one linear map (LayerCollapse), "
            "stored as an MLP of width = hidden size with a linear activation and an identity down map. It loads "
            "with plain `transformers`; optimum-flatten is not needed."
        )
    if report.get("ffn_groups"):
        # ffn_merge keeps every layer; the file stores each shared MLP in full, so it loads anywhere.
        groups = [g["layers"] for g in report["ffn_groups"]]
        return (
            f"This is an ordinary `{architecture}` checkpoint whose layers {groups} share their feed-forward "
            "parameters. The stock format has no way to say that two layers use one MLP (its config gives every "
            "layer its own, and `model.safetensors` stores no aliases), so each layer's copy is stored in full: "
            "the file is as large as the base model's, and a plain `from_pretrained` loads as many parameters as "
            "the base has. That is what makes it load with plain `transformers` and every tool built on it; "
            "`optimum_flatten.methods.ffn_merge.retie_ffn_(model, report)` (with flatten_report.json) makes the "
            "identical copies one tensor again, and only then is the model smaller, in memory."
        )
    return (
        f"This is an ordinary `{architecture}` checkpoint with {report.get('num_layers_after', '?')} layers instead "
        f"of {report.get('num_layers_before', '?')}. It loads with plain `transformers`; optimum-flatten is not needed."
    )


def _loader(report: dict[str, Any]) -> str:
    """The class to load the checkpoint with: the remote-code Auto class when there is one, else the architecture
    itself unless it is a causal LM."""
    if report.get("load_with"):
        return report["load_with"]["class"]
    architecture = report.get("architecture", "")
    return "AutoModelForCausalLM" if not architecture or architecture.endswith("ForCausalLM") else architecture


def _correction_lines(report: dict[str, Any]) -> list[str]:
    """The correction folded at the cuts (linear replacement or magnitude compensation), if any."""
    lines = []
    bridge = report.get("linear_replacement")
    if bridge:
        spans = [m["span"] for m in bridge.get("maps", [])]
        lines.append(
            f"- Linear replacement ({bridge.get('estimator')}): a fitted map folded into the down projection that ends "
            f"each span of original layers {spans}"
        )
    compensation = report.get("compensation")
    if compensation:
        alphas = ", ".join(f"layer {k}: {v:.4f}" for k, v in compensation.get("alpha", {}).items())
        lines.append(f"- Magnitude compensation (Prune&Comp) folded upstream of each removed layer: {alphas}")
    return lines


def _method_lines(report: dict[str, Any]) -> list[str]:
    """Lines the method itself adds (its `card_lines`); none for a method this version does not know."""
    from ..methods.registry import get_method_class
    from ..utils.errors import UnknownMethodError

    try:
        return list(get_method_class(str(report.get("method"))).card_lines(report))
    except UnknownMethodError:
        return []


def describe_parameters(report: dict[str, Any]) -> str:
    """The parameter counts of a report as a plain reload has them (the card's line and the CLI summary).

    For ffn_merge the count after compression is the in-memory one (tied MLPs counted once), which a plain
    `from_pretrained` does not have: the file stores each shared MLP in full. Its line gives what the file holds
    and a plain reload loads first, then what `retie_ffn_` leaves in memory, so no reader takes the smaller number
    for the checkpoint's size. Reports written before the method recorded its file count fall back to the count
    before compression (ffn_merge changes no tensor shape).
    """
    before, after = report.get("parameters_before"), report.get("parameters_after")
    if not isinstance(before, int) or not isinstance(after, int):
        return "see flatten_report.json"
    if not report.get("ffn_groups"):
        return f"{before:,} -> {after:,}"
    in_file = report.get("ffn_parameters_in_file", before)
    in_memory = report.get("ffn_parameters_in_memory", after)
    text = f"{before:,} -> {in_file:,} in the checkpoint (model.safetensors, and a plain from_pretrained)"
    if in_memory != in_file:
        text += f"; {in_memory:,} in memory after retie_ffn_"
    file_bytes, memory_bytes = report.get("ffn_bytes_in_file"), report.get("ffn_bytes_in_memory")
    if isinstance(file_bytes, int) and isinstance(memory_bytes, int):
        text += f" (weights {_megabytes(file_bytes)} in the file"
        text += f", {_megabytes(memory_bytes)} in memory after retie_ffn_)" if memory_bytes != file_bytes else ")"
    return text


def _megabytes(size: int) -> str:
    return f"{size / 1e6:,.1f} MB"
