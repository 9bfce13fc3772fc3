"""Block-by-block calibration: cached hidden states, one decoder layer on the compute device at a time.

The model runs once with every layer of the stack replaced by a recorder that stores the keyword arguments the
model passes to that layer (attention mask of the layer's type, rotary embeddings, position ids) and returns its
input unchanged; that costs one embedding lookup. After that, any block (an original layer, a flattened
double-width block, a compressed block) can be run on the cached states with the arguments of the position it
will occupy. With accelerate offload hooks on the layers, calling a layer onloads its weights and offloads them
afterwards, so peak memory is one layer plus the cached activations.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from ..utils.torch_utils import count_parameters, first_output, module_device
from .data import CalibrationBatch
from .model_access import CalibrationAdapter


class _StopForward(Exception):
    """Raised by the last recorder so the model skips its final norm and head."""


class _Recorder(nn.Module):
    """Stands in for a layer: records the arguments the model passes to it, returns the hidden state unchanged.

    Arguments passed positionally (GPT-2's loop passes the cache and the mask that way) are named through the
    replaced layer's signature, so the runner can always call a block with keywords.
    """

    def __init__(self, sink: list[dict[str, Any]], stop: bool, as_tuple: bool, signature: inspect.Signature) -> None:
        super().__init__()
        self.sink = sink
        self.stop = stop
        self.as_tuple = as_tuple
        self.signature = signature

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if args:
            bound = self.signature.bind(hidden_states, *args, **kwargs)
            named = dict(bound.arguments)
            named.pop(next(iter(self.signature.parameters)))  # the hidden state
            extra = named.pop(_var_keyword(self.signature), {}) if _var_keyword(self.signature) else {}
            if _var_positional(self.signature) in named:
                raise TypeError("a decoder layer taking *args cannot be recorded: its arguments have no names")
            kwargs = {**named, **extra}
        self.sink.append(kwargs)
        if self.stop:
            raise _StopForward(hidden_states)
        # A loop that does `layer_outputs[0]` on a bare tensor would silently take the first batch row.
        return (hidden_states,) if self.as_tuple else hidden_states


def _var_keyword(signature: inspect.Signature) -> str | None:
    return next((n for n, p in signature.parameters.items() if p.kind is inspect.Parameter.VAR_KEYWORD), None)


def _var_positional(signature: inspect.Signature) -> str | None:
    return next((n for n, p in signature.parameters.items() if p.kind is inspect.Parameter.VAR_POSITIONAL), None)


def _to_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, tuple):
        return tuple(_to_device(v, device) for v in value)
    if isinstance(value, list):
        return [_to_device(v, device) for v in value]
    if isinstance(value, dict):
        return {k: _to_device(v, device) for k, v in value.items()}
    return value


class LayerwiseRunner:
    """Runs a block stack one block at a time over cached calibration hidden states.

    Attributes:
        inputs: hidden states entering layer 0, one tensor per calibration batch.
        masks: (batch, seq) token masks, 1 on real tokens; statistics must use them.
        layer_kwargs: ``layer_kwargs[i][b]`` are the keyword arguments the model passes to layer ``i`` for batch ``b``.
    """

    def __init__(
        self, adapter: CalibrationAdapter, batches: Sequence[CalibrationBatch], stack: str = "decoder"
    ) -> None:
        self.adapter = adapter
        self.stack = stack
        #: Per batch, 1 on the positions of the stack's hidden states that are real tokens (the adapter knows which
        #: mask that is: the text mask for a decoder, the source mask for an encoder, all ones for image patches).
        self.masks = [adapter.token_mask(stack, b) for b in batches]
        self._batches = list(batches)
        self.layer_kwargs, self._inputs = self._record(self._batches)
        #: Weight x token products of every block run so far: the compute a method spent, in a unit independent of
        #: the machine (one pass of N tokens through layers holding P weights is N x P).
        self.work = 0

    @property
    def inputs(self) -> list[torch.Tensor]:
        """The hidden states entering layer 0, one tensor per batch; recorded again (an embedding pass, the same
        tensors bit for bit) when `release_inputs` dropped them."""
        if self._inputs is None:
            _, self._inputs = self._record(self._batches)
        return self._inputs

    @inputs.setter
    def inputs(self, value: list[torch.Tensor]) -> None:
        """Replaces the layer-0 states (`CalibratedStates.on_first_batches` cuts them to the first batches: a
        later recording takes those batches only)."""
        self._inputs = list(value)
        self._batches = self._batches[: len(self._inputs)]

    def release_inputs(self) -> None:
        """Drops the layer-0 states (a copy of the calibration states) until someone reads `inputs` again: a walk
        up the stack that has run layer 0 needs them no more, and holding them would cost that copy through the
        whole walk. Recording them again costs an embedding pass, not a layer."""
        self._inputs = None

    @torch.no_grad()
    def _record(self, batches: Sequence[CalibrationBatch]) -> tuple[list[list[dict[str, Any]]], list[torch.Tensor]]:
        layers = self.adapter.layers(self.stack)
        num_layers = len(layers)
        sinks: list[list[dict[str, Any]]] = [[] for _ in range(num_layers)]
        originals = list(layers)
        inputs: list[torch.Tensor] = []
        base = self.adapter.base_model(self.stack)
        device = module_device(self.adapter.embeddings())
        try:
            for i in range(num_layers):
                layers[i] = _Recorder(
                    sinks[i],
                    stop=i == num_layers - 1,
                    as_tuple=self.adapter.layer_output_is_tuple,
                    signature=inspect.signature(originals[i].forward),
                )
            for batch in batches:
                try:
                    base(**self.adapter.forward_inputs(self.stack, batch, device))
                except _StopForward as stop:
                    inputs.append(stop.args[0])
                else:  # pragma: no cover - a model that skips its layers
                    raise RuntimeError("the model forward never reached its last layer")
        finally:
            for i, layer in enumerate(originals):
                layers[i] = layer
        return sinks, inputs

    @property
    def num_batches(self) -> int:
        return len(self.masks)

    @torch.no_grad()
    def run(
        self,
        module: nn.Module,
        position: int,
        inputs: Sequence[torch.Tensor] | None = None,
        on_batch: Callable[[int], None] | None = None,
    ) -> list[torch.Tensor]:
        """Runs `module` as the layer at `position` on every batch and returns its outputs.

        Args:
            module: Any block with the stack's layer signature.
            position: Original layer index whose call arguments (mask type, rotary embeddings) are used.
            inputs: Hidden states to feed; defaults to `self.inputs`.
            on_batch: Called with the batch index before each batch (hooks use it to pick the token mask).
        """
        inputs = self.inputs if inputs is None else inputs
        device = module_device(module)
        weights = count_parameters(module)
        outputs = []
        total = torch.zeros((), dtype=torch.float32, device=device)
        for b, hidden in enumerate(inputs):
            self.work += weights * hidden.shape[0] * hidden.shape[1]
            if on_batch is not None:
                on_batch(b)
            kwargs = _to_device(self.layer_kwargs[position][b], device)
            out = first_output(module(hidden.to(device), **kwargs))
            total += out.sum(dtype=torch.float32)  # NaN or Inf anywhere makes it so: one read back per layer
            outputs.append(out.to(hidden.device))
        if not bool(torch.isfinite(total)):
            raise ValueError(
                f"the states after layer {position} are not finite (NaN or Inf) on the calibration text: the "
                "checkpoint's weights or the dtype it is loaded in (float16 overflows where bfloat16 does not) "
                "cannot be compressed as they are; check them, or load the model in bfloat16 or float32."
            )
        return outputs


@contextlib.contextmanager
def capture_module_inputs(module: nn.Module, callback: Callable[[torch.Tensor], None]) -> Iterator[None]:
    """Calls `callback` with the (first positional) input of every forward of `module` while the context is open."""

    def hook(_module: nn.Module, args: tuple[Any, ...]) -> None:
        callback(args[0].detach())

    handle = module.register_forward_pre_hook(hook)
    try:
        yield
    finally:
        handle.remove()
