"""The worked example of docs/contributing/adding_an_architecture.md: a pre-norm family declared as a layout.

StarCoder2 has no adapter in the package; this one is the documented declaration, registered only for the duration
of each test, and it must pass the same conformance checks as the shipped families.
"""

from __future__ import annotations

from typing import ClassVar

import pytest

from optimum_flatten.adapters import registry
from optimum_flatten.adapters.base import ArchitectureAdapter
from optimum_flatten.adapters.layout import AttentionLayout, BlockLayout, MlpLayout
from tests.adapters.test_conformance import AdapterConformance

# ---- the declaration shown in the docs (transformers 5.23, models/starcoder2/modeling_starcoder2.py) ----
STARCODER2_LAYOUT = BlockLayout(
    attention=AttentionLayout(kv_heads_key="num_key_value_heads"),  # self_attn.{q,k,v,o}_proj, layer_idx, RoPE
    mlp=MlpLayout(up="c_fc", gate=None, down="c_proj", activation="act"),  # not gated
    norm_kind="layer",  # input_layernorm / post_attention_layernorm / norm are LayerNorms with bias
)


class Starcoder2Adapter(ArchitectureAdapter):
    """Pre-LN decoder with GQA, RoPE and a plain c_fc -> act -> c_proj MLP."""

    model_types = ("starcoder2",)
    capabilities = frozenset({"head_geometry", "pre_norm", "concat_heads", "layer_drop"})
    missing_capability_reasons: ClassVar[dict[str, str]] = {
        "gated_mlp": "StarCoder2's MLP is c_fc -> act -> c_proj without a gate projection",
    }
    layouts = (STARCODER2_LAYOUT,)


# ------------------------------------------------------------------------------------------------------------
class TestStarcoder2FromALayout(AdapterConformance):
    factory = "starcoder2"

    @pytest.fixture(autouse=True)
    def _registered(self, monkeypatch):
        monkeypatch.setitem(registry._ADAPTERS, "starcoder2", Starcoder2Adapter)


def test_the_example_is_not_left_registered():
    assert "starcoder2" not in registry.registered_adapters()


def test_a_family_without_its_declarations_is_refused():
    """The contract is an ABC: a family that forgets its layouts can be neither registered nor bound to a model."""

    class NoLayouts(ArchitectureAdapter):
        model_types = ("nolayouts",)

    with pytest.raises(TypeError, match=r"does not declare \['layouts'\]"):
        registry.register_adapter(NoLayouts)
    with pytest.raises(TypeError, match="abstract"):
        NoLayouts(object())
    assert "nolayouts" not in registry.registered_adapters()
