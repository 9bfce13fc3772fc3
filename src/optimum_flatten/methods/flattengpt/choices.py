"""The choices a FlattenGPT run makes from its options and the model's shape: how large its groups get, how far back
the similarity pass looks, whether the selection's cache holds, which path a cross moment takes, which members run
for the sequential targets. One definition each, because the run (`method.py`, `similarity.py`, `kv_groups.py`), its
memory model (`workspace.py`) and its compute model (`compute.py`) must all make them alike."""

from __future__ import annotations

from typing import Any

from ...compression.workspace import WorkspaceSizes
from ...options.methods.flattengpt import resolve_covariance_dtype

#: The reconstruction search tries every subset of KV groups up to this many subsets, else eliminates greedily.
MAX_EXHAUSTIVE_SUBSETS = 4096
#: Tokens per float64 chunk of the MLP's cross moment with its target (`mlp_target="sequential"`).
MLP_CROSS_CHUNK = 1024


def cross_path(precision: str, dtype: str) -> str:
    """The path a `CrossMoment` of statistics taken in `precision` runs on activations of `dtype` (FlattenGPT builds
    it by this rule, and the memory and compute models read it): "split"; "centred" for float32 or tf32 statistics
    of float32 activations; else "float64" (float64 statistics or activations, and bfloat16 activations under float32
    statistics, LLaMA-2-70B's MLP on a GPU, whose float64 products its GPU rows measured)."""
    if precision == "bfloat16":
        return "split"
    return "centred" if precision in ("float32", "tf32") and dtype.removeprefix("torch.") == "float32" else "float64"


def covariance_dtype(config: Any, weight: Any, device: Any, width: int) -> str:
    """The precision of a statistic of `width` channels read from the input of `weight`'s projection (a tensor, on
    `device`): the option, or for ``"auto"`` what `resolve_covariance_dtype` gives for the activations' dtype (the
    weight's: the block computes in it) on that device. The models resolve "auto" as on a GPU (`workspace.py`)."""
    return resolve_covariance_dtype(config.covariance_dtype, str(weight.dtype), device.type == "cuda", width)


def group_size(n: int, num_layers: int, config: Any) -> int:
    """The largest merged group the models assume: max_group_size (with None, the worst case n + 1); the loss
    selection's prebuilt candidates (``selection="loss"``) take every size up to max_group_size."""
    if getattr(config, "selection", "similarity") == "loss":
        return min(config.max_group_size, num_layers)
    return min(config.max_group_size or n + 1, n + 1, num_layers)


def band_size(copy_bytes: int, num_layers: int, config: Any) -> int:
    """How many layers back the similarity pass compares each layer with: every layer when `num_layers` float32
    copies of the calibration states (`copy_bytes` each) fit `similarity_memory_gb`, else the narrowest band the
    greedy selection needs (bounded groups need exactly max_group_size - 1 predecessors; unlimited ones get as many
    as fit, and longer chains are then not formed). One rule for the pass (`similarity.similarity_band`) and for its
    memory and arithmetic models."""
    fits = max(1, int(config.similarity_memory_gb * 2**30 // max(copy_bytes, 1)))
    if fits >= num_layers:
        return num_layers
    return fits if config.max_group_size is None else config.max_group_size - 1


def auto_band(z: WorkspaceSizes, config: Any, num_layers: int) -> int:
    """`band_size` at the estimate's sizes (one float32 copy of the calibration states is ``z.S32`` bytes)."""
    return band_size(z.S32, num_layers, config)


def member_runs(s: Any, g: int, sequential: bool, mlp_target: bool, cached: bool) -> tuple[float, float]:
    """The weights the members of one group run for the sequential targets, in the head scoring and in the
    covariance: without the selection's cache, with both targets one whole run (the writes and the output), with
    the attention's alone all but the last whole and the last up to its MLP norm, with the MLP's alone a whole run
    in the covariance; with the cache (`FlattenGPTMethod.member_states`), each member up to its MLP norm for the
    attention's, nothing for the MLP's."""
    p_layer, p_att, p_norm = s.layer_weights, s.attention_weights, s.norm_weights
    if cached:
        return (g * (p_att + p_norm / 2) if sequential else 0.0), 0.0
    if mlp_target and sequential:
        return float(g * p_layer), 0.0
    if sequential:
        return (g - 1) * p_layer + p_att + p_norm / 2, 0.0
    return 0.0, (float(g * p_layer) if mlp_target else 0.0)


def selection_cache_holds(z: WorkspaceSizes, config: Any) -> bool:
    """Whether the selection leaves every layer's input for the application (`SelectionCache`): the similarity
    selection, in the one-pass mode, with every layer in its band."""
    L = z.shape.num_layers
    band = config.similarity_band or auto_band(z, config, L)
    one_pass = config.calibration_mode == "one_pass"
    return band >= L and one_pass and getattr(config, "selection", "similarity") == "similarity"


def cached_member_states(z: WorkspaceSizes, config: Any) -> bool:
    """Whether the sequential targets read the selection's cached states (`FlattenGPTMethod.member_states`): the
    cache is there (`selection_cache_holds`) and a target is sequential."""
    targets = (getattr(config, "attention_target", "parallel"), getattr(config, "mlp_target", "parallel"))
    return selection_cache_holds(z, config) and "sequential" in targets
