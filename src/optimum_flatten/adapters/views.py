"""Read-only views of a model's weights: each linear map as an (out, in) matrix, whatever its storage.

A view reads and writes one projection (or one part of a fused q/k/v or gate/up projection) so that methods and
the adapter's mutators never see storage quirks: fused projections, transposed Conv1D, remote-code module names.
`adapters.base` builds them; a family with another storage registers its view classes (`register_storage`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import torch
from torch import nn

from .layout import AttentionLayout, NormPosition, PositionScheme

T = TypeVar("T")


@dataclass(frozen=True)
class HeadGeometry:
    """Shape of an attention block; ``num_heads // num_kv_heads`` query heads share each key/value head."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int

    @classmethod
    def of(cls, q: LinearView, k: LinearView, head_dim: int) -> HeadGeometry:
        """The geometry the q and k projections have now: heads = out features / head_dim (after pruning too)."""
        return cls(
            num_heads=q.out_features // head_dim,
            num_kv_heads=k.out_features // head_dim,
            head_dim=head_dim,
            hidden_size=q.in_features,
        )

    @property
    def queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    def query_heads_of(self, kv_heads: Sequence[int]) -> list[int]:
        """Query heads attached to the given KV heads (query head h reads KV head h // queries_per_kv)."""
        per_kv = self.queries_per_kv
        return [g * per_kv + r for g in sorted(kv_heads) for r in range(per_kv)]

    def head_channels(self, heads: Sequence[int]) -> list[int]:
        """Channels of the concatenated head outputs (the o_proj input) that belong to the given heads."""
        return [h * self.head_dim + d for h in heads for d in range(self.head_dim)]


