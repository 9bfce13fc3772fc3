"""Where things are in a model: the architecture adapter interface and its read-only views.

Methods never touch module attributes. They read weights through views that always show a linear map as an
(out, in) matrix, and change the model only through the adapter's mutators (names ending in ``_``), so storage
quirks (fused projections, transposed Conv1D, remote-code module names) live in one adapter per family.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
from torch import nn

from ..utils.errors import UnsupportedArchitectureError
from ..utils.offload import detached_copy, onloaded

NormPosition = Literal["pre", "post", "parallel"]
PositionScheme = Literal["rope", "alibi", "learned", "sinusoidal", "none"]


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
    """

    def __init__(self, parent: nn.Module, name: str, part: int, num_parts: int = 3) -> None:
        super().__init__(parent, name)
        if not 0 <= part < num_parts:
            raise ValueError(f"part must be in 0..{num_parts - 1}, got {part}.")
        self._part = part
        self._num_parts = num_parts

    def part_sizes(self) -> tuple[int, ...]:
        """Rows of each part: equal, unless a resize of one part is under way.

        Raises:
            ValueError: when the fused rows cannot be split into equal parts and no resize is recorded.
        """
        pending = getattr(self.module, PENDING_PART_SIZES, None)
        if pending is not None:
            return tuple(pending)
        rows = super().weight.shape[0]
        if rows % self._num_parts:
            raise ValueError(
                f"{self._name} has {rows} output rows, which cannot hold {self._num_parts} equal parts [q | k | v]; "
                f"expected a multiple of {self._num_parts}. Resize q, k and v together (keep_heads_)."
            )
        return (rows // self._num_parts,) * self._num_parts

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
        if len(set(sizes)) > 1:
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


class ArchitectureAdapter:
    """Base class of the per-family adapters, bound to one model instance.

    Subclasses declare the `model_types` they serve and the `capabilities` methods may require
    (e.g. ``{"head_geometry", "gated_mlp", "pre_norm", "concat_heads"}``).
    """

    model_types: ClassVar[tuple[str, ...]] = ()
    capabilities: ClassVar[frozenset[str]] = frozenset()
    #: Why a capability is missing, for the error raised by `require`.
    missing_capability_reasons: ClassVar[dict[str, str]] = {}
    #: Whether the model's layer loop expects each layer to return a tuple (transformers 4.x and remote code) rather
    #: than the bare hidden state (transformers 5): calibration stand-ins must answer in the same form.
    layer_output_is_tuple: ClassVar[bool] = False

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.config = model.config

    #: The family's one stack (a family with several, Marian, overrides the stack methods).
    default_stack: ClassVar[str] = "decoder"
    #: Where the layers sit in the base model: ``"layers"`` (LLaMA, ViT), ``"h"`` (GPT-2), ``"encoder.layer"`` (BERT).
    layers_path: ClassVar[str] = "layers"

    # ----------------------------------------------------------------- reading
    def stacks(self) -> list[str]:
        return [self.default_stack]

    def layers(self, stack: str | None = None) -> nn.ModuleList:
        return self.base_model(stack).get_submodule(self.layers_path)

    def base_model(self, stack: str | None = None) -> nn.Module:
        """The module whose forward runs embeddings and the stack's layers (no LM head), for calibration.

        transformers' own convention finds it: a head model keeps its base model under ``base_model_prefix``
        (``model``, ``transformer``, ``bert``, ``vit``); a bare base model is the model itself.
        """
        self._check_stack(stack or self.default_stack)
        inner = getattr(self.model, getattr(self.model, "base_model_prefix", "") or "", None)
        first = self.layers_path.split(".")[0]
        return inner if isinstance(inner, nn.Module) and hasattr(inner, first) else self.model

    def block_view(self, module: nn.Module, index: int) -> BlockView:
        """A view over a block module, in the model or standalone (e.g. a flattened block under construction)."""
        raise NotImplementedError

    def blocks(self, stack: str | None = None) -> list[BlockView]:
        """Views of every block of `stack` (None: the family's default stack, the one `layers()` gives)."""
        return [self.block_view(m, i) for i, m in enumerate(self._stack_layers(stack))]

    def block(self, stack: str, index: int) -> BlockView:
        return self.block_view(self.layers(stack)[index], index)

    def num_layers(self, stack: str | None = None) -> int:
        return len(self._stack_layers(stack))

    def _stack_layers(self, stack: str | None) -> nn.ModuleList:
        # Each family's `layers` carries its own default stack ("decoder", or "encoder" for BERT and ViT).
        return self.layers() if stack is None else self.layers(stack)

    def embeddings(self) -> nn.Module:
        return self.model.get_input_embeddings()

    def lm_head(self, stack: str | None = None) -> nn.Module | None:
        """The causal next-token head that reads `stack`'s final states (None: the model has none for it).

        `stack` matters only for families with several stacks (an encoder-decoder's head reads the decoder only);
        None means the model's main stack.
        """
        return self.model.get_output_embeddings()

    def final_norm(self, stack: str | None = None) -> nn.Module | None:
        """The norm applied to `stack`'s last hidden states before any head (None: the stack ends without one)."""
        raise NotImplementedError

    def forward_inputs(self, stack: str, batch: Any, device: torch.device) -> dict[str, Any]:
        """Keyword arguments of `base_model(stack)`'s forward for one calibration batch.

        The default fits decoder-only language models; a family whose model needs other inputs (pixel values,
        decoder inputs of an encoder-decoder) overrides it.
        """
        return {
            "input_ids": batch.input_ids.to(device),
            "attention_mask": batch.attention_mask.to(device),
            "use_cache": False,
        }

    def token_mask(self, stack: str, batch: Any) -> torch.Tensor:
        """(batch, positions) mask, 1 where the hidden states entering `stack`'s layers are real tokens."""
        return batch.attention_mask

    def require(self, capabilities: set[str] | frozenset[str], method: str) -> None:
        """Raises UnsupportedArchitectureError naming what `method` needs and this architecture lacks."""
        missing = sorted(set(capabilities) - set(self.capabilities))
        if missing:
            reasons = "; ".join(self.missing_capability_reasons.get(m, m) for m in missing)
            raise UnsupportedArchitectureError(
                f"method {method!r} needs {missing}, which model_type {self.config.model_type!r} does not offer "
                f"({reasons}). Use a method that only drops or merges whole layers on this architecture."
            )

    # ---------------------------------------------------------------- mutating
    def keep_layers_(self, stack: str, indices: Sequence[int]) -> None:
        """Keeps exactly the layers at `indices` (current positions, ascending) and drops the others."""
        layers = self.layers(stack)
        indices = list(indices)
        if sorted(set(indices)) != indices or any(not 0 <= i < len(layers) for i in indices):
            raise ValueError(f"keep_layers_ needs ascending unique indices in 0..{len(layers) - 1}, got {indices}.")
        kept = [layers[i] for i in indices]
        self._set_layers(stack, nn.ModuleList(kept))

    def delete_layers_(self, stack: str, indices: Sequence[int]) -> None:
        """Drops the layers at `indices` (current positions)."""
        layers = self.layers(stack)
        bad = [i for i in indices if not 0 <= i < len(layers)]
        if bad:
            raise ValueError(f"delete_layers_ got out-of-range indices {bad} for {len(layers)} layers.")
        drop = set(indices)
        self.keep_layers_(stack, [i for i in range(len(layers)) if i not in drop])

    def replace_block_(self, stack: str, index: int, module: nn.Module) -> None:
        self.layers(stack)[index] = module

    def replace_mlp_activation_(self, block: BlockView, module: nn.Module) -> None:
        """Puts `module` where the block's MLP activation is (LayerCollapse's parametric activation, for one).

        The default finds ``block.mlp.activation`` among the MLP module's submodules by identity, so every adapter
        whose activation is a module gets this without code; an adapter whose activation is a plain function (or
        lives outside ``block.mlp.module``) overrides it.

        Raises:
            ValueError: the activation is not a submodule of the MLP module.
        """
        activation = block.mlp.activation
        for name, child in block.mlp.module.named_modules():
            if name and child is activation:
                parent_name, _, attribute = name.rpartition(".")
                setattr(block.mlp.module.get_submodule(parent_name), attribute, module)
                return
        raise ValueError(
            f"layer {block.index}: the MLP activation ({type(activation).__name__}) is not a submodule of "
            f"{type(block.mlp.module).__name__}, so {type(self).__name__} cannot replace it generically; override "
            "replace_mlp_activation_ in the adapter."
        )

    def is_mlp_collapsed(self, block: BlockView) -> bool:
        """Whether the block's MLP was collapsed into one linear map (`collapse_mlp_` leaves an identity down map)."""
        return isinstance(block.mlp.down.module, nn.Identity)

    def collapse_mlp_(self, block: BlockView, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        """Replaces the block's MLP (up -> activation -> down) by the single map ``x @ weight.T + bias``.

        The merged (hidden, hidden) map goes into the up slot through its view (so ``nn.Linear`` and GPT-2's
        ``Conv1D`` alike), and the activation and down slots become ``nn.Identity``: the MLP module, its forward and
        its state-dict names stay the architecture's (``...up.weight`` holds the merged map, the down map has no
        entry). Only exact when the activation is the identity (LayerCollapse at alpha = 1); the caller checks that.

        Raises:
            UnsupportedArchitectureError: for a gated MLP (gate·up is bilinear, never one linear map).
            ValueError: the MLP is already collapsed, or `weight` is not (hidden, hidden).
        """
        mlp = block.mlp
        if mlp.gate is not None:
            raise UnsupportedArchitectureError(
                f"layer {block.index}: a gated MLP cannot collapse into one linear map (gate(x)·up(x) is bilinear)."
            )
        if self.is_mlp_collapsed(block):
            raise ValueError(f"layer {block.index}: the MLP is already collapsed into one linear map.")
        hidden = mlp.up.in_features
        if tuple(weight.shape) != (hidden, hidden) or (bias is not None and tuple(bias.shape) != (hidden,)):
            raise ValueError(
                f"layer {block.index}: a collapsed MLP maps hidden={hidden} to hidden, got a weight of shape "
                f"{tuple(weight.shape)} and bias {None if bias is None else tuple(bias.shape)}; pass the (out, in) "
                "product W2·W1 of the down and up maps and W2·b1 + b2."
            )
        mlp.up.set_(weight, bias)
        self.replace_mlp_activation_(block, nn.Identity())
        mlp.down.swap_module_(nn.Identity())

    def mlp_width_problem(self, block: BlockView, width: int, width_name: str) -> str | None:
        """What `validate` reports about the block's MLP, or None: a collapsed MLP (LayerCollapse) must be one
        hidden -> hidden map, any other must have the config's width (`width`, named `width_name` in the message)."""
        up = block.mlp.up
        if self.is_mlp_collapsed(block):
            if up.out_features != up.in_features:
                return f"layer {block.index} has a collapsed MLP of shape ({up.out_features}, {up.in_features})"
            return None
        if block.mlp.intermediate_size != width:
            return f"layer {block.index} has MLP width {block.mlp.intermediate_size} ({width_name}={width})"
        return None

    def collapsed_stock_config(self) -> dict[str, Any] | None:
        """Config changes under which the stock class describes this model once every MLP is collapsed, or None.

        LayerCollapse's stock export writes a fully collapsed model as the stock architecture with MLP width =
        hidden size, a ``"linear"`` activation and an identity down map; None means the family has no such export.
        """
        return None

    def _set_layers(self, stack: str, layers: nn.ModuleList) -> None:
        parent, _, name = self.layers_path.rpartition(".")
        base = self.base_model(stack)
        setattr(base.get_submodule(parent) if parent else base, name, layers)

    def detached_block(self, stack: str, index: int) -> BlockView:
        """A view of an in-memory, hook-free copy of layer `index` (its weights onloaded once if offloaded).

        Methods rewrite copies, never the model's layers: an offloaded layer cannot be written to, and the original
        layers must keep computing the original function while later groups are calibrated.
        """
        return self.block_view(self._copy_block(self.layers(stack)[index]), index)

    def build_concat_block(self, members: Sequence[BlockView]) -> nn.Module:
        """A new block holding every head and MLP unit of `members` (views of blocks, which stay untouched).

        The members' norms must already be plain normalisations (gain 1, bias 0): FlattenGPT folds the gains into
        the projections of `detached_block` copies first, which is what makes one shared norm exact. The result
        computes the members in parallel on one input, sums their contributions, and takes the place of the first.
        """
        raise NotImplementedError

    def keep_heads_(
        self, block: BlockView, kv_head_indices: Sequence[int], o_weight: torch.Tensor | None = None
    ) -> None:
        """Keeps the given key/value heads with every query head attached to them (all heads when not GQA).

        `o_weight` (hidden, kept heads x head_dim) replaces the kept columns of the output projection.
        """
        raise NotImplementedError

    def keep_mlp_channels_(
        self, block: BlockView, indices: Sequence[int], down_weight: torch.Tensor | None = None
    ) -> None:
        """Keeps the given MLP channels; `down_weight` (hidden, k) replaces the kept down-projection columns.

        Works through the views for gated and plain MLPs alike (up and gate rows, down columns); a family whose
        modules keep size attributes updates them in `_sync_sizes`.
        """
        mlp = block.mlp
        idx = check_unique_indices(indices, mlp.intermediate_size, "MLP channel")
        new_down = mlp.down.weight[:, idx] if down_weight is None else down_weight
        if tuple(new_down.shape) != (mlp.down.out_features, idx.numel()):
            raise ValueError(
                f"down_weight must be (hidden={mlp.down.out_features}, kept={idx.numel()}), "
                f"got {tuple(new_down.shape)}."
            )
        for view in (mlp.up, mlp.gate):
            if view is not None:
                view.set_(view.weight[idx], None if view.bias is None else view.bias[idx])
        mlp.down.set_(new_down, mlp.down.bias)
        self._sync_sizes(block.module)

    def _sync_sizes(self, module: nn.Module) -> None:
        """Keeps the informational size attributes of a resized block in line with its weights (default: none)."""

    def _check_stack(self, stack: str) -> None:
        if stack not in self.stacks():
            raise ValueError(f"{type(self).__name__} has stacks {self.stacks()}, got {stack!r}.")

    def reindex_(self, stack: str = "decoder") -> None:
        """Renumbers every layer index stored in modules (the KV cache is addressed by it)."""
        raise NotImplementedError

    def update_config_(self, stack: str, first_indices: Sequence[int]) -> None:
        """Updates the layer count and per-layer config lists after the stack became `first_indices`.

        The default serves a family with one stack: ``num_hidden_layers`` (transformers' ``attribute_map`` turns it
        into GPT-2's ``n_layer``) and, when the config has one, the per-layer ``layer_types`` list (Qwen2's sliding
        windows). A family with other per-layer lists or several stacks overrides it.

        Args:
            stack: The stack that changed.
            first_indices: For every output layer, the original index whose per-layer config it inherits.
        """
        self._check_stack(stack)
        first_indices = list(first_indices)
        self.config.num_hidden_layers = len(first_indices)
        layer_types = getattr(self.config, "layer_types", None)
        if isinstance(layer_types, list):
            self.config.layer_types = [layer_types[i] for i in first_indices]

    def layer_count_problems(self) -> list[str]:
        """What `validate` reports when the config's layer count (or its ``layer_types`` list) disagrees with the
        stack of a one-stack family."""
        count, config = len(self.layers()), self.config
        problems = []
        if config.num_hidden_layers != count:
            problems.append(f"config.num_hidden_layers={config.num_hidden_layers} but {count} layers")
        layer_types = getattr(config, "layer_types", None)
        if isinstance(layer_types, list) and len(layer_types) != count:
            problems.append(f"config.layer_types has {len(layer_types)} entries for {count} layers")
        return problems

    def validate(self) -> None:
        """Checks that the config agrees with the modules and that a tiny forward runs with and without cache."""
        raise NotImplementedError

    #: Block submodules whose parameters a parameter merge combines; the norms stay those of the first member.
    mergeable_prefixes: ClassVar[tuple[str, ...]] = ("self_attn.", "mlp.")

    def mergeable_state(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """The block parameters a parameter merge combines (attention and MLP), by state-dict name.

        Offloaded weights are onloaded for the read; the returned tensors must not be written to.
        """
        with onloaded(module):
            return {
                name: tensor.detach()
                for name, tensor in module.state_dict().items()
                if name.startswith(self.mergeable_prefixes) and tensor.is_floating_point()
            }

    def build_merged_block(self, stack: str, first: int, state: dict[str, torch.Tensor]) -> nn.Module:
        """A copy of block `first` (its norms included) carrying the given merged attention/MLP parameters."""
        block = self._copy_block(self.layers(stack)[first])
        missing, unexpected = block.load_state_dict(state, strict=False)
        wrong = [m for m in missing if m.startswith(self.mergeable_prefixes)]
        if wrong or unexpected:
            raise ValueError(f"merged parameters do not fit the block: missing {wrong}, unexpected {unexpected}.")
        return block

    def export_model(self) -> nn.Module:
        """The model to serialise as a plain checkpoint.

        The default is the model itself; an adapter for remote code (e.g. Baichuan) returns an equivalent model of
        a stock transformers class so that the checkpoint loads without remote code.
        """
        return self.model

    # ----------------------------------------------------------------- helpers
    def _copy_block(self, module: nn.Module) -> nn.Module:
        """An in-memory, hook-free deep copy of a block that keeps its reference to the model config shared
        (attention reads it at run time)."""
        return detached_copy(module, memo={id(self.config): self.config})


def check_unique_indices(indices: Sequence[int], size: int, what: str) -> torch.Tensor:
    """Sorted indices as a long tensor, or ValueError when empty, repeated or outside 0..size-1."""
    values = sorted(int(i) for i in indices)
    if not values or values[0] < 0 or values[-1] >= size or len(set(values)) != len(values):
        raise ValueError(f"{what} indices must be unique values in 0..{size - 1}, got {list(indices)}.")
    return torch.tensor(values, dtype=torch.long)


def require_unit_norms(views: Sequence[NormView], what: str) -> None:
    """Raises when a norm that a concatenation would share still carries a gain or bias."""
    for view in views:
        if not view.is_unit():
            raise ValueError(
                f"cannot concatenate blocks whose {what} norms still carry gains: fold them into the projections "
                "first (ops.fold_norm_into_linear), then set them to unit gain."
            )


def check_family(model: nn.Module, adapter: type[ArchitectureAdapter]) -> None:
    from .reloaded import stock_model_type

    model_type = stock_model_type(model.config)
    if model_type not in adapter.model_types:
        raise UnsupportedArchitectureError(
            f"{adapter.__name__} serves model_type {list(adapter.model_types)}, got {model_type!r}."
        )
