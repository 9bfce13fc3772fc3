import json
import re

import pytest

import tiny_models
from optimum_flatten import CalibrationConfig, FlattenConfig, LayerPlan
from optimum_flatten.utils.errors import InvalidTargetError, UnknownMethodError


def test_round_trip_through_dict_and_json():
    config = FlattenConfig(
        num_layers_to_remove=6,
        dataset="sotu:before-2000",
        nsamples=16,
        seqlen=256,
        seed=3,
        max_group_size=3,
        calibration_mode="sequential",
    )
    data = json.loads(json.dumps(config.to_dict()))
    assert data["quant_method"] == "flatten"
    assert data["method_args"] == {
        "selection": "similarity",
        "scoring_batches": 1,
        "calibration_mode": "sequential",
        "max_group_size": 3,
        "ridge_ratio": 10.0,
        "similarity_band": None,
        "similarity_memory_gb": 4.0,
        "attention_correction": True,
        "head_selection": "reconstruction",
        "attention_target": "sequential",
        "attention_ridge_ratio": 1.0,
        "covariance_dtype": "auto",
        "mlp_correction": True,
        "mlp_target": "sequential",
    }
    assert data["calibration"]["nsamples"] == 16
    again = FlattenConfig.from_dict(data)
    assert again == config
    assert again.calibration == CalibrationConfig(dataset="sotu:before-2000", nsamples=16, seqlen=256, seed=3)


def test_texts_are_described_not_serialised():
    config = FlattenConfig(num_layers_to_remove=1, dataset=["a", "b"])
    assert config.to_dict()["calibration"]["dataset"] == "<2 texts>"


def test_unknown_key_gets_did_you_mean():
    with pytest.raises(TypeError, match="Did you mean 'max_group_size'"):
        FlattenConfig(num_layers_to_remove=1, max_groupsize=3)
    with pytest.raises(TypeError, match="Did you mean 'nsamples'"):
        FlattenConfig(num_layers_to_remove=1, n_samples=3)


def test_unknown_method_lists_registered():
    from optimum_flatten.registry import registered_methods

    names = registered_methods()
    assert {"flattengpt", "shortgpt", "sleb", "laco", "sliding_window", "ffn_merge"} <= set(names)
    with pytest.raises(UnknownMethodError, match=r"Did you mean 'shortgpt'.*" + re.escape(str(names))):
        FlattenConfig(method="short_gpt", num_layers_to_remove=1)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(), "exactly one of"),
        (dict(num_layers_to_remove=2, target_sparsity=0.2), "exactly one of"),
        (dict(num_layers_to_remove=0), ">= 1"),
        (dict(target_sparsity=1.0), "strictly between 0 and 1"),
    ],
)
def test_invalid_targets(kwargs, match):
    with pytest.raises(InvalidTargetError, match=match):
        FlattenConfig(**kwargs)


def test_resolve_target_against_depth():
    assert FlattenConfig(target_sparsity=0.2).resolve_num_layers_to_remove(30) == 6
    with pytest.raises(InvalidTargetError, match=r"at most 29.*Choose a smaller target"):
        FlattenConfig(num_layers_to_remove=30).resolve_num_layers_to_remove(30)
    with pytest.raises(InvalidTargetError, match=r"remove 0 layer.*Choose a larger target"):  # not "smaller" (review J)
        FlattenConfig(target_sparsity=0.01).resolve_num_layers_to_remove(30)


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        (dict(calibration_mode="twice"), r"calibration_mode must be 'one_pass' or 'sequential', got 'twice'"),
        (dict(max_group_size=1), r"max_group_size must be an integer >= 2 or None, got 1\."),
        (dict(ridge_ratio=0), r"ridge_ratio must be > 0 and finite, got 0\."),
        (dict(ridge_ratio=float("inf")), r"ridge_ratio must be > 0 and finite, got inf\."),
        (dict(similarity_memory_gb=-1), r"similarity_memory_gb must be a positive number of GB, got -1\."),
    ],
)
def test_method_options_are_validated(bad, match):
    """Each bad option is refused by its own check, which names it: a bare ValueError from anywhere (a typo in
    another option, a failure further in) would pass a test without `match`."""
    with pytest.raises(ValueError, match=match):
        FlattenConfig(num_layers_to_remove=1, **bad)


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        (dict(calibration="abc"), "calibration must be a mapping of option names to values, got 'abc'"),
        (dict(method_args="x"), "method_args must be a mapping of option names to values"),
        (dict(layer_plan="x"), r"layer_plan must be a mapping of a LayerPlan's fields"),
        (dict(stacks=5), r"stacks must be a stack name or a non-empty list of them"),
        (dict(stacks=[]), r"stacks must be a stack name or a non-empty list of them"),
        (dict(version="abc"), "version must be an integer, got 'abc'"),
    ],
)
def test_options_of_the_wrong_shape_are_refused_by_name(bad, match):
    """Review J: Python's own errors named no option ("'int' object is not iterable"), and stacks=[] ran as the
    default stack."""
    with pytest.raises(TypeError, match=match):
        FlattenConfig.from_dict({"num_layers_to_remove": 1, **bad})


