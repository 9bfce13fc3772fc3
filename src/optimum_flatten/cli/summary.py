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
