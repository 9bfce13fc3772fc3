"""Where things are in a model: the architecture adapter interface (its read-only views are in `adapters.views`).

Methods never touch module attributes. They read weights through views that always show a linear map as an
(out, in) matrix, and change the model only through the adapter's mutators (names ending in ``_``), so storage
quirks (fused projections, transposed Conv1D, remote-code module names) live in one adapter per family.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from ..utils.errors import UnsupportedArchitectureError
from ..utils.offload import detached_copy, onloaded
from .layout import AttentionLayout, BlockLayout
from .mlp_output import MlpOutput
from .per_layer import (
    check_groups_share_layer_kind,
    one_kind_rule,
    rewrite_per_layer_config_,
    stack_config,
)
from .validation import AdapterValidation
from .views import (
    _STORAGE,
    AttentionView,
    BlockView,
    HeadGeometry,
    MlpView,
    NormView,
    PackedPartView,
    T,
    _attribute,
    _cat_optional,
    _has_attribute,
    _kv_rows,
    _set_attribute,
    _sum_optional,
    _view,
)

#: What a pre-norm transformer stack with standard residual blocks offers every method: per-head geometry, norms that
#: fold into the next projections (so blocks can be concatenated and bridged), whole-layer drops, parameter
#: differences, one dense MLP per layer, a stream that can be rescaled, and a down projection that takes a fold.
#: A family adds ``gated_mlp`` when its MLP has a gate, and declares less (with reasons) where it differs.
PRE_NORM_CAPABILITIES = frozenset(
    {
        "head_geometry",
        "pre_norm",
        "concat_heads",
        "layer_drop",
        "parameter_merge",
        "dense_mlp",
        "stream_scale",
        "down_fold",
    }
)


class ArchitectureAdapter(AdapterValidation, MlpOutput, ABC):
    """Base class of the per-family adapters, bound to one model instance.

    A family declares its `model_types`, the `capabilities` methods may require (e.g. ``{"head_geometry",
    "gated_mlp", "pre_norm", "concat_heads"}``) and one `BlockLayout` per stack; views, renumbering, config updates,
    size attributes, validation, concatenation, pruning, merges and device-map keys are derived from the layouts.
    A subclass overrides only what its modules do that a layout cannot say (GPT-2's index-dependent attention
    scaling, Marian's two calibration entries, Baichuan's export).
    """

    capabilities: ClassVar[frozenset[str]] = frozenset()
    #: Why a capability is missing, returned by `missing_capabilities` for the registry's refusal.
    missing_capability_reasons: ClassVar[dict[str, str]] = {}
    #: What the family calibrates on: ``"text"`` (token batches), or ``"images"`` (pixel values, ViT), which only the
    #: API can give (the command line reads text).
    calibrates_on: ClassVar[str] = "text"
    #: Whether the model's layer loop expects each layer to return a tuple (transformers 4.x and remote code) rather
    #: than the bare hidden state (transformers 5): calibration stand-ins must answer in the same form.
    layer_output_is_tuple: ClassVar[bool] = False
    #: Attributes marking modules outside the blocks that also read the MLP activation's config key (BERT's
    #: prediction-head transform): a config that changes the blocks' activation changes them too.
    activation_config_readers: ClassVar[tuple[str, ...]] = ()

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.config = model.config

    # What every family must declare; a class attribute of the same name implements each (``model_types = ("llama",)``).
    @property
    @abstractmethod
    def model_types(self) -> tuple[str, ...]:
        """The ``config.model_type`` values this family serves."""

    @property
    @abstractmethod
    def layouts(self) -> tuple[BlockLayout, ...]:
        """One layout per stack, in the model's order (an encoder-decoder lists the encoder first)."""

    # ------------------------------------------------------------------ layout
    @property
    def default_stack(self) -> str:
        """The stack meant when none is named: the only one, or the last (an encoder-decoder's decoder)."""
        return self.layouts[-1].stack

    def layout(self, stack: str | None = None) -> BlockLayout:
        stack = stack or self.default_stack
        self._check_stack(stack)
        return next(layout for layout in self.layouts if layout.stack == stack)

    def _block_layout(self, module: nn.Module) -> BlockLayout:
        """The layout a block follows: the last one whose cross-attention, if it names one, the block has (a block
        does not know its stack; an encoder-decoder's decoder blocks are the ones with a cross-attention)."""
        for layout in reversed(self.layouts):
            cross = layout.cross_attention
            if cross is None or _has_attribute(module, cross.path):
                return layout
        raise ValueError(f"{type(module).__name__} matches no layout of {type(self).__name__}.")

    @property
    def mergeable_prefixes(self) -> tuple[str, ...]:
        """Block submodules whose parameters a parameter merge combines; the norms stay those of the first member."""
        return tuple(dict.fromkeys(p for layout in self.layouts for p in layout.merge_prefixes()))

    def _key_name(self, key: str) -> str:
        """A config key as the config spells it: GPT-2's ``n_layer (num_hidden_layers)`` through its attribute_map."""
        alias = (getattr(self.config, "attribute_map", None) or {}).get(key)
        return f"{alias} ({key})" if alias else key

    # ----------------------------------------------------------------- reading
    def stacks(self) -> list[str]:
        return [layout.stack for layout in self.layouts]

    def _root(self, stack: str | None = None) -> nn.Module:
        """The module the layout's paths start from, found by transformers' own convention: a head model keeps its
        base model under ``base_model_prefix`` (``model``, ``transformer``, ``bert``, ``vit``); a bare base model is
        the model itself."""
        first = self.layout(stack).layers.split(".")[0]
        inner = getattr(self.model, getattr(self.model, "base_model_prefix", "") or "", None)
        return inner if isinstance(inner, nn.Module) and hasattr(inner, first) else self.model

    def base_model(self, stack: str | None = None) -> nn.Module:
        """The module whose forward runs embeddings and the stack's layers (no LM head), for calibration."""
        return self._root(stack)

    def layers(self, stack: str | None = None) -> nn.ModuleList:
        return self._root(stack).get_submodule(self.layout(stack).layers)

    def layers_module_path(self, stack: str | None = None) -> str:
        """The qualified name of `stack`'s layer list in the model (``model.layers``, ``transformer.h``,
        ``bert.encoder.layer``, ``model.decoder.layers``): what module-keyed maps such as ``hf_device_map`` use.

        Found by identity among the model's modules, so it follows `layers` wherever a family keeps its stacks.

        Raises:
            ValueError: the stack's layer list is not a submodule of the model.
        """
        layers = self._stack_layers(stack)
        for name, module in self.model.named_modules():
            if module is layers:
                return name
        raise ValueError(f"the layers of stack {stack!r} are not a submodule of {type(self.model).__name__}.")

    def renumber_module_keys(self, mapping: Mapping[str, T], stack: str, first_indices: Sequence[int]) -> dict[str, T]:
        """`mapping` (keyed by module names, e.g. ``hf_device_map``) with `stack`'s layer keys renumbered.

        A key under layer ``old`` of the stack (``<layers path>.old`` or one of its submodules) moves to the new index
        of the output layer whose first member ``old`` was; keys of layers that were dropped or merged into an
        earlier one disappear. Every other key, the other stacks' included, is kept as it is.

        Args:
            mapping: Module name -> anything (a device, for ``hf_device_map``).
            stack: The stack that changed.
            first_indices: For every output layer, the original index of its first member (`LayerPlan.first_indices`).
        """
        prefix = self.layers_module_path(stack)
        prefix = f"{prefix}." if prefix else ""
        position = {old: new for new, old in enumerate(first_indices)}
        renumbered: dict[str, T] = {}
        for key, value in mapping.items():
            index, dot, rest = key[len(prefix) :].partition(".") if key.startswith(prefix) else ("", "", "")
            if not index.isdigit():
                renumbered[key] = value
            elif int(index) in position:
                renumbered[f"{prefix}{position[int(index)]}{dot}{rest}"] = value
        return renumbered

    def block_view(self, module: nn.Module, index: int) -> BlockView:
        """A view over a block module, in the model or standalone (e.g. a flattened block under construction)."""
        layout = self._block_layout(module)
        linear, packed = _STORAGE[layout.storage]
        mlp = layout.mlp
        mlp_module = _attribute(module, mlp.path)
        cross = layout.cross_attention
        if mlp.fused_gate_up is not None:
            parent, _, name = mlp.fused_gate_up.rpartition(".")
            gate, up = (packed(_attribute(mlp_module, parent), name, part, num_parts=2) for part in range(2))
        else:
            up = _view(linear, mlp_module, mlp.up)
            gate = None if mlp.gate is None else _view(linear, mlp_module, mlp.gate)
        return BlockView(
            index=index,
            module=module,
            norm_position=layout.norm_position,
            attn_norm=NormView(_attribute(module, layout.attn_norm), layout.norm_kind),
            mlp_norm=NormView(_attribute(module, layout.mlp_norm), layout.norm_kind),
            attention=self._attention_view(module, layout.attention, layout.storage),
            cross_attention=None if cross is None else self._attention_view(module, cross, layout.storage),
            mlp=MlpView(
                up=up,
                gate=gate,
                down=_view(linear, mlp_module, mlp.down),
                activation=_attribute(mlp_module, mlp.activation),
                module=mlp_module,
            ),
        )

    @staticmethod
    def _attention_view(block: nn.Module, layout: AttentionLayout, storage: str) -> AttentionView:
        linear, packed = _STORAGE[storage]
        attn = _attribute(block, layout.path)
        if layout.fused_qkv is not None:
            parent, _, name = layout.fused_qkv.rpartition(".")
            kv_rows = None if layout.fused_kv_heads is None else functools.partial(_kv_rows, attn, layout)
            q, k, v = (packed(_attribute(attn, parent), name, part, kv_rows=kv_rows) for part in range(3))
        else:
            q, k, v = (_view(linear, attn, path) for path in (layout.q, layout.k, layout.v))
        return AttentionView(
            q=q,
            k=k,
            v=v,
            o=_view(linear, attn, layout.o),
            geometry=HeadGeometry.of(q, k, int(_attribute(attn, layout.head_dim))),
            position_scheme=layout.position_scheme,
            module=attn,
        )

    def blocks(self, stack: str | None = None) -> list[BlockView]:
        """Views of every block of `stack` (None: the family's default stack, the one `layers()` gives)."""
        return [self.block_view(m, i) for i, m in enumerate(self._stack_layers(stack))]

    def block(self, stack: str, index: int) -> BlockView:
        return self.block_view(self.layers(stack)[index], index)

    def num_layers(self, stack: str | None = None) -> int:
        return len(self._stack_layers(stack))

    def _stack_layers(self, stack: str | None) -> nn.ModuleList:
        return self.layers() if stack is None else self.layers(stack)

    def embeddings(self) -> nn.Module:
        return self.model.get_input_embeddings()

    def lm_head(self, stack: str | None = None) -> nn.Module | None:
        """The causal next-token head that reads `stack`'s final states (None: the model has none for it).

        `stack` matters only for families with several stacks (an encoder-decoder's head reads the decoder only);
        None means the model's main stack.
        """
        return self.model.get_output_embeddings() if self.layout(stack).lm_head else None

    def final_norm(self, stack: str | None = None) -> nn.Module | None:
        """The norm applied to `stack`'s last hidden states before any head (None: the stack ends without one)."""
        path = self.layout(stack).final_norm
        return None if path is None else self._root(stack).get_submodule(path)

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

    def missing_capabilities(self, capabilities: set[str] | frozenset[str]) -> dict[str, str]:
        """The capabilities among `capabilities` this family lacks, with reasons (the refusal is the registry's)."""
        return {m: self.missing_capability_reasons.get(m, m) for m in sorted(set(capabilities) - self.capabilities)}

    # ---------------------------------------------------------------- mutating
    def scale_stream_writes_(self, module: nn.Module, index: int, factor: float) -> None:
        """Multiplies everything block `module` adds to the residual stream by `factor` (compensation's fold).

        The default scales o and down, biases included: in a pre-norm block the last maps before the residual add. A
        family with a norm after each sublayer scales its gain (`scale_norm_`), a mixture every expert (MoE adapter).
        """
        block = self.block_view(module, index)
        for view in (block.attention.o, block.mlp.down):
            bias = view.bias
            view.set_(view.weight * factor, None if bias is None else bias * factor)

    def scale_norm_(self, module: nn.Module, factor: float | torch.Tensor) -> None:
        """Multiplies a norm's output by `factor` (or per channel) through its gain and bias (Gemma overrides)."""
        module.weight.data.mul_(factor)
        if getattr(module, "bias", None) is not None:
            module.bias.data.mul_(factor)

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

    def _set_layers(self, stack: str, layers: nn.ModuleList) -> None:
        _set_attribute(self._root(stack), self.layout(stack).layers, layers)

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
        computes the members in parallel on one input, sums their contributions (so the o and down biases are
        summed), and takes the place of the first.

        Raises:
            UnsupportedArchitectureError: the family lacks ``pre_norm`` or ``concat_heads``, with the reason.
            ValueError: norms still carry gains, or the members differ in head size or queries per KV head.
        """
        if missing := self.missing_capabilities({"pre_norm", "concat_heads"}):
            raise UnsupportedArchitectureError(
                f"model_type {self.config.model_type!r} cannot concatenate blocks: it lacks {sorted(missing)} "
                f"({'; '.join(missing.values())})."
            )
        layout = self._block_layout(members[0].module)
        norms = [m.attn_norm for m in members] + [m.mlp_norm for m in members]
        require_unit_norms(norms, f"{layout.attn_norm}/{layout.mlp_norm}")
        head_dims = {m.attention.geometry.head_dim for m in members}
        ratios = {m.attention.geometry.queries_per_kv for m in members}
        if len(head_dims) != 1 or len(ratios) != 1:
            raise ValueError(
                f"blocks {[m.index for m in members]} have different head_dim {sorted(head_dims)} or queries per "
                f"KV head {sorted(ratios)}; only blocks of one head geometry can be concatenated."
            )
        wide = self._copy_block(members[0].module)
        view = self.block_view(wide, members[0].index)
        attn, mlp = [m.attention for m in members], [m.mlp for m in members]
        queries = [self._concat_query(m, members[0]) for m in members]
        view.attention.q.set_(torch.cat([w for w, _ in queries]), _cat_optional([b for _, b in queries]))
        for name in ("k", "v"):
            getattr(view.attention, name).set_(
                torch.cat([getattr(a, name).weight for a in attn]), _cat_optional([getattr(a, name).bias for a in attn])
            )
        view.attention.o.set_(torch.cat([a.o.weight for a in attn], dim=1), _sum_optional([a.o.bias for a in attn]))
        for name in ("gate", "up") if view.mlp.gate is not None else ("up",):
            getattr(view.mlp, name).set_(
                torch.cat([getattr(m, name).weight for m in mlp]), _cat_optional([getattr(m, name).bias for m in mlp])
            )
        view.mlp.down.set_(torch.cat([m.down.weight for m in mlp], dim=1), _sum_optional([m.down.bias for m in mlp]))
        self._sync_sizes(wide)
        return wide

    def _concat_query(self, member: BlockView, first: BlockView) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The query map (weight, bias) `member` contributes to a concatenation placed at `first`'s position: its
        own, unless the family's attention depends on the position (GPT-2 rescales it)."""
        return member.attention.q.weight, member.attention.q.bias

    def keep_heads_(
        self,
        block: BlockView,
        kv_head_indices: Sequence[int],
        o_weight: torch.Tensor | None = None,
        *,
        cross: bool = False,
    ) -> None:
        """Keeps the given key/value heads with every query head attached to them (every head when not GQA).

        `o_weight` (hidden, kept heads x head_dim) replaces the kept columns of the output projection. With
        ``cross=True`` the block's cross-attention is pruned instead (an encoder-decoder's decoder).
        """
        att = block.cross_attention if cross else block.attention
        if att is None:
            raise ValueError(f"block {block.index} has no cross-attention (an encoder block), got cross=True.")
        geometry = att.geometry
        kv = check_unique_indices(kv_head_indices, geometry.num_kv_heads, "key/value head").tolist()
        q_rows = torch.tensor(geometry.head_channels(geometry.query_heads_of(kv)), dtype=torch.long)
        kv_rows = torch.tensor(geometry.head_channels(kv), dtype=torch.long)
        new_o = att.o.weight[:, q_rows] if o_weight is None else o_weight
        if tuple(new_o.shape) != (att.o.out_features, q_rows.numel()):
            raise ValueError(
                f"o_weight must be (hidden={att.o.out_features}, kept={q_rows.numel()}), got {tuple(new_o.shape)}."
            )
        for view, rows in ((att.q, q_rows), (att.k, kv_rows), (att.v, kv_rows)):
            view.set_(view.weight[rows], None if view.bias is None else view.bias[rows])
        att.o.set_(new_o, att.o.bias)
        self._sync_sizes(block.module)

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

    def _size_values(self, layout: AttentionLayout, view: AttentionView) -> dict[str, int]:
        """What each kind of size attribute of an attention module must hold, read from its weights.

        Raises:
            ValueError: a fused q/k/v map holds parts of different sizes (a resize is under way).
        """
        if isinstance(view.q, PackedPartView) and not view.q.parts_in_step():
            sizes = view.q.part_sizes()
            wanted = "k and v equal and q whole groups" if layout.fused_kv_heads else "equal parts"
            raise ValueError(
                f"{layout.fused_qkv} holds q/k/v parts of {list(sizes)} rows; {type(self).__name__}'s attention "
                f"needs {wanted}. Resize q, k and v together (keep_heads_)."
            )
        head_dim = view.geometry.head_dim
        return {
            "heads": view.q.out_features // head_dim,
            "kv_heads": view.k.out_features // head_dim,
            "q_width": view.q.out_features,
        }

    def _size_attributes(self, module: nn.Module) -> list[tuple[nn.Module, str, int]]:
        """(module, attribute, value from the weights) of every size attribute the block's modules have."""
        layout = self._block_layout(module)
        view = self.block_view(module, -1)
        found = []
        for att, att_view in zip(layout.attentions(), (view.attention, view.cross_attention), strict=False):
            values = self._size_values(att, att_view)
            found += [(att_view.module, attr, values[source]) for attr, source in att.size_attributes]
        width = {"width": view.mlp.intermediate_size}
        found += [(view.mlp.module, attr, width[source]) for attr, source in layout.mlp.size_attributes]
        return [(owner, attr, value) for owner, attr, value in found if _has_attribute(owner, attr)]

    def _sync_sizes(self, module: nn.Module) -> None:
        """Keeps the size attributes a block's modules hold next to their weights (`AttentionLayout.size_attributes`,
        `MlpLayout.size_attributes`) in line with the weights after a resize: some forwards reshape with them."""
        for owner, attr, value in self._size_attributes(module):
            _set_attribute(owner, attr, value)

    def _check_stack(self, stack: str) -> None:
        if stack not in self.stacks():
            raise ValueError(f"{type(self).__name__} has stacks {self.stacks()}, got {stack!r}.")

    def reindex_(self, stack: str | None = None) -> None:
        """Renumbers every layer index stored in the stack's modules (`AttentionLayout.layer_idx`: the KV cache is
        addressed by it); a layout without one has nothing to renumber."""
        layout = self.layout(stack)
        for i, layer in enumerate(self.layers(layout.stack)):
            for att in layout.attentions():
                if att.layer_idx is not None:
                    _set_attribute(_attribute(layer, att.path), att.layer_idx, i)

    def stack_config(self, stack: str | None = None) -> Any:
        """The config object describing `stack`: the model's config, or the nested text config of a composite model
        (Gemma 3's ``text_config``) when only that one holds the stack's layer count."""
        return stack_config(self.config, self.layout(stack).layer_count_key)

    def update_config_(self, stack: str, first_indices: Sequence[int]) -> None:
        """Updates the layer count and every per-layer config field after the stack became `first_indices`.

        One mechanism serves every family (`adapters.per_layer`): lists with one entry per layer are sliced, index
        lists and ``per_layer_config`` keys renumbered, boundaries such as Qwen2's ``max_window_layers`` moved and
        periodic rules such as ``decoder_sparse_step`` made explicit, on the config that holds the stack (a nested
        ``text_config`` included). The layout's ``layer_count_key`` goes through transformers' ``attribute_map``
        (GPT-2's ``n_layer``).

        Args:
            stack: The stack that changed.
            first_indices: For every output layer, the original index whose per-layer config it inherits.
        """
        rewrite_per_layer_config_(self.stack_config(stack), self.layout(stack).layer_count_key, first_indices)

    def check_plan_config(self, stack: str, groups: Sequence[Sequence[int]]) -> None:
        """Refuses, before any weight changes, merge groups whose layers the config describes differently
        (sliding and full attention, dense and sparse MLPs, RoPE and NoPE layers, different per-layer overrides).

        Raises:
            LayerKindMergeError: naming the group and the field that differs.
        """
        config = self.stack_config(stack)
        num_layers = getattr(config, self.layout(stack).layer_count_key)
        check_groups_share_layer_kind(config, num_layers, groups)

    def layer_kind_rule(self, stack: str) -> Callable[[Sequence[int]], bool]:
        """Whether a group of the stack's original layers is of one kind by the config (`check_plan_config` would
        pass it): taken once by a planner before its search, and asked of every candidate."""
        config = self.stack_config(stack)
        return one_kind_rule(config, getattr(config, self.layout(stack).layer_count_key))

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

    def exports_another_model(self) -> bool:
        """Whether `export_model` saves a model of another class (a remote-code family's stock equivalent), which only
        the quantizer's own save writes: transformers' save_pretrained would write the class that was loaded."""
        return type(self).export_model is not ArchitectureAdapter.export_model

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
