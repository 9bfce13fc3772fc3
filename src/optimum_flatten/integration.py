"""Compress on load: ``from_pretrained(..., quantization_config=FlattenConfig(...))``.

Registered through transformers' public `register_quantization_config` / `register_quantizer` when
`optimum_flatten` is imported. As in transformers' GPTQ path, `requires_calibration` stays False (in transformers
that flag means "the checkpoint must already be compressed"): the weights load as usual, then
`_process_model_after_weight_loading` calibrates and compresses, and the quantization config is removed again,
so the model is an ordinary one and `save_pretrained` writes a plain checkpoint.
"""

from __future__ import annotations

import logging
from typing import Any

from transformers.quantizers.auto import (
    AUTO_QUANTIZATION_CONFIG_MAPPING,
    AUTO_QUANTIZER_MAPPING,
    register_quantization_config,
    register_quantizer,
)
from transformers.quantizers.base import HfQuantizer

from .adapters import get_adapter
from .config import FlattenConfig
from .registry import get_method_class
from .utils.errors import ModelSourceError

logger = logging.getLogger(__name__)

QUANT_METHOD = "flatten"
#: The calibration tokenizer before `_process_model_before_weight_loading` has resolved it (None is a result).
_UNRESOLVED = object()


class FlattenHfQuantizer(HfQuantizer):
    """transformers' side of compress-on-load; the work is done by `FlattenQuantizer`."""

    requires_calibration = False
    quantization_config: FlattenConfig

    def __init__(self, quantization_config: FlattenConfig, **kwargs: Any) -> None:
        super().__init__(quantization_config, **kwargs)
        self.report: dict[str, Any] = {}
        self._tokenizer: Any = _UNRESOLVED

    def validate_environment(self, *args: Any, **kwargs: Any) -> None:
        # The method class says whether it can run here (a class-level flag, as transformers' quantizers declare
        # what they support), so this driver holds no list of methods.
        method = self.quantization_config.method
        method_class = get_method_class(method)
        if not method_class.supports_compress_on_load:
            raise ValueError(
                f"method {method!r} cannot run inside from_pretrained: {method_class.compress_on_load_refusal}"
            )
        if self.pre_quantized:
            raise ValueError(
                "this checkpoint's config.json carries quantization_config 'flatten', but compressed checkpoints are "
                "plain ones; remove quantization_config from config.json, or pass FlattenConfig only to compress."
            )

    def _process_model_before_weight_loading(self, model: Any, **kwargs: Any) -> Any:
        # The tokenizer is resolved while the model is still empty: a checkpoint whose tokenizer cannot be loaded is
        # refused before its weights are read (minutes at 7B), not after.
        self._tokenizer = self._calibration_tokenizer(model)
        return model

    def _calibration_tokenizer(self, model: Any) -> Any:
        """The calibration tokenizer: the config's (a name is loaded), else the checkpoint's own (a tokenizer, an
        image processor for ViT, or none it needs)."""
        tokenizer = self.quantization_config.tokenizer
        if isinstance(tokenizer, str):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(tokenizer)
        elif tokenizer is None:  # the checkpoint's own: a tokenizer, an image processor (ViT), or none it needs
            from .utils.loading import load_processor

            # transformers does not hand its trust_remote_code to a quantizer; a model class that is remote code
            # says the user trusted this checkpoint's code, its tokenizer's included.
            remote = type(model).__module__.startswith("transformers_modules")
            try:
                tokenizer = load_processor(model.name_or_path, trust_remote_code=remote)
            except ModelSourceError as error:  # a remote-code tokenizer beside a stock model
                raise ModelSourceError(
                    f"the tokenizer saved with {model.name_or_path!r} is remote code, and from_pretrained does not "
                    "pass trust_remote_code on to a quantization config: load the tokenizer yourself and pass it, "
                    "FlattenConfig(tokenizer=AutoTokenizer.from_pretrained(path, trust_remote_code=True), ...)."
                ) from error
        return tokenizer

    def _process_model_after_weight_loading(self, model: Any, **kwargs: Any) -> Any:
        from .quantizer import FlattenQuantizer

        tokenizer = self._tokenizer if self._tokenizer is not _UNRESOLVED else self._calibration_tokenizer(model)
        adapter = get_adapter(model)
        if adapter.exports_another_model():
            # transformers' save_pretrained would write the loaded class (remote code): only FlattenQuantizer.save
            # writes the stock equivalent, so the compression is refused before it runs rather than saved wrong.
            raise ValueError(
                f"a compressed {type(model).__name__} is saved as a stock model only by FlattenQuantizer.save, and "
                "compress-on-load hands back the loaded class, whose save_pretrained writes remote code; load it "
                "without quantization_config, then FlattenQuantizer(config).compress(model, tokenizer) and "
                ".save(model, folder, tokenizer), or run `optimum-flatten compress`."
            )
        # From here on the model is an ordinary one being compressed: transformers marked it quantized before this
        # step, and a model marked quantized is one the Trainer refuses to train (`FlattenConfig(heal=...)`).
        self.remove_quantization_config(model)
        quantizer = FlattenQuantizer(self.quantization_config)
        quantizer.in_place = True  # transformers keeps the model it loaded, whatever compress returns
        quantizer.compress(model, tokenizer)
        self.report = quantizer.report
        model.flatten_report = quantizer.report  # the compression renumbered hf_device_map (`compression.pipeline`)
        return model

    @property
    def is_trainable(self) -> bool:
        return True

    def is_serializable(self) -> bool:
        return True


def register() -> None:
    """Registers FlattenConfig and FlattenHfQuantizer under 'flatten'; safe to call more than once."""
    if QUANT_METHOD not in AUTO_QUANTIZATION_CONFIG_MAPPING:
        register_quantization_config(QUANT_METHOD)(FlattenConfig)
    if QUANT_METHOD not in AUTO_QUANTIZER_MAPPING:
        register_quantizer(QUANT_METHOD)(FlattenHfQuantizer)
