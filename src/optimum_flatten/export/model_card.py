"""The README.md model card written beside a compressed checkpoint, generated from the report."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..compression.method import CardSection


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
    if merged:
        lines.append(f"- Merged groups (original 0-based layer indices): {merged}")
    dropped = sorted(set(range(plan.get("num_layers", 0))) - {i for g in groups for i in g})
    if dropped:
        lines.append(f"- Removed layers (original 0-based indices): {dropped}")
    lines += _correction_lines(report)
    lines += [line for section in method_sections(report) for line in section.lines]
    lines.append(f"- Parameters: {describe_parameters(report)}")
    images = bool(calibration) and calibration.get("inputs") == "images"  # positions are CLS and patches, no seqlen
    if images:
        lines.append(
            f"- Calibration: {calibration.get('dataset')}, {calibration.get('nsamples')} images "
            f"({calibration.get('tokens')} positions, CLS and patches), seed {calibration.get('seed')}"
        )
    elif calibration:
        lines.append(
            f"- Calibration: {calibration.get('dataset')}, {calibration.get('nsamples')} sequences x "
            f"{calibration.get('seqlen')} tokens ({calibration.get('tokens')} tokens), seed {calibration.get('seed')}"
            + _own_text_words(calibration.get("own_text"))
        )
    if report.get("total_seconds") is not None:
        lines.append(f"- Compression wall time: {report['total_seconds']} s")
    lines += _training_lines(report)
    lines += _recovery_lines(report)
    lines.append("")
    for figure in (figure for section in method_sections(report) for figure in section.figures):
        lines += [f"![{figure.caption}]({figure.file_name})", ""]
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
    processor, variable = ("AutoImageProcessor", "processor") if images else ("AutoTokenizer", "tokenizer")
    lines += [
        "## How to load",
        "",
        "```python",
        f"from transformers import {loader}, {processor}",
        f'model = {loader}.from_pretrained("path/or/repo"{", trust_remote_code=True" if remote else ""})',
        f'{variable} = {processor}.from_pretrained("path/or/repo")',
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
    """The opening paragraph: a method's own (what its checkpoint holds beyond the layer count), else the generic."""
    summary = next((section.summary for section in method_sections(report) if section.summary), None)
    if summary is not None:
        return summary
    architecture = report.get("architecture", "transformers")
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


def _training_lines(report: dict[str, Any]) -> list[str]:
    """The training `optimum-flatten layer-collapse` ran before its collapse: every weight fine-tuned, which the
    compression's own lines (a wall time of a fraction of a second, a few calibration sequences) would hide."""
    training = report.get("training")
    if not isinstance(training, dict) or not isinstance(training.get("snap"), dict):
        return []
    steps = " + ".join(f"{training[p]['steps']} {p}" for p in ("pull", "snap") if isinstance(training.get(p), dict))
    on = training.get("dataset", "the user's text")
    kind = f" ({training['text_kind']} records)" if training.get("text_kind") in ("alpaca", "chat") else ""
    reads = f", {training['rows_read']} row reads" if "rows_read" in training else ""
    return [
        f"- Training before the collapse (AdamLC, every weight): {steps} steps on {on}{kind}{reads}; alpha after: "
        f"{training['snap'].get('alpha_after')}"
    ]


def _recovery_lines(report: dict[str, Any]) -> list[str]:
    """What healing after the compression trained, on what, and what the held-out gate decided."""
    recovery = report.get("recovery")
    if not isinstance(recovery, dict):
        return []
    if recovery.get("skipped"):
        return [f"- Healing: not run; {recovery['skipped']}"]
    teacher = recovery.get("teacher")
    loss = f"distilled from `{teacher}`" if teacher else "LM loss"
    rows, seqlen = recovery.get("rows_per_step"), recovery.get("seqlen")
    shape = f" of {rows} rows x {seqlen} tokens a process" if rows and seqlen else ""  # reports before it: no shape
    lines = [
        f"- Healing: mode `{recovery.get('mode', 'lora')}`{_chosen(recovery)}, {loss}, on "
        f"{_healing_text(recovery)} "
        f"({recovery.get('tokens_trained', '?')} tokens, {recovery.get('steps', '?')} steps{shape})"
        + ("; the token embeddings and the LM head were not trained" if recovery.get("embeddings") else "")
    ]
    lines += _local_lines(recovery)
    before, after = recovery.get("heldout_before"), recovery.get("heldout_after")
    if before and after:
        lines.append(
            f"- Held-out loss of the training text: objective {before['objective']:.4f} -> {after['objective']:.4f}, "
            f"LM {before['lm']:.4f} -> {after['lm']:.4f}; gate: {recovery.get('gate')}"
        )
    guard = recovery.get("guard")
    if isinstance(guard, dict) and guard.get("before") and guard.get("after"):
        lines.append(
            f"- Guard text (not allowed to get worse): objective {guard['before']['objective']:.4f} -> "
            f"{guard['after']['objective']:.4f}"
        )
    return lines