class LinearView:
    """A linear map seen as an (out, in) weight and an optional bias, whatever the storage.

    Writes go back to the real module: `set_` replaces the parameters (and the module when the shape changes),
    so views stay valid for the lifetime of the block they were taken from.
    """

    def __init__(self, parent: nn.Module, name: str) -> None:
        self._parent = parent
        self._name = name

    @property
    def module(self) -> nn.Linear:
        return getattr(self._parent, self._name)

    @property
    def weight(self) -> torch.Tensor:
        return self.module.weight.data

    @property
    def bias(self) -> torch.Tensor | None:
        bias = self.module.bias
        return None if bias is None else bias.data

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def set_(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Replaces the map by ``x @ weight.T + bias`` (weight is (out, in)), in the module's dtype and device."""
        old = self.module
        dtype, device = old.weight.dtype, old.weight.device
        new = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
        new.weight = nn.Parameter(weight.detach().to(device=device, dtype=dtype).contiguous(), requires_grad=False)
        if bias is not None:
            new.bias = nn.Parameter(bias.detach().to(device=device, dtype=dtype).contiguous(), requires_grad=False)
        new.weight.requires_grad_(old.weight.requires_grad)
        if new.bias is not None:
            new.bias.requires_grad_(old.weight.requires_grad)
        setattr(self._parent, self._name, new)

    def swap_module_(self, module: nn.Module) -> nn.Module:
        """Puts `module` in this map's slot and returns the module it replaces.

        For the few writes `set_` cannot express because the slot holds no weight: LayerCollapse leaves an
        ``nn.Identity`` where a collapsed MLP's down map was, and its stock export swaps an identity linear map in
        for the duration of a save only.
        """
        old = self.module
        setattr(self._parent, self._name, module)
        return old

    def share_parameters_of_(self, source: LinearView) -> int:
        """Makes this map use `source`'s parameter tensors (the same objects, so the same storage).

        Parameter-level sharing keeps each layer's own module (and any hook on it) and works for any storage class
        (nn.Linear, GPT-2's Conv1D) as long as both modules have the same class and shapes. The module also gets a
        state-dict hook that clones its entries: transformers refuses to save storage-sharing tensors that the
        model class does not declare tied, and declaring them would leave them out of the file, so a plain
        `from_pretrained` would initialise them at random. The checkpoint thus stores every layer in full.

        Returns:
            The number of parameter elements this map stops holding on its own.
        """
        src, dst = source.module, self.module
        src_params = dict(src.named_parameters(recurse=False))
        dst_params = dict(dst.named_parameters(recurse=False))
        got = {k: tuple(v.shape) for k, v in dst_params.items()}
        want = {k: tuple(v.shape) for k, v in src_params.items()}
        if type(src) is not type(dst) or got != want:
            raise ValueError(
                f"cannot tie a {type(dst).__name__} with parameters {got} to a {type(src).__name__} with {want}; "
                "only linear maps of one class and shape can share tensors."
            )
        freed = 0
        for name, parameter in src_params.items():
            if dst_params[name] is not parameter:
                freed += dst_params[name].numel()
                setattr(dst, name, parameter)
        if not getattr(dst, _CLONE_ON_SAVE, False):
            dst.register_state_dict_post_hook(_clone_entries_on_save)
            setattr(dst, _CLONE_ON_SAVE, True)
        return freed


_CLONE_ON_SAVE = "_optimum_flatten_clone_on_save"


def _clone_entries_on_save(module: nn.Module, state_dict: dict, prefix: str, local_metadata: object) -> None:
    """state_dict post-hook of a module whose parameters are shared: its entries get their own storage."""
    for name, _ in module.named_parameters(recurse=False):
        key = prefix + name
        if isinstance(state_dict.get(key), torch.Tensor):
            state_dict[key] = state_dict[key].clone()


#: Attribute set on a fused projection while its parts have different sizes (in the middle of a resize).
PENDING_PART_SIZES = "_optimum_flatten_packed_sizes"


class PackedPartView(LinearView):
    """One part (q, k or v) of a fused projection (Baichuan's ``W_pack``, GPT-2's ``c_attn``) as its own (out, in) map.

    Put it before the fused module's storage view in the bases (``class PackedConv1DView(PackedPartView,
    Conv1DView)``): the part is a row block of the storage view's (out, in) weight, and `set_` rebuilds the fused map
    through the storage view's `set_` with this part replaced, so the same code serves every storage layout. While
    q, k and v are resized one after the other, the fused module records the unequal sizes, so that every view of it
    keeps finding its rows; the record goes away with the module once the parts are equal again. `module` is the
    fused module, since no module holds the part alone.

    The same view serves a fused [gate; up] (``num_parts=2``, Phi-3's ``gate_up_proj``) and a fused [q; k; v] whose
    k and v are narrower than q (`kv_rows`, Phi-3 under GQA). The rows alone do not tell the latter's split, and the
    attribute `kv_rows` reads follows only once a resize is over (`_sync_sizes`), so such a view records the sizes
    after every write.
    """

    def __init__(
        self,
        parent: nn.Module,
        name: str,
        part: int,
        num_parts: int = 3,
        kv_rows: Callable[[], int] | None = None,
    ) -> None:
        super().__init__(parent, name)
        if not 0 <= part < num_parts:
            raise ValueError(f"part must be in 0..{num_parts - 1}, got {part}.")
        if kv_rows is not None and num_parts != 3:
            raise ValueError(f"kv_rows splits a fused [q; k; v] (3 parts), got num_parts={num_parts}.")
        self._part = part
        self._num_parts = num_parts
        self._kv_rows = kv_rows

    def part_sizes(self) -> tuple[int, ...]:
        """Rows of each part: equal (or q, then k and v of `kv_rows` each), unless a resize recorded others.

        Raises:
            ValueError: when the fused rows cannot be split into equal parts and no resize is recorded.
        """
        pending = getattr(self.module, PENDING_PART_SIZES, None)
        if pending is not None:
            return tuple(pending)
        rows = super().weight.shape[0]
        if self._kv_rows is not None:
            kv = int(self._kv_rows())
            return (rows - 2 * kv, kv, kv)
        if rows % self._num_parts:
            raise ValueError(
                f"{self._name} has {rows} output rows, which cannot hold {self._num_parts} equal parts; expected a "
                f"multiple of {self._num_parts}. Resize its parts together (keep_heads_, keep_mlp_channels_)."
            )
        return (rows // self._num_parts,) * self._num_parts

    def parts_in_step(self) -> bool:
        """Whether the parts have sizes the module's forward can split: equal, or (with `kv_rows`) k and v equal and
        q a whole number of key/value groups. False after most half-done resizes (with `kv_rows`, q resized alone
        to whole groups still passes; the head counts checked against the config catch it)."""
        sizes = self.part_sizes()
        if self._kv_rows is not None:
            return sizes[1] == sizes[2] > 0 and sizes[0] % sizes[1] == 0
        return len(set(sizes)) == 1

    def _starts(self, sizes: Sequence[int]) -> list[int]:
        return [sum(sizes[:i]) for i in range(self._num_parts)]

    @property
    def weight(self) -> torch.Tensor:
        sizes = self.part_sizes()
        start = self._starts(sizes)[self._part]
        return super().weight[start : start + sizes[self._part]]

    @property
    def bias(self) -> torch.Tensor | None:
        full = super().bias
        if full is None:
            return None
        sizes = self.part_sizes()
        start = self._starts(sizes)[self._part]
        return full[start : start + sizes[self._part]]

    def set_(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Replaces this part by ``x @ weight.T + bias``; the other parts of the fused projection stay as they are.

        A part without a bias is a part with a zero bias (exact), since the fused module has one bias or none.
        """
        full_weight, full_bias = super().weight, super().bias
        if weight.dim() != 2 or weight.shape[1] != full_weight.shape[1]:
            raise ValueError(
                f"weight must be (rows, in_features={full_weight.shape[1]}), got {tuple(weight.shape)}; the parts of "
                f"{self._name} share its input."
            )
        if bias is not None and tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"bias must be ({weight.shape[0]},) to match the weight, got {tuple(bias.shape)}.")
        sizes = list(self.part_sizes())
        starts = self._starts(sizes)
        like = {"dtype": full_weight.dtype, "device": full_weight.device}
        weights = [full_weight[s : s + n] for s, n in zip(starts, sizes, strict=True)]
        weights[self._part] = weight.detach().to(**like)
        new_bias = None
        if full_bias is not None or bias is not None:
            biases = [
                full_bias[s : s + n] if full_bias is not None else torch.zeros(n, **like)
                for s, n in zip(starts, sizes, strict=True)
            ]
            biases[self._part] = torch.zeros(weight.shape[0], **like) if bias is None else bias.detach().to(**like)
            new_bias = torch.cat(biases)
        sizes[self._part] = weight.shape[0]
        super().set_(torch.cat(weights), new_bias)
        if len(set(sizes)) > 1 or self._kv_rows is not None:
            setattr(self.module, PENDING_PART_SIZES, tuple(sizes))


class NormView:
    """A normalisation layer: RMSNorm (`weight` only) or LayerNorm (`weight` and `bias`)."""

    def __init__(self, module: nn.Module, kind: Literal["rms", "layer"]) -> None:
        self.module = module
        self.kind = kind

    @property
    def weight(self) -> torch.Tensor:
        return self.module.weight.data

    @property
    def bias(self) -> torch.Tensor | None:
        bias = getattr(self.module, "bias", None)
        return None if bias is None else bias.data

    def is_unit(self) -> bool:
        """True when the norm has unit gain and zero bias, i.e. it only normalises."""
        unit = bool(torch.all(self.weight == 1))
        return unit and (self.bias is None or bool(torch.all(self.bias == 0)))

    def set_unit_(self) -> None:
        """Sets the gain to 1 and the bias to 0 (after they were folded into the projections that read the norm)."""
        self.module.weight.data.fill_(1.0)
        if self.bias is not None:
            self.module.bias.data.zero_()


@dataclass
class AttentionView:
    q: LinearView
    k: LinearView
    v: LinearView
    o: LinearView
    geometry: HeadGeometry
    position_scheme: PositionScheme
    module: nn.Module


@dataclass
class MlpView:
    up: LinearView
    gate: LinearView | None
    down: LinearView
    activation: nn.Module
    module: nn.Module

    @property
    def intermediate_size(self) -> int:
        return self.up.out_features

    @property
    def is_single_map(self) -> bool:
        """Whether the MLP is stored as one hidden -> hidden map: the map in the up slot, identities in the
        activation and down slots (the form LayerCollapse leaves; the state-dict names stay the family's)."""
        return isinstance(self.down.module, nn.Identity)


@dataclass
class BlockView:
    index: int
    module: nn.Module
    norm_position: NormPosition
    attn_norm: NormView
    mlp_norm: NormView
    attention: AttentionView
    mlp: MlpView
    cross_attention: AttentionView | None = None


class PackedLinearView(PackedPartView):
    """One part of a fused ``nn.Linear``: q, k or v of [q; k; v] (Baichuan's ``W_pack``, Phi-3's ``qkv_proj``), or
    gate or up of [gate; up] (Phi-3's and GLM-4's ``gate_up_proj``)."""


#: Storage kind (`BlockLayout.storage`) -> (view of one linear map, view of one part of a fused q/k/v map).
_STORAGE: dict[str, tuple[type[LinearView], type[PackedPartView]]] = {"linear": (LinearView, PackedLinearView)}


def register_storage(kind: str, linear: type[LinearView], packed: type[PackedPartView]) -> None:
    """Binds the views of a storage kind, so that a layout saying ``storage=kind`` is read through them."""
    _STORAGE[kind] = (linear, packed)


def _attribute(root: Any, path: str) -> Any:
    """``root.a.b`` for ``path="a.b"``; `root` itself for ``""``."""
    return functools.reduce(getattr, path.split("."), root) if path else root


def _has_attribute(root: Any, path: str) -> bool:
    parent, _, name = path.rpartition(".")
    try:
        return hasattr(_attribute(root, parent), name)
    except AttributeError:
        return False


def _set_attribute(root: Any, path: str, value: Any) -> None:
    parent, _, name = path.rpartition(".")
    setattr(_attribute(root, parent), name, value)


def _view(cls: type[LinearView], root: nn.Module, path: str) -> LinearView:
    parent, _, name = path.rpartition(".")
    return cls(_attribute(root, parent), name)


def _kv_rows(attn: nn.Module, layout: AttentionLayout) -> int:
    """Rows of each of k and v in a fused q/k/v map whose key/value head count the attention keeps
    (`AttentionLayout.fused_kv_heads`), read when asked, so that it follows `_sync_sizes`."""
    return int(_attribute(attn, layout.fused_kv_heads)) * int(_attribute(attn, layout.head_dim))


def _cat_optional(tensors: Sequence[torch.Tensor | None]) -> torch.Tensor | None:
    """Concatenated biases of concatenated maps; None when no member has one."""
    if all(t is None for t in tensors):
        return None
    if any(t is None for t in tensors):
        raise ValueError("cannot concatenate blocks where only some members have a bias.")
    return torch.cat(list(tensors), dim=0)


def _sum_optional(tensors: Sequence[torch.Tensor | None]) -> torch.Tensor | None:
    """Summed biases of maps whose outputs are summed (each member adds its own to the stream)."""
    present = [t for t in tensors if t is not None]
    return torch.stack(present).sum(dim=0) if present else None
