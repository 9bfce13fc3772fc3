"""Reading and writing blocks whose weights accelerate keeps off the compute device.

A model loaded with a `device_map` that offloads layers (to CPU RAM or to disk, where transformers reads them
lazily from the checkpoint's safetensors shards) holds those layers' parameters on the meta device; accelerate's
hooks bring them in for each forward. Running such layers needs nothing from us. Methods that read or rebuild
weights do, and this module is all they use:

- `onloaded` brings a block's weights in for the duration of a `with`, through accelerate's own hooks;
- `detached_copy` makes an in-memory copy of a block without hooks: new blocks are built from it, so the
  offloaded original is never written to (a write to onloaded tensors would be lost, or half kept);
- `dispatch_like` places a newly built block the way the block it replaces was placed: offloaded to disk or CPU
  again, or on its device with the hook that moves activations there. Peak memory then stays at the few blocks
  a method holds at once, not the model.
"""

from __future__ import annotations

import contextlib
import copy
import os
import shutil
import tempfile
import weakref
from collections.abc import Iterator
from typing import Any

from torch import nn

#: The folders `dispatch_like` writes a new block's weights into, each deleted with its block.
_FOLDER_PREFIX = "optimum-flatten-offload-"

#: Instance attributes through which accelerate's `add_hook_to_module` attaches a hook.
_HOOK_ATTRIBUTES = ("_hf_hook", "_old_forward", "forward")


def offloaded_submodules(module: nn.Module) -> list[nn.Module]:
    """The submodules (the module included) whose own parameters accelerate offloads."""
    from accelerate.utils import has_offloaded_params

    return [sub for sub in module.modules() if has_offloaded_params(sub)]


def check_weights_present(model: nn.Module) -> None:
    """Refuses a model whose parameters are on the meta device without an accelerate hook to bring them in (built
    with ``torch.device("meta")`` or ``init_empty_weights`` and never loaded), before anything runs: its first
    forward failed deep in the calibration ("Tensor.item() cannot be called on meta tensors")."""
    offloaded = {id(p) for sub in offloaded_submodules(model) for p in sub.parameters(recurse=False)}
    empty = [name for name, p in model.named_parameters() if p.is_meta and id(p) not in offloaded]
    if empty:
        raise ValueError(
            f"{len(empty)} parameters of this {type(model).__name__} (the first: {empty[0]}) are on the meta device "
            "with no weights behind them; load the weights first (from_pretrained, or load_state_dict with "
            "assign=True), or load with a device_map that offloads them."
        )


def is_offloaded(module: nn.Module) -> bool:
    return bool(offloaded_submodules(module))


@contextlib.contextmanager
def onloaded(module: nn.Module) -> Iterator[nn.Module]:
    """Within the block, every offloaded parameter of `module` holds its real value on the execution device.

    Writes to those tensors are not persisted: build new modules from `detached_copy` instead.
    """
    from accelerate.utils import align_module_device

    with contextlib.ExitStack() as stack:
        for sub in offloaded_submodules(module):
            stack.enter_context(align_module_device(sub))
        yield module


def detached_copy(module: nn.Module, memo: dict[int, Any] | None = None) -> nn.Module:
    """A deep copy of `module` with real tensors and no accelerate hooks (a plain module, as if never dispatched).

    Args:
        module: Any module, offloaded or not.
        memo: `copy.deepcopy` memo, e.g. to keep a shared config object shared.
    """
    with onloaded(module):
        detached: list[tuple[nn.Module, dict[str, Any]]] = []
        for sub in module.modules():
            if "_hf_hook" in sub.__dict__:
                detached.append((sub, {k: sub.__dict__.pop(k) for k in _HOOK_ATTRIBUTES if k in sub.__dict__}))
        try:
            return copy.deepcopy(module, memo if memo is not None else {})
        finally:
            for sub, attributes in detached:
                sub.__dict__.update(attributes)


def dispatch_like(block: nn.Module, reference: nn.Module) -> nn.Module:
    """Places a new in-memory `block` the way `reference` (the block it will replace) is placed, and returns it.

    - `reference` offloaded to disk: `block` is written to a fresh folder (beside the model's offload folder when
      it has one; deleted when the block is garbage-collected) and offloaded with `accelerate.disk_offload`.
    - offloaded to CPU RAM: `accelerate.cpu_offload`.
    - dispatched on a device with a hook (multi-device `device_map`): moved there, with the same kind of hook, so
      activations coming from the previous layer's device are moved in.
    - otherwise `block` is returned as it is.
    """
    from accelerate import cpu_offload, disk_offload
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module

    offloaded = offloaded_submodules(reference)
    if offloaded:
        hook = offloaded[0]._hf_hook
        device = hook.execution_device
        loader = getattr(hook.weights_map, "dataset", hook.weights_map)
        prefix = getattr(hook.weights_map, "prefix", "")
        name = next(iter(offloaded[0]._parameters))
        on_disk = prefix + name in getattr(loader, "index", {})
        if not on_disk:
            return cpu_offload(block, execution_device=device)
        parent = getattr(loader, "save_folder", None)
        # Never inside the folder of a block placed here before (a block edited twice): that folder goes with its
        # block, and took this one's files along when the replaced block was collected.
        while parent is not None and os.path.basename(os.path.normpath(parent)).startswith(_FOLDER_PREFIX):
            parent = os.path.dirname(os.path.normpath(parent))
        parent = parent if parent is not None and os.path.isdir(parent) else None
        folder = tempfile.mkdtemp(prefix=_FOLDER_PREFIX, dir=parent)
        weakref.finalize(block, shutil.rmtree, folder, True)
        return disk_offload(block, folder, execution_device=device)
    hook = getattr(reference, "_hf_hook", None)
    if isinstance(hook, AlignDevicesHook) and hook.execution_device is not None:
        block.to(hook.execution_device)
        add_hook_to_module(
            block,
            AlignDevicesHook(
                execution_device=hook.execution_device, io_same_device=hook.io_same_device, skip_keys=hook.skip_keys
            ),
        )
    return block


def edit_block_(layers: nn.ModuleList, index: int, edit: Any, memo: dict[int, Any] | None = None) -> nn.Module:
    """Applies `edit(module)` to ``layers[index]`` so that the change persists, offloaded or not; returns the layer.

    An in-memory layer is edited in place. An offloaded layer's parameters are placeholders that its hook refills on
    every forward, so an edit to them would be lost: the layer is copied into memory (`detached_copy`), edited, and
    placed back the way the original was (`dispatch_like`: to disk again when it came from disk).
    """
    module = layers[index]
    if not is_offloaded(module):
        edit(module)
        return module
    copy = detached_copy(module, memo=memo)
    edit(copy)
    layers[index] = dispatch_like(copy, module)
    return layers[index]
