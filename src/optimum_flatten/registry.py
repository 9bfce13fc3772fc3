"""The method registry: ``@register_method("name")`` in the method's file, and its name and options class in
`BUILTIN_OPTIONS` (which `load_builtin_methods` imports by)."""

from __future__ import annotations

import importlib
from typing import Any

from .utils.errors import UnknownMethodError, UnsupportedArchitectureError, did_you_mean

_METHODS: dict[str, type] = {}

#: The built-in methods: name -> the class of their options (``module:Class`` under optimum_flatten.options.methods).
#: Their names and options are known from these torch-free declarations alone, so the command line lists the methods
#: and builds their flags without importing any method (`registered_methods`, `get_config_class`); the methods
#: themselves load on first use (`get_method_class`), and each checks that it declares the class named here.
BUILTIN_OPTIONS = {
    "auto": "auto:AutoConfig",
    "come": "come:CoMeConfig",
    "ffn_merge": "ffn_merge:FfnMergeConfig",
    "flattengpt": "flattengpt:FlattenGPTConfig",
    "greedy_replace": "greedy_replace:GreedyReplaceConfig",
    "laco": "laco:LaCoConfig",
    "layer_collapse": "layer_collapse:LayerCollapseConfig",
    "replaceme": "replaceme:ReplaceMeConfig",
    "shortgpt": "shortgpt:ShortGPTConfig",
    "sleb": "sleb:SLEBConfig",
    "sliding_window": "sliding_window:SlidingWindowConfig",
    "uidl": "uidl:BlockSelectionConfig",
}


def register_method(name: str):
    """Class decorator registering a CompressionMethod under `name`; a name can be registered only once."""

    def decorator(cls: type) -> type:
        if name in _METHODS:
            raise ValueError(f"method {name!r} is already registered by {_METHODS[name].__name__}.")
        if name != name.lower() or " " in name:
            raise ValueError(f"method names are lower snake case, got {name!r}.")
        cls.name = name
        _METHODS[name] = cls
        return cls

    return decorator


def registered_methods() -> list[str]:
    """Every method name: the built-in ones (without importing them) and those registered by plugins."""
    return sorted(set(BUILTIN_OPTIONS) | set(_METHODS))


def get_config_class(name: str) -> type:
    """The options dataclass of method `name`, without importing the method when it is a built-in one.

    Raises:
        UnknownMethodError: listing the registered names, with a did-you-mean hint.
    """
    if name in BUILTIN_OPTIONS and name not in _METHODS:
        import importlib

        module, _, attribute = BUILTIN_OPTIONS[name].partition(":")
        return getattr(importlib.import_module(f"optimum_flatten.options.methods.{module}"), attribute)
    return get_method_class(name).config_class


def load_builtin_methods() -> None:
    """Imports every built-in method's module by name (``optimum_flatten.methods.<name>``, the module each one
    registers from), as transformers' auto classes load a model family on first use: the registry names no code of
    the methods package, which sits above it."""
    for module in BUILTIN_OPTIONS:
        importlib.import_module(f"optimum_flatten.methods.{module}")


def get_method_class(name: str) -> type:
    """The method class registered under `name`.

    Raises:
        UnknownMethodError: listing the registered names, with a did-you-mean hint.
    """
    if name in BUILTIN_OPTIONS and name not in _METHODS:
        load_builtin_methods()
    names = registered_methods()
    if name not in _METHODS:
        raise UnknownMethodError(
            f"unknown method {name!r}.{did_you_mean(str(name), names)} Registered methods: {names}."
        )
    return _METHODS[name]


def methods_for(capabilities: frozenset[str] | set[str]) -> list[str]:
    """Registered methods whose declared `required_capabilities` an architecture with `capabilities` offers.

    Refusals use it to name the alternatives; adapters never look methods up themselves (they sit below them).
    """
    return [
        name for name in registered_methods() if set(get_method_class(name).required_capabilities) <= set(capabilities)
    ]


def runnable_methods(adapter: Any, stack: str | None = None) -> list[str]:
    """`methods_for` the adapter's capabilities, less those whose own `preflight` refuses `stack` (default: the
    adapter's first) with their default options: SLEB, auto and greedy_replace need an LM head reading the stack,
    ReplaceMe a stack its bridge folds into. A refusal names these as the alternatives, so each of them runs."""
    global _LISTING
    if _LISTING:  # asked by a refusal one of the preflights below raises: that one is not listed anyway
        return []
    stack = stack if stack is not None else adapter.stacks()[0]
    names, _LISTING = [], True
    try:
        for name in methods_for(adapter.capabilities):
            method_class = get_method_class(name)
            try:  # a method whose options have no defaults to try it with is not offered either
                method_class(method_class.config_class()).preflight(adapter, stack)
            except (UnsupportedArchitectureError, ValueError, TypeError):
                continue
            names.append(name)
    finally:
        _LISTING = False
    return names


#: Whether `runnable_methods` is running the methods' preflights: a refusal they raise then names no alternatives
#: (greedy_replace's preflight asks `require_capabilities` for FlattenGPT, whose list would run it again).
_LISTING = False


def require_capabilities(adapter: Any, method: str, stack: str | None = None) -> None:
    """Refuses `method` on `adapter`'s architecture when the family lacks a capability the method declares.

    The refusal lives here, above the adapters: an adapter states what it offers and why not (`missing_capabilities`),
    the registry knows which method needs what and which registered methods the architecture can run instead
    (`runnable_methods`, on `stack`). `adapter` is an `ArchitectureAdapter`; the registry sits below the adapters in
    the import layers (the adapters ask it for methods' reload hooks), so it does not import the type.

    Raises:
        UnsupportedArchitectureError: naming the method, what is missing with the family's reasons, and the
            methods that run on the architecture instead.
    """
    missing = adapter.missing_capabilities(get_method_class(method).required_capabilities)
    if missing:
        runnable = "" if _LISTING else runnable_methods(adapter, stack)
        alternatives = f" Methods that run on this {type(adapter.model).__name__}: {runnable}." if runnable else ""
        raise UnsupportedArchitectureError(
            f"method {method!r} needs {sorted(missing)}, which model_type {adapter.config.model_type!r} does not "
            f"offer ({'; '.join(missing.values())}).{alternatives}"
        )