def test_version_mismatch_warns():
    with pytest.warns(UserWarning, match="version 99"):
        FlattenConfig(num_layers_to_remove=1, version=99)


def test_layer_plan_canonical_form_and_validation():
    plan = LayerPlan(num_layers=6, groups=[(0,), (1, 2), (4,), (5,)], rule="flatten_prune")
    assert plan.num_removed == 2
    assert plan.merged_groups == [(1, 2)]
    assert plan.dropped_indices == [3]
    assert plan.first_indices == [0, 1, 4, 5]
    assert LayerPlan.from_dict(plan.to_dict()) == plan
    assert "merged [1, 2]" in plan.describe() and "dropped [3]" in plan.describe()
    with pytest.raises(ValueError, match="out of range"):
        LayerPlan(num_layers=3, groups=[(0,), (3,)])
    with pytest.raises(ValueError, match="ascending"):
        LayerPlan(num_layers=3, groups=[(0, 1), (1,)])
    with pytest.raises(ValueError, match="ascending"):
        LayerPlan(num_layers=3, groups=[(2,), (0,)])


def _wrong_value(hint):
    """A value the hint does not admit, or None when the hint is one the type check leaves to the config."""
    import types
    import typing

    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        return _wrong_value(inner[0]) if len(inner) == 1 else None
    if origin is typing.Literal:
        return "not-a-choice"
    return {bool: "yes", int: 2.5, float: True, str: 3}.get(hint)


def test_every_method_option_is_type_checked_from_its_hint_with_its_name():
    """For every registered method and every scalar option, a value of the wrong type is refused at config time,
    and the error names the option (the hints are the one definition the command line also reads)."""
    import dataclasses
    import typing

    from optimum_flatten.registry import get_method_class, registered_methods

    checked = 0
    for method in registered_methods():
        config_class = get_method_class(method).config_class
        hints = typing.get_type_hints(config_class)
        for field in dataclasses.fields(config_class):
            value = _wrong_value(hints[field.name])
            if value is None:
                continue
            with pytest.raises(ValueError, match=rf"{config_class.__name__}: {field.name} must be .*, got "):
                config_class.from_dict({field.name: value})
            checked += 1
    assert checked > 40  # every method's scalar options, not a handful


def test_type_check_admits_what_the_hints_allow():
    from optimum_flatten.config import check_option_types
    from optimum_flatten.methods.flattengpt import FlattenGPTConfig
    from optimum_flatten.utils.errors import OptionTypeError

    check_option_types(FlattenGPTConfig, {"ridge_ratio": 3, "max_group_size": None, "calibration_mode": "sequential"})
    with pytest.raises(OptionTypeError, match=r"max_group_size must be an integer or None, got True \(bool\)"):
        check_option_types(FlattenGPTConfig, {"max_group_size": True})
    with pytest.raises(ValueError, match="Did you mean 'sequential'"):
        check_option_types(FlattenGPTConfig, {"calibration_mode": "sequentail"})


def test_the_registry_declares_each_built_in_methods_own_options():
    """The registry lists the built-in methods' options without importing them (the command line's fast path);
    each method must declare exactly the class the registry names, or the flags would describe other options."""
    import importlib

    from optimum_flatten.registry import BUILTIN_OPTIONS, get_method_class

    for name, where in BUILTIN_OPTIONS.items():
        module, _, attribute = where.partition(":")
        declared = getattr(importlib.import_module(f"optimum_flatten.options.methods.{module}"), attribute)
        assert get_method_class(name).config_class is declared, name


