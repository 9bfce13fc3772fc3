"""What an adapter checks after a change: the config against the modules of every stack, then a tiny forward.

`ArchitectureAdapter` takes these from `AdapterValidation`; a family overrides the part that differs (a MoE's
experts keep no MLP width, an encoder checks shapes instead of cached decoding).
"""

from __future__ import annotations

from torch import nn

from .checks import check_cached_forward
from .per_layer import per_layer_problems
from .views import BlockView, PackedPartView, _attribute


class AdapterValidation:
    """`validate` and its parts, on the adapter's layout, views and config (mixed into `ArchitectureAdapter`)."""

    def _mlp_width_problem(self, block: BlockView, width: int, width_name: str) -> str | None:
        """What `validate` reports about the block's MLP, or None: an MLP stored as one map (`MlpView.is_single_map`)
        must be hidden -> hidden, any other must have the config's width (`width`, named `width_name`)."""
        up = block.mlp.up
        if block.mlp.is_single_map:
            if up.out_features != up.in_features:
                return f"layer {block.index} has a single-map MLP of shape ({up.out_features}, {up.in_features})"
            return None
        if block.mlp.intermediate_size != width:
            return f"layer {block.index} has MLP width {block.mlp.intermediate_size} ({width_name}={width})"
        return None

    def layer_count_problems(self, stack: str | None = None) -> list[str]:
        """What `validate` reports when the config's layer count (or a per-layer field) disagrees with the stack."""
        layout = self.layout(stack)
        count, config = len(self.layers(layout.stack)), self.stack_config(stack)
        what = f"{layout.stack} layers" if len(self.layouts) > 1 else "layers"
        problems = []
        declared = getattr(config, layout.layer_count_key)
        if declared != count:
            problems.append(f"config.{self._key_name(layout.layer_count_key)}={declared} but {count} {what}")
        return problems + per_layer_problems(config, count)

    def expected_mlp_width(self, stack: str | None = None) -> int:
        """The MLP width the config describes for `stack` (`MlpLayout.width_key`)."""
        return getattr(self.stack_config(stack), self.layout(stack).mlp.width_key)

    def block_problems(self, stack: str, index: int, module: nn.Module) -> list[str]:
        """What `validate` reports about one block: layer index, head counts, size attributes and MLP width against
        the config (a fused q/k/v map in the middle of a resize is reported alone)."""
        layout = self.layout(stack)
        several = len(self.layouts) > 1
        where = f"{stack} layer {index}" if several else f"layer {index}"
        view = self.block_view(module, index)
        problems = []
        for att, att_view in zip(layout.attentions(), (view.attention, view.cross_attention), strict=False):
            label = f"{where} {att.path}" if several else where
            q = att_view.q
            if isinstance(q, PackedPartView) and not q.parts_in_step():
                return [f"{label} {att.fused_qkv} holds unequal q/k/v parts {list(q.part_sizes())}"]
            if att.layer_idx is not None and (value := _attribute(att_view.module, att.layer_idx)) != index:
                problems.append(f"{label} has layer_idx {value}")
            g = att_view.geometry
            config = self.stack_config(stack)  # a composite model's text_config holds the stack's keys
            heads = getattr(config, att.heads_key)
            kv_heads = (getattr(config, att.kv_heads_key, None) if att.kv_heads_key else None) or heads
            if (g.num_heads, g.num_kv_heads) != (heads, kv_heads):
                problems.append(
                    f"{label} has {g.num_heads} heads of {g.head_dim} / {g.num_kv_heads} KV heads "
                    f"({self._key_name(att.heads_key)}={heads})"
                )
        up = view.mlp.up
        if isinstance(up, PackedPartView) and not up.parts_in_step():
            return [f"{where} {layout.mlp.fused_gate_up} holds unequal gate/up parts {list(up.part_sizes())}"]
        for owner, attr, expected in self._size_attributes(module):
            if (value := _attribute(owner, attr)) != expected:
                problems.append(f"{where} {type(owner).__name__}.{attr}={value} but its weights give {expected}")
        if problem := self._mlp_width_problem(view, self.expected_mlp_width(stack), layout.mlp.width_key):
            problems.append(f"{stack} {problem}" if several else problem)
        return problems

    def validate(self) -> None:
        """Checks that the config agrees with the modules of every stack, then runs `check_forward`."""
        problems = []
        for stack in self.stacks():
            problems += self.layer_count_problems(stack)
            for i, layer in enumerate(self.layers(stack)):
                problems += self.block_problems(stack, i, layer)
        if problems:
            raise ValueError("compressed model is inconsistent with its config: " + "; ".join(problems))
        self.check_forward()

    def check_forward(self) -> None:
        """A tiny forward that would fail on what the config checks cannot see (the default: cached decoding must
        match uncached decoding, which catches a wrong cache index); encoders check shapes instead."""
        check_cached_forward(self.model)
