"""The canonical depth change: `LayerPlan`, what every method produces and every adapter applies.

Kept apart from the user-facing configuration (config.py) because it is the contract between the layers of the
package: methods return it, adapters and the export read it, reports and cards print it; none of them needs the
configuration to do so.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .utils.errors import reject_unknown_keys


@dataclass(frozen=True)
class LayerGroup:
    """One output layer of a plan: the original layers it is made from (0-based, ascending)."""

    indices: tuple[int, ...]

    @property
    def is_keep(self) -> bool:
        return len(self.indices) == 1


@dataclass
class LayerPlan:
    """The canonical depth change of one block stack.

    An ordered list of output layers, each a group of 0-based *original* indices: a group of one keeps that
    layer, a larger group merges its members by ``rule``; an original layer that appears in no group is dropped.
    The plan is a pure decision (no weights are touched), so it can be dry-run, printed, saved and re-applied.

    Attributes:
        num_layers: Number of layers of the stack before compression.
        groups: The output layers, in order.
        rule: How groups of more than one layer are combined (e.g. ``"flatten_prune"``); ``"none"`` when the plan
            only keeps and drops layers.
        stack: Name of the block stack the plan applies to (``"decoder"`` for decoder-only LMs).
        scores: Optional per-layer scores that led to the plan, for the report.
    """

    num_layers: int
    groups: list[LayerGroup]
    rule: str = "none"
    stack: str = "decoder"
    scores: list[float] | None = None

    def __post_init__(self) -> None:
        self.groups = [g if isinstance(g, LayerGroup) else LayerGroup(tuple(int(i) for i in g)) for g in self.groups]
        previous = -1
        for group in self.groups:
            if not group.indices:
                raise ValueError("a LayerPlan group cannot be empty; list at least one original layer index.")
            if list(group.indices) != sorted(group.indices) or group.indices[0] <= previous:
                raise ValueError(
                    f"LayerPlan groups must be ascending and in layer order, got {self.group_lists()}; "
                    "sort the indices and the groups."
                )
            for index in group.indices:
                if not 0 <= index < self.num_layers:
                    raise ValueError(
                        f"layer index {index} is out of range for a stack of {self.num_layers} layers "
                        f"(allowed 0..{self.num_layers - 1})."
                    )
            previous = group.indices[-1]

    @classmethod
    def from_kept(cls, num_layers: int, kept: Iterable[int], stack: str = "decoder") -> LayerPlan:
        """A layer-drop plan keeping exactly `kept`."""
        return cls(num_layers=num_layers, groups=[LayerGroup((i,)) for i in sorted(kept)], stack=stack)

    @property
    def num_output_layers(self) -> int:
        return len(self.groups)

    @property
    def num_removed(self) -> int:
        return self.num_layers - self.num_output_layers

    @property
    def merged_groups(self) -> list[tuple[int, ...]]:
        return [g.indices for g in self.groups if not g.is_keep]

    @property
    def dropped_indices(self) -> list[int]:
        used = {i for g in self.groups for i in g.indices}
        return [i for i in range(self.num_layers) if i not in used]

    @property
    def first_indices(self) -> list[int]:
        """Original index of the first member of every output layer (whose config entries the output inherits)."""
        return [g.indices[0] for g in self.groups]

    def span_ends(self) -> list[int]:
        """For every output layer, the original index where the span it stands for ends (exclusive).

        An output layer stands for the original layers from its first member up to the next output layer's first
        member: a run of dropped layers belongs to the output layer before it, since the next one reads what that
        one writes. The last output layer's span ends at `num_layers`.
        """
        firsts = self.first_indices
        return [*firsts[1:], self.num_layers]

    def group_lists(self) -> list[list[int]]:
        return [list(g.indices) for g in self.groups]

    def describe(self) -> str:
        """A one-line human summary, e.g. ``30 -> 24 layers; merged [3, 4] [10, 11]; dropped [20]``."""
        parts = [f"{self.num_layers} -> {self.num_output_layers} layers"]
        if self.merged_groups:
            parts.append("merged " + " ".join(str(list(g)) for g in self.merged_groups) + f" ({self.rule})")
        if self.dropped_indices:
            parts.append(f"dropped {self.dropped_indices}")
        return "; ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return {
            "stack": self.stack,
            "num_layers": self.num_layers,
            "rule": self.rule,
            "groups": self.group_lists(),
            "scores": self.scores,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LayerPlan:
        reject_unknown_keys(data, {"stack", "num_layers", "rule", "groups", "scores"}, "LayerPlan")
        return cls(
            num_layers=int(data["num_layers"]),
            groups=[LayerGroup(tuple(g)) for g in data["groups"]],
            rule=data.get("rule", "none"),
            stack=data.get("stack", "decoder"),
            scores=data.get("scores"),
        )


__all__ = ["LayerGroup", "LayerPlan"]