def test_the_options_import_neither_torch_nor_transformers():
    import subprocess
    import sys

    code = (
        "import sys\nfrom optimum_flatten.registry import BUILTIN_OPTIONS, get_config_class\n"
        "[get_config_class(name) for name in BUILTIN_OPTIONS]\nimport optimum_flatten.options.recovery\n"
        "print('torch' in sys.modules, 'transformers' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["False", "False"]


def test_the_request_options_are_declared_once_for_the_config_and_the_command_line():
    """`RequestOptions` is the one declaration: FlattenConfig accepts each field, the compress parser has one flag
    each with the field's help, and the parsed flags reach FlattenConfig under the field's name."""
    import argparse
    import dataclasses

    from optimum_flatten.cli.main import build_parser
    from optimum_flatten.cli.options import config_kwargs
    from optimum_flatten.config import _TOP_LEVEL_FIELDS
    from optimum_flatten.options.request import RequestOptions

    names = [f.name for f in dataclasses.fields(RequestOptions)]
    assert set(names) <= set(_TOP_LEVEL_FIELDS)
    compress = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices["compress"]
    flags = {a.dest: a for a in compress._actions}
    for f in dataclasses.fields(RequestOptions):
        assert flags[f.name].help == f.metadata["help"]
    args = compress.parse_args(
        ["m", "--output", "o", "--method", "shortgpt", "--target-sparsity", "0.2", "--compensation", "scale"]
    )
    kwargs = config_kwargs(args)
    assert {k: kwargs[k] for k in ("method", "target_sparsity", "compensation")} == {
        "method": "shortgpt",
        "target_sparsity": 0.2,
        "compensation": "scale",
    }
    config = FlattenConfig(**kwargs, dataset=["text"])
    assert (config.method, config.target_sparsity, config.compensation) == ("shortgpt", 0.2, "scale")


@pytest.mark.parametrize(
    "options, message",
    [
        ({"method_args": {"iterative": True}, "iterative": False}, r"iterative is given twice"),
        ({"calibration": {"nsamples": 4}, "nsamples": 8}, r"nsamples is given twice"),
        ({"packing": "false"}, r"packing must be True or False"),
        ({"seed": "0"}, r"seed must be an integer"),
        ({"text_column": 3}, r"text_column must be a string"),
    ],
    ids=["method option twice", "calibration option twice", "packing as text", "seed as text", "column as a number"],
)
def test_an_option_given_twice_or_as_the_wrong_type_is_refused_not_dropped(options, message):
    """Each of these used to run: the keyword silently won over the group, a string 'false' packed, a string seed
    drew other windows than the integer."""
    with pytest.raises((ValueError, TypeError), match=message):
        FlattenConfig(method="shortgpt", num_layers_to_remove=1, **options)
    same = FlattenConfig(method="shortgpt", num_layers_to_remove=1, method_args={"iterative": True}, iterative=True)
    assert same.method_config.iterative is True


def test_a_config_rebuilt_from_its_dict_asks_for_the_texts_it_only_described():
    """to_dict keeps a count of the texts given in memory, not the texts: rebuilt as it is, the count would be read
    as a `datasets` name after the model loaded. It is refused when the config is made, and a keyword gives the
    texts back."""
    texts = tiny_models.sample_texts()
    saved = FlattenConfig(method="shortgpt", num_layers_to_remove=2, dataset=texts, nsamples=8, seqlen=24).to_dict()
    with pytest.raises(ValueError, match=r"'<40 texts>' is how a saved config describes texts given in memory"):
        FlattenConfig.from_dict(saved)
    rebuilt = FlattenConfig.from_dict(saved, dataset=texts)
    assert rebuilt.calibration.dataset == texts and rebuilt.to_dict() == saved
    healing = {"max_tokens": 1024, "dataset": ["a b c"] * 4}
    saved = FlattenConfig(method="shortgpt", num_layers_to_remove=2, dataset=texts, heal=healing).to_dict()
    with pytest.raises(ValueError, match=r"heal's dataset '<4 texts>'"):
        FlattenConfig.from_dict(saved, dataset=texts)
    assert FlattenConfig.from_dict(saved, dataset=texts, heal=healing).heal["dataset"] == ["a b c"] * 4


def test_configs_on_other_texts_are_not_equal():
    def config(texts, heal_texts):
        return FlattenConfig(
            method="shortgpt", num_layers_to_remove=2, dataset=texts, heal={"max_tokens": 8, "dataset": heal_texts}
        )

    assert config(["a b"] * 3, ["c"]) == config(["a b"] * 3, ["c"])
    assert config(["a b"] * 3, ["c"]) != config(["x y"] * 3, ["c"])
    assert config(["a b"] * 3, ["c"]) != config(["a b"] * 3, ["d"])


def test_one_stack_name_is_one_stack():
    """``stacks="decoder"`` used to be read as the stacks 'd', 'e', 'c', ... and refused naming its letters."""
    assert FlattenConfig(method="shortgpt", num_layers_to_remove=1, stacks="decoder").stacks == ["decoder"]


def test_images_given_in_memory_are_described_as_images():
    """Pixels were described as "<12 texts>" (the card then said texts), and the description was not refused back."""
    import torch

    pixels = tiny_models.sample_pixel_values(12)
    saved = FlattenConfig(method="shortgpt", num_layers_to_remove=2, dataset=pixels).to_dict()
    assert saved["calibration"]["dataset"] == "<12 images>"
    assert (
        FlattenConfig(method="shortgpt", num_layers_to_remove=2, dataset=list(torch.unbind(pixels))).to_dict()[
            "calibration"
        ]["dataset"]
        == "<12 images>"
    )
    with pytest.raises(ValueError, match=r"'<12 images>' is how a saved config describes"):
        FlattenConfig.from_dict(saved)
