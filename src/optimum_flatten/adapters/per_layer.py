"""Per-layer config fields, rewritten by one mechanism after any compression of a stack.

Transformers configs describe a stack layer by layer in four shapes, and a checkpoint whose layers were dropped or
merged loads wrong (or not at all) unless each is rewritten (llama.cpp's and mergekit's layer pruning break here):

- **one entry per layer** (`PER_LAYER_LISTS`: ``layer_types`` sliding/full, ``mlp_layer_types`` dense/sparse,
  SmolLM3's ``no_rope_layers``): sliced to the kept layers;
- **index lists** (`INDEX_LISTS`: Qwen-MoE's ``mlp_only_layers``, ``moe_layers``): renumbered, entries of removed
  layers dropped;
- **boundaries** (`LAYER_BOUNDARIES`: Qwen2's ``max_window_layers``, DeepSeek's ``first_k_dense_replace``: layers
  below the value are of one kind): set to the number of kept layers below the old boundary, which keeps every kept
  layer's kind because compression never reorders layers;
- **periodic rules** (Qwen-MoE's ``decoder_sparse_step``: layer i is sparse when (i + 1) % step == 0 and i is not in
  ``mlp_only_layers``): a period does not survive a removal, so the rule is made explicit (step 1 and every kept dense
  layer listed in ``mlp_only_layers``);
- **``per_layer_config``** (transformers >= 5.15 heterogeneous configs: per-layer widths and ``skip``, keyed by layer
  index): keys renumbered, overrides of removed layers dropped.

An output layer inherits the fields of its group's first member. A merge of layers whose fields differ (a sliding
and a full attention layer, a dense and a sparse MLP, a RoPE and a NoPE layer, different ``per_layer_config``
overrides) is refused before any weight changes (`check_groups_share_layer_kind`): no single entry describes the
merged layer, and taking the first member's silently changes what the others computed.

The rewrite works on the config object that holds the stack's layer count: the model's config, or a composite
model's nested ``text_config`` (`stack_config`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ..utils.errors import UnsupportedArchitectureError

#: Lists with one entry per layer: sliced to the kept layers.
PER_LAYER_LISTS: tuple[str, ...] = ("layer_types", "mlp_layer_types", "no_rope_layers")
#: Lists of layer indices: renumbered.
INDEX_LISTS: tuple[str, ...] = ("mlp_only_layers", "moe_layers")
#: Integers splitting the stack into the layers below them and the others.
LAYER_BOUNDARIES: tuple[str, ...] = ("max_window_layers", "first_k_dense_replace")
#: Periodic rules (key -> the index list that lists the exceptions): made explicit after a removal.
SPARSE_STEPS: dict[str, str] = {"decoder_sparse_step": "mlp_only_layers"}
#: Gemma 2/3's older spelling of ``layer_types`` (layer i is full attention when (i + 1) % pattern == 0), still on the
#: Hub's configs and read by readers older than ``layer_types``: kept only where the kept layers still follow it.
SLIDING_PATTERNS: tuple[str, ...] = ("sliding_window_pattern", "_sliding_window_pattern")


class LayerKindMergeError(UnsupportedArchitectureError):
    """A merge group holds layers of different kinds (attention type, MLP type, RoPE, per-layer overrides)."""


def stack_config(config: Any, count_key: str) -> Any:
    """The config object that holds `count_key`: `config`, or its nested text config (``Gemma3Config.text_config``)
    when only that one has it."""
    if count_key in _own_keys(config):
        return config
    get_text = getattr(config, "get_text_config", None)
    sub = get_text(decoder=True) if callable(get_text) else None
    if sub is not None and sub is not config and hasattr(sub, count_key):
        return sub
    return config


def _own_keys(config: Any) -> set[str]:
    """The keys `config` stores itself or maps to a stored one (GPT-2's ``n_layer`` for ``num_hidden_layers``)."""
    keys = set(vars(config))
    keys |= {k for k, v in (getattr(config, "attribute_map", None) or {}).items() if v in keys}
    return keys


def layer_kinds(config: Any, num_layers: int) -> list[dict[str, Any]]:
    """For every layer of a stack of `num_layers`, what the config says about it alone, by field name.

    Two layers may be merged only when these agree; the values are what `rewrite_per_layer_config_` keeps.
    """
    kinds: list[dict[str, Any]] = [{} for _ in range(num_layers)]
    for key in PER_LAYER_LISTS:
        values = getattr(config, key, None)
        if isinstance(values, list | tuple):
            _check_length(key, values, num_layers)
            for i, value in enumerate(values):
                kinds[i][key] = value
    steps = {k: v for k, v in SPARSE_STEPS.items() if isinstance(getattr(config, k, None), int)}
    for key in INDEX_LISTS:
        values = getattr(config, key, None)
        if isinstance(values, list | tuple) and key not in steps.values():
            members = {int(v) for v in values}
            for i in range(num_layers):
                kinds[i][key] = i in members
    for key in LAYER_BOUNDARIES:
        value = getattr(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and not _inert_boundary(config, key):
            for i in range(num_layers):
                kinds[i][key] = i < value
    for key, exceptions in steps.items():
        step, listed = getattr(config, key), {int(v) for v in (getattr(config, exceptions, None) or ())}
        for i in range(num_layers):
            kinds[i][key] = i not in listed and step > 0 and (i + 1) % step == 0
    for i, overrides in _per_layer_overrides(config).items():
        if i < num_layers:
            kinds[i]["per_layer_config"] = overrides
    return kinds


def _inert_boundary(config: Any, key: str) -> bool:
    """Whether a boundary tells the layers apart in nothing they compute: Qwen2's ``max_window_layers`` with the
    sliding window off (Qwen2.5's released configs: 21 of 24 layers, every one full attention), or beside the
    ``layer_types`` transformers 5 reads instead, which then say each layer's attention. Counted as a kind, it kept
    merges across it out of every plan, and refused targets naming sliding and full attention the model has not."""
    if key != "max_window_layers":
        return False
    return getattr(config, "use_sliding_window", True) is False or isinstance(
        getattr(config, "layer_types", None), list | tuple
    )


def _differing_field(kinds: list[dict[str, Any]], group: Sequence[int]) -> str | None:
    """The first field `layer_kinds` gives the layers of `group` differently; None when they are of one kind."""
    for key in dict.fromkeys(k for i in group for k in kinds[i]):
        values = [kinds[i].get(key) for i in group]
        if any(v != values[0] for v in values[1:]):
            return key
    return None


def one_kind_rule(config: Any, num_layers: int) -> Callable[[Sequence[int]], bool]:
    """Whether a group of original layers may merge (the config describes them alike), with the kinds read once:
    a planner asks it of every candidate, up to cubically many for FlattenGPT's loss selection."""
    kinds = layer_kinds(config, num_layers)
    return lambda group: _differing_field(kinds, group) is None


def check_groups_share_layer_kind(config: Any, num_layers: int, groups: Sequence[Sequence[int]]) -> None:
    """Refuses, before any weight changes, a merge group whose layers the config describes differently (the
    planners' `one_kind_rule`, as a check of a finished plan).

    Raises:
        LayerKindMergeError: naming the group, the field and each member's value, and how to avoid it.
    """
    merged = [list(g) for g in groups if len(g) > 1]
    if not merged:
        return
    kinds = layer_kinds(config, num_layers)
    for group in merged:
        key = _differing_field(kinds, group)
        if key is None:
            continue
        shown = ", ".join(f"layer {i}: {kinds[i].get(key)!r}" for i in group)
        raise LayerKindMergeError(
            f"cannot merge layers {group}: the config gives them different {key!r} ({shown}), and one merged "
            f"layer has one entry. Only layers of one kind can be merged; narrow the merge range "
            f"(min_layer/max_layer, a smaller window) or use a layer-drop method (shortgpt, sleb, uidl). "
            "Nothing was changed."
        )


def rewrite_per_layer_config_(config: Any, count_key: str, first_indices: Sequence[int]) -> dict[str, Any]:
    """Sets the layer count and every per-layer field after the stack became `first_indices`.

    Args:
        config: The config holding the stack (`stack_config`); its fields still describe the original stack.
        count_key: The stack's layer-count key (``num_hidden_layers``; GPT-2's alias resolves through its
            ``attribute_map``).
        first_indices: For every output layer, the original index whose fields it inherits (ascending).

    Returns:
        The fields that changed, with their new values (for logs and tests).

    Raises:
        ValueError: a per-layer list whose length is not the original layer count, or indices out of range.
    """
    first = [int(i) for i in first_indices]
    num_layers = int(getattr(config, count_key))
    if any(not 0 <= i < num_layers for i in first) or sorted(set(first)) != first:
        raise ValueError(
            f"first_indices must be ascending unique layers in 0..{num_layers - 1} ({count_key}={num_layers}), "
            f"got {first}."
        )
    position = {old: new for new, old in enumerate(first)}
    changes: dict[str, Any] = {}
    overrides = _per_layer_overrides(config)
    if overrides:
        config.per_layer_config = None  # its setter checks the keys against the count: set again below
    steps = {k: v for k, v in SPARSE_STEPS.items() if isinstance(getattr(config, k, None), int)}
    sparse = {key: [layer_kinds(config, num_layers)[i][key] for i in first] for key in steps}

    changes[count_key] = len(first)
    for key in PER_LAYER_LISTS:
        values = getattr(config, key, None)
        if isinstance(values, list | tuple):
            _check_length(key, values, num_layers)
            changes[key] = [values[i] for i in first]
    for key in INDEX_LISTS:
        values = getattr(config, key, None)
        if isinstance(values, list | tuple) and key not in steps.values():
            changes[key] = [position[int(v)] for v in values if int(v) in position]
    for key in LAYER_BOUNDARIES:
        value = getattr(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool):
            changes[key] = sum(1 for i in first if i < value)
    for key, exceptions in steps.items():
        if first != list(range(num_layers)):
            changes[key] = 1
            changes[exceptions] = [new for new, is_sparse in enumerate(sparse[key]) if not is_sparse]
    if "layer_types" in changes:
        pattern = _sliding_pattern(changes["layer_types"])
        for key in SLIDING_PATTERNS:
            if isinstance(getattr(config, key, None), int):
                changes[key] = pattern
    for key, value in changes.items():
        if value is None and key in SLIDING_PATTERNS:
            delattr(config, key)  # no period describes the kept layers: layer_types alone does
        else:
            setattr(config, key, value)
    if overrides:
        renumbered = {str(position[i]): v for i, v in overrides.items() if i in position}
        config.per_layer_config = renumbered or None
        changes["per_layer_config"] = renumbered
    return changes


def _sliding_pattern(layer_types: Sequence[str]) -> int | None:
    """The period p with layer i full attention exactly when (i + 1) % p == 0 (p past the last layer: none full),
    that the kept `layer_types` follow; None when no period does (a removal in the middle of a period)."""
    count = len(layer_types)
    for period in range(1, count + 2):
        expected = ["full_attention" if (i + 1) % period == 0 else "sliding_attention" for i in range(count)]
        if list(layer_types) == expected:
            return period
    return None


def per_layer_problems(config: Any, count: int) -> list[str]:
    """What `validate` reports when a per-layer list or index does not fit a stack of `count` layers."""
    problems = []
    for key in PER_LAYER_LISTS:
        values = getattr(config, key, None)
        if isinstance(values, list | tuple) and len(values) != count:
            problems.append(f"config.{key} has {len(values)} entries for {count} layers")
    for key in INDEX_LISTS:
        values = getattr(config, key, None)
        if isinstance(values, list | tuple) and any(not 0 <= int(v) < count for v in values):
            problems.append(f"config.{key}={list(values)} names layers outside 0..{count - 1}")
    if any(i >= count for i in _per_layer_overrides(config)):
        problems.append(f"config.per_layer_config has keys {sorted(_per_layer_overrides(config))} for {count} layers")
    return problems


def _per_layer_overrides(config: Any) -> dict[int, Any]:
    """The explicit ``per_layer_config`` overrides by integer layer index (empty when the config has none)."""
    if not getattr(config, "is_heterogeneous", False):
        return {}
    stored = config.to_dict().get("per_layer_config") or {}
    return {int(k): v for k, v in stored.items()}


def _check_length(key: str, values: Sequence[Any], num_layers: int) -> None:
    if len(values) != num_layers:
        raise ValueError(
            f"config.{key} must have one entry per layer ({num_layers}), got {len(values)}; fix the config before "
            "compressing (its per-layer entries cannot be matched to layers)."
        )
