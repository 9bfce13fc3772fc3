"""``method="auto"``: the best candidate compression for this model, chosen on held-out calibration loss.

The calibration batches are split in two: the first part fits every candidate (its selection statistics, its maps),
the last part only scores it. Each candidate runs, through the same pipeline as a user's request, on a copy of the
model; its score is the mean next-token NLL of the compressed copy on the validation part (one layer-by-layer pass and
the row-bounded head of the states engine). The lowest wins and is then run on the model itself. Nothing is selected
on an evaluation text: the validation part is calibration text the candidates never fitted on.

Candidates are written ``method[:option=value,...][+correction]`` (``+lstsq`` / ``+cosine``: linear replacement,
``+scale``: magnitude compensation), e.g. ``"shortgpt+scale"`` or ``"replaceme:num_blocks=2"``; options not given are
the method's defaults, and the values are read through the option's type hint, as the command line reads them.

Memory: one copy of the model at a time besides the model itself (offloaded models are copied with their offload
hooks, so prefer a model that fits in memory). Cost: each candidate's own cost on the fitting part, one pass over the
validation part per candidate, and the winner once more; all of it is counted in the report's stack passes.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time
from typing import Any

from ..adapters.base import ArchitectureAdapter
from ..calibration.capture import LayerwiseRunner
from ..calibration.states import CalibratedStates, next_token_nll
from ..compression.correction_workspace import with_correction
from ..compression.method import CompressionMethod, MethodContext
from ..compression.pipeline import Corrections, apply_with_corrections_, plan_and_apply_, preflight
from ..compression.workspace import Phase, Term, WorkspaceModel, WorkspaceSizes
from ..options.methods.auto import AutoConfig, Candidate
from ..plan import LayerPlan
from ..registry import register_method, require_capabilities
from ..utils.errors import UnsupportedArchitectureError


def split_batches(batches: list[Any], fraction: float) -> tuple[list[Any], list[Any]]:
    """(fitting, validation): the last ceil(fraction x n) batches validate, at least one batch on each side."""
    if len(batches) < 2:
        raise ValueError(
            f"auto needs at least 2 calibration batches (one to fit, one to validate), got {len(batches)}; raise "
            "nsamples or lower batch_size."
        )
    held = min(len(batches) - 1, max(1, math.ceil(fraction * len(batches))))
    return batches[:-held], batches[-held:]


@register_method("auto")
class AutoMethod(CompressionMethod):
    config_class = AutoConfig
    required_capabilities = frozenset({"layer_drop"})
    #: The candidates carry their own corrections.
    accepts_linear_replacement = False
    config: AutoConfig

    def __init__(self, config: AutoConfig) -> None:
        super().__init__(config)
        self._winner: tuple[CompressionMethod, Corrections] | None = None
        self._context: MethodContext | None = None

    @classmethod
    def card_lines(cls, report: dict[str, Any]) -> list[str]:
        auto = report.get("auto") or {}
        if not auto:
            return []
        split = auto.get("split", {})
        lines = [
            f"- Chosen automatically: `{auto.get('winner')}`, {auto.get('why')}; calibration split "
            f"{split.get('fitting_sequences')} fitting / {split.get('validation_sequences')} validation sequences",
            "",
            "  | candidate | held-out NLL | plan |",
            "  |---|---|---|",
        ]
        for entry in auto.get("candidates", []):
            score = entry.get("validation_nll", entry.get("refused") or entry.get("skipped"))
            lines.append(f"  | {entry['candidate']} | {score} | {entry.get('plan_summary', '')} |")
        return [*lines, ""]

    @classmethod
    def workspace(cls, z: WorkspaceSizes, n: int, config: Any) -> WorkspaceModel:
        """auto: every candidate the model accepts, on a copy of the model and the fitting batches, then scored on the
        validation batches; then the winner on the model itself.

        - selection, one phase per scored candidate: the model's copy (its weights once more) beside that candidate's
          largest phase (with its correction, `compression.correction_workspace`) at the fitting part's size;
        - selection (validation): the copy, a runner over the validation batches, a layer's run and one row's
          next-token loss (`next_token_nll`: 12·seqlen·V);
        - refit: the winner's largest phase on every batch (or on the fitting part without `refit`): the largest
          candidate's, since the winner is not known before the run.
        The fallbacks count only where `AutoMethod._needs_fallbacks` would score them (the model refused a candidate
        by its architecture and no bridged candidate is left), and `max_candidates` as the run counts it. Cost, a
        bound: the scored candidates' passes over the fitting part, one pass of the compressed stack and the LM head
        over the validation part each, and the costliest candidate once more.
        """
        fitting, _ = split_batches(list(range(z.cal.batches)), config.validation_fraction)  # the run's own split
        fit_cal = dataclasses.replace(z.cal, nsamples=min(z.cal.nsamples, len(fitting) * z.cal.batch_size))
        val_cal = dataclasses.replace(z.cal, nsamples=z.cal.nsamples - fit_cal.nsamples)
        fit, val = z.with_calibration(fit_cal), z.with_calibration(val_cal)
        chosen = cls._modelled_candidates(z, config)
        copy_term = Term("the candidate's copy of the model", z.shape.weights_bytes, "copy.deepcopy, one at a time")
        s, L = z.shape, z.shape.num_layers
        phases: list[Phase] = []
        passes, refit_passes = 0.0, 0.0
        refits: list[tuple[str, Phase]] = []
        notes: list[str] = [f"candidates modelled: {', '.join(spec.label for spec in chosen)}"]
        for spec in chosen:
            method = spec.build()
            at_fit = cls._candidate(fit, n, spec, method)
            at_full = cls._candidate(z, n, spec, method) if config.refit else at_fit  # without refit: the same run
            peak = max(at_fit[0], key=lambda p: p.bytes)
            phases.append(Phase(f"selection: {spec.label} ({peak.name})", (copy_term, *peak.terms)))
            passes += at_fit[1] * fit_cal.tokens / z.cal.tokens
            refit_passes = max(refit_passes, at_full[1])
            refits.append((spec.label, max(at_full[0], key=lambda p: p.bytes)))
            notes += [note for note in at_fit[2] if note not in notes]
        phases.append(
            Phase(
                "selection: scoring on the validation batches",
                (
                    copy_term,
                    *val.runners(1),
                    val.run_term(),
                    Term("one row's next-token loss", 12 * z.cal.seqlen * s.vocab_size, "the logits, float32 copies"),
                ),
            )
        )
        label, largest = max(refits, key=lambda item: item[1].bytes)
        phases.append(Phase(f"refit: the winner (at most {label}'s {largest.name})", largest.terms))
        kept = (L - n + s.head_weights / s.layer_weights) / L
        passes += len(chosen) * kept * val_cal.tokens / z.cal.tokens + refit_passes
        return phases, passes, True, notes

    @staticmethod
    def _modelled_candidates(z: WorkspaceSizes, config: AutoConfig) -> list[Candidate]:
        """The candidates a run would score on this model: those it accepts, then the fallbacks where
        `_needs_fallbacks` would add them, at most `max_candidates` (refused ones count towards it, as in the run)."""
        specs = config.candidate_specs()
        verdicts = [z.refusal(spec.name, spec.build().config, spec.corrections) for spec in specs]
        # The entries `_needs_fallbacks` reads, as `_score` writes them: scored, or refused (and by what).
        scored = [{"validation_nll": 0.0} if v is None else {"refused_by": v} for v in verdicts]
        if AutoMethod._needs_fallbacks(specs, scored):
            for spec in config.fallback_specs():
                specs.append(spec)
                verdicts.append(z.refusal(spec.name, spec.build().config, spec.corrections))
        limit = config.max_candidates or len(specs)
        chosen = [spec for spec, verdict in list(zip(specs, verdicts, strict=True))[:limit] if verdict is None]
        if not chosen:
            raise ValueError("auto: the model refuses every candidate; no compression would run.")
        return chosen

    @staticmethod
    def _candidate(
        z: WorkspaceSizes, n: int, spec: Candidate, method: CompressionMethod
    ) -> tuple[list[Phase], float, list[str]]:
        """One candidate's phases, stack passes and notes at the sizes `z`, with its correction."""
        model = type(method).workspace(z, n, method.config)
        if model is None:
            raise ValueError(
                f"auto's candidate {spec.label!r} has no memory model, so neither has this auto; drop it from the "
                "candidates to estimate the others."
            )
        phases, passes, _, notes = model
        keeps = type(method).keeps_runner_states(method.config)
        phases, passes, more = with_correction(z, n, spec.corrections, phases, passes, keeps)
        return phases, passes, [*notes, *more]

    def preflight(self, adapter: ArchitectureAdapter, stack: str) -> None:
        if adapter.lm_head(stack) is None:
            raise UnsupportedArchitectureError(
                f"method 'auto' chooses by next-token loss on held-out calibration text, and this "
                f"{type(adapter.model).__name__} has no LM head reading the {stack!r} stack; pick a method directly."
            )

    def plan(self, adapter: ArchitectureAdapter, context: MethodContext, num_to_remove: int) -> LayerPlan:
        fit, validation = split_batches(list(context.batches), self.config.validation_fraction)
        specs = self.config.candidate_specs()
        self._reports: dict[str, dict[str, Any]] = {}  # each scored candidate's own report, by label
        limit = self.config.max_candidates if self.config.max_candidates is not None else math.inf
        start = time.perf_counter()
        scored: list[dict[str, Any]] = []

        def score_each(batch: list[Candidate], bar: Any) -> None:
            for spec in batch:
                if len(scored) >= limit:
                    return
                late = self.config.max_seconds is not None and time.perf_counter() - start > self.config.max_seconds
                if scored and late:
                    scored.append({"candidate": spec.label, "skipped": "max_seconds reached"})
                else:
                    scored.append(self._score(adapter, context, spec, fit, validation, num_to_remove))
                    bar.set_description(f"auto: {spec.label}")
                bar.update()

        with context.timer("selection"), context.progress_bar(min(len(specs), limit), "auto") as bar:
            score_each(specs, bar)
            if self._needs_fallbacks(specs, scored):
                fallbacks = self.config.fallback_specs()
                specs = [*specs, *fallbacks]
                bar.total = min(len(specs), limit)
                score_each(fallbacks, bar)
        ranked = [i for i, entry in enumerate(scored) if "validation_nll" in entry]
        if not ranked:
            raise RuntimeError(
                "auto: no candidate could compress this model: "
                + "; ".join(f"{e['candidate']}: {e.get('refused', e.get('skipped'))}" for e in scored)
            )
        index = min(ranked, key=lambda i: scored[i]["validation_nll"])  # ties: the first listed
        winner = specs[index]
        self._winner = (winner.build(), winner.corrections)
        context.report["auto"] = {
            "split": {
                "fitting_batches": len(fit),
                "validation_batches": len(validation),
                "fitting_sequences": sum(int(b.input_ids.shape[0]) for b in fit),
                "validation_sequences": sum(int(b.input_ids.shape[0]) for b in validation),
                "rule": "the last batches of the calibration set validate; the others fit",
            },
            "candidates": scored,
            "winner": winner.label,
            "why": (
                "lowest mean next-token NLL on the held-out calibration batches "
                f"({scored[index]['validation_nll']:.4f}) among "
                f"{sum('validation_nll' in e for e in scored)} scored candidates"
            ),
        }
        # The winner runs again on the model itself: on every batch (refit) or on the same fitting part.
        self._context = MethodContext(
            batches=list(context.batches) if self.config.refit else fit, stack=context.stack, progress=context.progress
        )
        self._context.compensation = winner.corrections.compensation
        method = self._winner[0]
        scored_plan = LayerPlan.from_dict(scored[index]["plan"])
        reads = method.planning_batches()
        if reads is not None and reads <= len(fit):  # it planned on batches both runs share: the same plan
            final = scored_plan
            self._context.report.update(self._reports.get(winner.label, {}))
        else:
            with context.timer("refit"):
                final = method.plan(adapter, self._context, num_to_remove)
        if not self.config.refit and final.group_lists() != scored_plan.group_lists():
            raise RuntimeError(
                f"auto: the winner planned {final.describe()} on the model but {scored_plan.describe()} on its copy "
                "from the same batches; the method is not deterministic, the model was not changed."
            )
        context.report["auto"]["refit"] = {
            "on": "every calibration batch" if self.config.refit else "the fitting part only",
            "plan_summary": final.describe(),
            "same_plan_as_scored": final.group_lists() == scored_plan.group_lists(),
        }
        if final is scored_plan:
            context.report["auto"]["refit"]["plan"] = (
                f"the scored plan, not searched again: {winner.label} plans on the first {reads} calibration "
                "batches, the same in both runs"
            )
        return final

    @staticmethod
    def _needs_fallbacks(specs: list[Candidate], scored: list[dict[str, Any]]) -> bool:
        """Whether the family could hold none of the listed bridges: the architecture refused a candidate, and no
        candidate carrying a linear bridge was scored (on Gemma and OLMo-2 every full map is refused; on a
        mixture of experts ReplaceMe's own map still folds, and the list stands)."""
        refused = any(entry.get("refused_by") == "architecture" for entry in scored)
        bridged_scored = any(
            spec.bridged and "validation_nll" in entry for spec, entry in zip(specs, scored, strict=False)
        )
        return refused and not bridged_scored

    def _score(
        self,
        adapter: ArchitectureAdapter,
        context: MethodContext,
        spec: Candidate,
        fit: list[Any],
        validation: list[Any],
        num_to_remove: int,
    ) -> dict[str, Any]:
        label, name, corrections = spec.label, spec.name, spec.corrections
        method = spec.build()
        method_class = type(method)
        if method_class.keeps_depth:
            return {"candidate": label, "refused": f"{name} keeps every layer; it cannot meet a depth target"}
        started = time.perf_counter()
        candidate = type(adapter)(copy.deepcopy(adapter.model))
        try:
            require_capabilities(candidate, name)
            preflight(candidate, method, context.stack, corrections)
            sub = MethodContext(batches=fit, stack=context.stack, progress=False)
            plan = plan_and_apply_(candidate, method, sub, num_to_remove, corrections)
        except UnsupportedArchitectureError as error:
            return {"candidate": label, "refused": str(error).splitlines()[0], "refused_by": "architecture"}
        except ValueError as error:
            return {"candidate": label, "refused": str(error).splitlines()[0]}
        runner = LayerwiseRunner(candidate, validation, context.stack)
        states = CalibratedStates(runner, candidate.layers(context.stack), keep=())
        nll = next_token_nll(candidate, states.boundary(states.num_layers), validation, context.stack)
        context.extra_work += sub.work + runner.work
        self._reports[label] = sub.report
        return {
            "candidate": label,
            "validation_nll": round(nll, 6),
            "plan": plan.to_dict(),
            "plan_summary": plan.describe(),
            "seconds": round(time.perf_counter() - started, 2),
        }

    def apply_(self, adapter: ArchitectureAdapter, plan: LayerPlan, context: MethodContext) -> None:
        if self._winner is None:
            raise RuntimeError("auto.apply_ called before auto.plan")
        method, corrections = self._winner
        apply_with_corrections_(adapter, method, plan, self._context, corrections)
        context.extra_work += self._context.work
        context.report["auto"]["winner_report"] = {
            k: v for k, v in self._context.report.items() if k in ("linear_replacement", "compensation", "blocks")
        }
