"""auto's options: a torch-free declaration, read by `FlattenConfig`, the command line and the method
(methods/auto.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...utils.errors import did_you_mean
from ..corrections import COMPENSATIONS, ESTIMATORS, Corrections
from ..hints import MethodConfig, parse_method_options

#: Chosen by measurement (benchmarks/NOTEBOOK.md, "At a glance" and the depth tables), on SmolLM2-135M at 6 of 30 and
#: Qwen2.5-0.5B at 5 of 24, both evaluation texts. Six of these are the set measured as
#: `auto_down_todays_flattengpt` on both models (1.345 / 2.006 and 1.122 / 1.144, the best training-free rows of both
#: tables, choosing ReplaceMe with the down refit). The bridges refit the down projection (``+lstsq_down``), which
#: beat ReplaceMe's map after ShortGPT, SLEB and FlattenGPT on both texts; the paper's ReplaceMe stays beside it.
#: Plain ``shortgpt`` and ``uidl`` (one stack pass each) never win where a correction applies, but they are what
#: remains on a family that refuses every correction and merge (OLMo-2's post-sublayer norms), so they stay.
#: Left out since 2026-11-26: plain ``flattengpt`` (behind its bridged variant on both texts of both models, and on
#: held-out calibration loss) and ``come`` (the worst row of both tables). Measured on SmolLM2 with the ten
#: candidates before (`auto_ten_candidates`): the same model, at 21.4 stack passes against 13.9 for the six.
DEFAULT_CANDIDATES = (
    "replaceme replaceme:estimator=lstsq_down shortgpt shortgpt+scale shortgpt+lstsq_down uidl uidl+scale "
    "flattengpt+lstsq_down"
)

#: Scored after the candidates when the model's family can hold none of their bridges (the architecture refused a
#: candidate, and no candidate with a linear bridge could be scored: post-sublayer norms undo a map folded into
#: ``down_proj``): the drops with the one bridge such a family can hold, a gain per channel folded
#: into the norm after the MLP (``+diagonal``). Measured on Gemma-3-270M at 4 of 18 (benchmarks/NOTEBOOK.md), where
#: the default list can only score ShortGPT and UIDL and chose plain ShortGPT, 12.4x / 7.7x dense perplexity (later
#: speeches / Bible): with these auto chooses SLEB with the diagonal bridge, 2.73x / 4.65x, at 41 stack passes
#: against 6.2. SLEB scores removals on one batch (`scoring_batches=1`): its cost is its LM head's evaluations over
#: those tokens, which a large vocabulary makes the bulk of `auto`'s time on such a family. Families that refuse
#: nothing never score these.
FALLBACK_CANDIDATES = "sleb:scoring_batches=1+diagonal shortgpt+diagonal"


@dataclass
class AutoConfig(MethodConfig):
    """Options of the automatic choice.

    Attributes:
        candidates: Space-separated candidate specs, ``method[:option=value,...][+correction]`` with a correction
            among the linear-replacement estimators (``+lstsq``, ``+lstsq_down``, ...) and ``+scale``.
        validation_fraction: Share of the calibration batches held out for scoring (at least one batch each side).
        fallback_candidates: Candidates scored after those, in the same form, only when the model's family could
            hold none of their bridges: its architecture refused a candidate and no candidate carrying a linear
            bridge was scored (`FALLBACK_CANDIDATES`: the drops with a bridge a post-sublayer norm can hold); ""
            scores none. A fallback already among the candidates is not scored twice.
        max_candidates: Score at most this many candidates, fallbacks included, in the order given (a budget);
            None: all.
        max_seconds: Stop scoring new candidates after this many seconds (the ones scored still compete); None: no
            limit. The first candidate is always scored.
        refit: After the choice, run the winner on every calibration batch (the held-out part only served to
            choose, as in any model selection); False applies exactly the model that was scored, fitted on the
            fitting part only.
    """

    candidates: str = DEFAULT_CANDIDATES
    fallback_candidates: str = FALLBACK_CANDIDATES
    validation_fraction: float = 0.25
    max_candidates: int | None = None
    max_seconds: float | None = None
    refit: bool = True

    def __post_init__(self) -> None:
        specs = self.candidate_specs()
        fallbacks = self.fallback_specs()  # checked now too, though scored only after a refusal
        if not specs:
            raise ValueError("auto needs at least one candidate, e.g. candidates='shortgpt uidl+scale'.")
        for field, listed in (("candidates", specs), ("fallback_candidates", fallbacks)):
            _refuse_repeats(field, listed)
        if not 0.0 < float(self.validation_fraction) < 1.0:
            raise ValueError(f"validation_fraction must be strictly between 0 and 1, got {self.validation_fraction!r}.")
        if self.max_candidates is not None and (not isinstance(self.max_candidates, int) or self.max_candidates < 1):
            raise ValueError(f"max_candidates must be a positive integer or None, got {self.max_candidates!r}.")
        if self.max_seconds is not None and not float(self.max_seconds) > 0:
            raise ValueError(f"max_seconds must be positive or None, got {self.max_seconds!r}.")

    def candidate_specs(self) -> list[Candidate]:
        """The parsed candidates; every name and option is checked here, before any model is touched."""
        return _parse(self.candidates)

    def fallback_specs(self) -> list[Candidate]:
        """The parsed fallback candidates, less those already among the candidates (by label)."""
        listed = {spec.label for spec in self.candidate_specs()}
        return [spec for spec in _parse(self.fallback_candidates or "") if spec.label not in listed]


def _refuse_repeats(field: str, specs: list[Candidate]) -> None:
    """Refuses a candidate listed twice: it would cost a second compression for the same score, and the report and
    the estimate name candidates by their label, so the two could not be told apart."""
    labels = [spec.label for spec in specs]
    repeated = sorted({label for label in labels if labels.count(label) > 1})
    if repeated:
        raise ValueError(f"{field} lists {', '.join(map(repr, repeated))} more than once; give each candidate once.")


def _parse(candidates: str) -> list[Candidate]:
    """Candidate specs from their space-separated text, each name, correction and option checked."""
    specs = []
    for text in str(candidates).split():
        head, _, correction = text.partition("+")
        name, _, option_text = head.partition(":")
        from ...registry import get_method_class

        method_class = get_method_class(name)  # raises UnknownMethodError with a did-you-mean
        if name == "auto":
            raise ValueError("auto cannot be its own candidate.")
        if correction and correction not in ESTIMATORS + COMPENSATIONS:
            raise ValueError(
                f"unknown correction {correction!r} in candidate {text!r}."
                f"{did_you_mean(correction, ESTIMATORS + COMPENSATIONS)} "
                "Use one of " + ", ".join("+" + c for c in ESTIMATORS + COMPENSATIONS) + "."
            )
        corrections = Corrections(
            linear_replacement=correction if correction in ESTIMATORS else None,
            compensation=correction if correction in COMPENSATIONS else None,
        )
        options = parse_method_options(method_class.config_class, option_text, where=f"candidate {text!r}")
        method_class.config_class(**options)  # the method's own checks, now rather than mid-search
        specs.append(Candidate(name, options, corrections))
    return specs


@dataclass(frozen=True)
class Candidate:
    """One parsed candidate: a method, the options that differ from its defaults, and its correction."""

    name: str
    options: dict[str, Any]
    corrections: Corrections

    @property
    def bridged(self) -> bool:
        """Whether the candidate carries a linear bridge at its cut: a `+estimator` correction, or a method that fits
        its own (ReplaceMe's `estimator`)."""
        from ...registry import get_method_class

        config_class = get_method_class(self.name).config_class
        return self.corrections.linear_replacement is not None or "estimator" in getattr(
            config_class, "__dataclass_fields__", {}
        )

    @property
    def label(self) -> str:
        options = ",".join(f"{k}={v}" for k, v in self.options.items())
        suffix = self.corrections.linear_replacement or self.corrections.compensation
        return self.name + (f":{options}" if options else "") + (f"+{suffix}" if suffix else "")

    def build(self) -> Any:
        """The candidate's `CompressionMethod` (the options layer names no method class: it sits below them)."""
        from ...registry import get_method_class

        method_class = get_method_class(self.name)
        return method_class(method_class.config_class(**self.options))
