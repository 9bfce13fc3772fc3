"""What `compress` and `demo` print: the summary table of a compression and the warnings its report holds."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

logger = logging.getLogger(__name__)


def text_table(rows: Sequence[Sequence[Any]], header: Sequence[str]) -> str:
    cells = [[str(c) for c in header]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = [" | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def bundled_license(model_name: str) -> str | None:
    from ..bundled import BUNDLED_MODELS

    spec = BUNDLED_MODELS.get(model_name)
    return spec.license if spec else None


def report_warnings(report: dict[str, Any]) -> list[str]:
    """Warnings the compression recorded in its report, as the methods' card sections state them (a merged model
    whose calibration loss rose past its bound, for one)."""
    from ..export.model_card import method_sections

    warnings = [warning for section in method_sections(dict(report)) for warning in section.warnings]
    if skipped := (report.get("recovery") or {}).get("skipped"):  # a heal= the plan left nothing to train for
        warnings.append(skipped)
    return warnings


def compression_summary(report: dict[str, Any]) -> str:
    from ..export.model_card import describe_parameters  # as the card says it (ffn_merge: file and memory apart)

    rows = [
        ("method", report["method"]),
        ("plan", report["plan_summary"]),
        ("layers", f"{report['num_layers_before']} -> {report['num_layers_after']}"),
        ("parameters", describe_parameters(report)),
        ("calibration tokens", report["calibration"]["tokens"]),
        ("compression seconds", report["total_seconds"]),
    ]
    if own := report["calibration"].get("own_text"):
        cost = (own.get("sampled") or own)["seconds"]  # read back: the first attempt's sampling, not the read

        read_back = " (read back from --resume-dir)" if own.get("cached") else ""
        sampled = f"{own['rows']} of {report['calibration']['nsamples']}, sampled in {cost:.0f} s{read_back}"
        rows.insert(-1, ("the model's own sequences", sampled))
    if (processes := report["calibration"].get("processes", 1)) > 1:
        rows.insert(-1, ("calibrated by", f"{processes} processes, each on its share of the batches"))
    healing = report.get("recovery")
    if healing and healing.get("skipped"):
        rows.append(("healing", f"skipped ({healing['mode']}: nothing to train)"))
    elif healing:
        held_out = ""
        before, after = healing.get("heldout_before") or {}, healing.get("heldout_after") or {}
        if "objective" in before and "objective" in after:
            held_out = f", held-out objective {before['objective']:.4f} -> {after['objective']:.4f}"
        rows.append(
            (
                "healing",
                f"{healing['mode']} on {healing['tokens_trained']} tokens ({healing['loss']}){held_out}, "
                f"{healing['gate']}",
            )
        )
    return text_table(rows, ("", "value"))


def own_text_lines(report: dict[str, Any]) -> list[str]:
    """What the model wrote for its own calibration (`CalibrationConfig.own_text`), for a person to judge before
    trusting the compression: the first row's opening and how much the rows repeat themselves. A code or chat model
    writes code or loops from its start token, and its own rows then calibrate for that (benchmarks/NOTEBOOK.md)."""
    from ..recovery.text_repetition import describe

    own = report.get("calibration", {}).get("own_text") or {}
    lines = [f"the model's own calibration text began: {own['excerpts'][0][:160]!r}"] if own.get("excerpts") else []
    if own.get("repetition"):
        repeated = describe(own["repetition"], "a compression calibrated on it")
        lines.append(f"the model's own calibration text: {repeated}")
    return lines


def healing_notes(log: dict[str, Any], checkpoint_dir: str | None) -> list[str]:
    """What a healing leaves a person to act on, for `recover` and `compress --heal-tokens` alike: the checkpoints
    still on disk (up to two a phase, optimiser state included: often GBs) and a gate that saw the teacher's rows
    only (`recovery.rows.UNGUARDED_NOTE`)."""
    from ..recovery.resume import phase_folders
    from ..recovery.rows import UNGUARDED_NOTE

    lines = []
    if log.get("checkpoint_bytes") and checkpoint_dir:
        # The phases' folders by name, not the folder given: it may hold the user's own files beside them.
        phases = ", ".join(path.name for path in phase_folders(checkpoint_dir))
        lines.append(
            f"checkpoints: {log['checkpoint_bytes'] / 2**30:.2f} GiB left in {checkpoint_dir} ({phases}), needed "
            "only to resume this healing; remove those folders once the healed model is saved"
        )
    if UNGUARDED_NOTE in log.get("notes", ()):
        lines.append(UNGUARDED_NOTE)
    return lines
