"""What a merged group's attention should reproduce when FlattenGPT refits the kept heads towards the original stack.

The paper prunes a merged group towards its wide block: every member's attention reading the group's input x. The
stack it replaces is sequential: member m's attention reads the state the members before it left. With
``attention_target="sequential"`` the kept heads' o_proj is refitted (and, with ``head_selection="reconstruction"``,
the KV groups chosen) towards the sum of the members' attention writes in that sequential stack, the function the
merged block replaces; the block's MLP then starts from what the attention really wrote.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...adapters.base import ArchitectureAdapter
from ...calibration.capture import LayerwiseRunner
from ...calibration.partial import run_to_input


@torch.no_grad()
def sequential_attention_writes(
    adapter: ArchitectureAdapter,
    runner: LayerwiseRunner,
    stack: torch.nn.Module,
    indices: Sequence[int],
    inputs: Sequence[torch.Tensor],
    outputs: list[torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """Per calibration batch, the sum of what the attentions of the layers at `indices` (consecutive, untouched)
    add to the residual stream when they run one after another from `inputs`: float32, on each input's device.

    A pre-norm layer's attention write is the MLP norm's input less the layer's input (what the attention adds to the
    stream, its output bias included), so no attention internals are read. The members before the last run whole, as
    they feed the next. The last runs only up to its MLP norm, unless `outputs` is given: then it runs whole too and
    `outputs` receives what `sequential_group_outputs` would return, from this one run of the members instead of a
    second (the defaults' two sequential targets read both).
    """
    layers = adapter.layers(stack)
    writes: list[torch.Tensor | None] = [None] * len(inputs)
    current = list(inputs)

    def add(b: int, after_attention: torch.Tensor) -> None:
        before = current[b]
        write = after_attention.float() - before.to(after_attention.device).float()
        write = write.to(inputs[b].device)
        writes[b] = write if writes[b] is None else writes[b].add_(write)

    batch = [0]  # the batch the runner is on, for the hook

    def on_norm_input(_module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        add(batch[0], args[0])

    def on_batch(b: int) -> None:
        batch[0] = b

    for position, index in enumerate(indices):
        view = adapter.block_view(layers[index], index)
        norm = view.mlp_norm.module
        if position == len(indices) - 1 and outputs is None:
            run_to_input(runner, layers[index], index, current, norm, add, [norm, view.mlp.module])
            break
        handle = norm.register_forward_pre_hook(on_norm_input)
        try:
            current = runner.run(layers[index], index, current, on_batch=on_batch)
        finally:
            handle.remove()
    if outputs is not None:
        outputs.extend(out.to(inp.device) for out, inp in zip(current, inputs, strict=True))
    return _every_batch(writes)


@torch.no_grad()
def sequential_group_outputs(
    adapter: ArchitectureAdapter,
    runner: LayerwiseRunner,
    stack: torch.nn.Module,
    indices: Sequence[int],
    inputs: Sequence[torch.Tensor],
) -> list[torch.Tensor]:
    """Per calibration batch, the state the layers at `indices` (consecutive, untouched) leave when they run one
    after another from `inputs`: what the merged block as a whole replaces (`mlp_target="sequential"`), in the
    runner's dtype and on each input's device."""
    layers = adapter.layers(stack)
    current = list(inputs)
    for index in indices:
        current = runner.run(layers[index], index, current)
    return [out.to(inp.device) for out, inp in zip(current, inputs, strict=True)]


@torch.no_grad()
def attention_writes_from_states(
    adapter: ArchitectureAdapter,
    runner: LayerwiseRunner,
    stack: torch.nn.Module,
    indices: Sequence[int],
    member_inputs: Sequence[Sequence[torch.Tensor]],
) -> list[torch.Tensor]:
    """`sequential_attention_writes` when the state entering every member is already held (`member_inputs[m]`, per
    calibration batch: the selection's cache holds every layer's input): each member runs only up to its MLP norm
    on its own input, so no member's MLP runs. The same sums, member by member, as the run through the members
    gives; float32, on each first-member input's device."""
    layers = adapter.layers(stack)
    first = member_inputs[0]
    writes: list[torch.Tensor | None] = [None] * len(first)
    for index, inputs in zip(indices, member_inputs, strict=True):
        view = adapter.block_view(layers[index], index)
        norm = view.mlp_norm.module

        def add(b: int, after_attention: torch.Tensor, inputs: Sequence[torch.Tensor] = inputs) -> None:
            write = after_attention.float() - inputs[b].to(after_attention.device).float()
            write = write.to(first[b].device)
            writes[b] = write if writes[b] is None else writes[b].add_(write)

        run_to_input(runner, layers[index], index, inputs, norm, add, [norm, view.mlp.module])
    return _every_batch(writes)


def _every_batch(writes: list[torch.Tensor | None]) -> list[torch.Tensor]:
    """The writes, one per calibration batch. They are read by batch index: a gap would pair one batch's target with
    another's inputs, so a batch without a write is an error."""
    missing = [b for b, write in enumerate(writes) if write is None]
    if missing:
        raise RuntimeError(f"no attention write was captured on calibration batches {missing}.")
    return [write for write in writes if write is not None]
