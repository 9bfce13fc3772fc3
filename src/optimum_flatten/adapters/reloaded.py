"""Models reloaded from a method's remote-code checkpoint: served by the adapter of the stock class they subclass.

A method whose result no stock config describes saves it with a modelling file that subclasses the stock config and
model classes and names its model_type ``"<stock>_<variant>"`` (LayerCollapse writes ``"gpt2_layer_collapse"``).
The module layout is the stock one except where the file rewrites it, so the stock family's adapter serves it
(`stock_model_type`); what the file changed back into the method's in-memory form is the method's business, so
`get_adapter` asks every registered method (`adopt_remote_code_`, through the method registry, which sits below the
adapters) and names none. An export writes the stock classes again (`stock_classes`), never the file's subclasses.
"""

from __future__ import annotations

from typing import Any

from torch import nn


def stock_model_type(config: Any) -> str | None:
    """The model_type of the stock family `config` belongs to: ``"gpt2"`` for a ``"gpt2_<variant>"`` config whose
    class is (or subclasses) transformers' ``GPT2Config``, else the config's own model_type."""
    model_type = getattr(config, "model_type", None)
    stock_class = _first_transformers_class(type(config), required=False)
    stock = getattr(stock_class, "model_type", "") or ""
    if model_type and stock and model_type != stock and model_type.startswith(f"{stock}_"):
        return stock
    return model_type


def adopt_remote_code_(model: nn.Module) -> None:
    """Lets every registered method put back what its remote-code checkpoint stored in the file's own modules
    (`CompressionMethod.adopt_reloaded_`); each method ignores a model that is not its own."""
    from ..registry import get_method_class, registered_methods

    for name in registered_methods():
        get_method_class(name).adopt_reloaded_(model)


def stock_classes(model: nn.Module) -> tuple[type, type]:
    """(model class, config class) of `model` as transformers defines them: the class itself, or for a reloaded
    remote-code model the first class of its MRO that transformers exports (the stock class the file subclassed).

    Raises:
        ValueError: neither the class nor any base of it is a transformers class.
    """
    return _first_transformers_class(type(model)), _first_transformers_class(type(model.config))


def _first_transformers_class(cls: type, required: bool = True) -> type | None:
    import transformers

    for candidate in cls.__mro__:
        if getattr(transformers, candidate.__name__, None) is candidate:
            return candidate
    if not required:
        return None
    raise ValueError(
        f"the class {cls.__module__}.{cls.__name__} is not part of transformers {transformers.__version__} and "
        "subclasses none of its classes."
    )


__all__ = ["adopt_remote_code_", "stock_classes", "stock_model_type"]