#: How the card says where the teacher's sampled rows start (`RecoveryConfig.sampling_start`, or prompts).
_STARTS = {
    "bos": "from its start token",
    "prompts": "continuing the user's prompts",
    "chat": "as a chat assistant",
    "random": "from a random first token",
}


def _healing_text(recovery: dict[str, Any]) -> str:
    """The text the healing trained on: the user's (by its public name), the teacher's own (how it started), or
    a mix of both with the teacher's share; a text the teacher wrote whole is not named after the user's file."""
    name = recovery.get("dataset", "user text")
    sampled = recovery.get("teacher_text")
    if not isinstance(sampled, dict) or recovery.get("data_kind") not in ("teacher", "mixed"):
        return str(name)
    start = _STARTS.get(str(sampled.get("start")), "")
    teacher = "the teacher's own text" + (f" ({start})" if start else "")
    if recovery.get("data_kind") == "teacher":
        return teacher
    return f"{float(sampled.get('share', 0)):.0%} {teacher}, the rest {name}"


def _chosen(recovery: dict[str, Any]) -> str:
    """ " (the default)" when the mode was not given; the memory check behind it stays in the report."""
    return " (the default)" if str(recovery.get("mode_chosen", "given")).startswith("the default") else ""


def _local_lines(recovery: dict[str, Any]) -> list[str]:
    """Mode 'local': which blocks were trained, towards which of the teacher's layers, and the global phase."""
    local = recovery.get("local")
    if not isinstance(local, dict):
        return []
    spans = ", ".join(
        f"block {s['block']} (original layers {s['original_layers'][0]}-{s['original_layers'][1]})"
        for s in local.get("spans", [])
    )
    phase = recovery.get("global_phase")
    phase = phase if isinstance(phase, dict) else None
    every = phase is not None and phase.get("trained") == "every parameter"  # a global phase trained them all
    lines = [
        f"- Trained locally, each alone on the teacher's state at its span's start towards the teacher's state at its "
        f"end (normalised MSE): {spans}" + ("" if every else "; every other parameter is unchanged")
    ]
    if "heldout_local_before" in local:
        lines[0] += f"; held-out local loss {local['heldout_local_before']:.4f} -> {local['heldout_local_after']:.4f}"
    if phase is not None:
        what = "every parameter" if every else "the same blocks"
        lines.append(f"- Then {what} on the global distillation loss for {phase.get('tokens_trained')} tokens")
    return lines


def method_sections(report: dict[str, Any]) -> list[CardSection]:
    """Every registered method's `card_section` for `report`, the report's own method first, then by name.

    Every method is asked because some entries describe the model rather than the run (a checkpoint written by a
    method's writer after another method compressed it); each answers only from the entries it writes, so the card
    names no method. A report of a method this version does not know gets the others' sections only.
    """
    from ..registry import get_method_class, registered_methods

    own = str(report.get("method"))
    names = sorted(registered_methods(), key=lambda name: name != own)
    sections: list[CardSection] = []
    for name in names:  # methods sharing a base class answer alike for one report: keep one copy of each answer
        section = get_method_class(name).card_section(report)
        if section is not None and section not in sections:
            sections.append(section)
    return sections


def describe_parameters(report: dict[str, Any]) -> str:
    """The parameter counts of a report as a plain reload has them (the card's line and the CLI summary).

    A method whose checkpoint holds another count than the model in memory says so through its `card_section`
    (its ``parameters``), so no reader takes the in-memory number for the checkpoint's size.
    """
    before, after = report.get("parameters_before"), report.get("parameters_after")
    if not isinstance(before, int) or not isinstance(after, int):
        return "see flatten_report.json"
    text = next((section.parameters for section in method_sections(report) if section.parameters), None)
    return text if text is not None else f"{before:,} -> {after:,}"


def _own_text_words(own: dict[str, Any] | None) -> str:
    """What the card adds to the calibration line when the model wrote part of it (`CalibrationConfig.own_text`)."""
    if not own:
        return ""
    return (
        f"; {own['rows']} of the sequences written by the model itself before it was compressed "
        f"(own_text={own['share']:g}: from its start token, temperature 1)"
    )
