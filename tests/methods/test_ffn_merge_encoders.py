"""ffn_merge on the encoder families (post-LN BERT calibrated on text, pre-LN ViT calibrated on images): shared
MLPs are tied, the unique-parameter count drops by exactly one MLP per merged pair, the merge changes the outputs,
and the saved checkpoint reloads with the plain class and, after `retie_ffn_`, shares the MLPs again."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import BertForMaskedLM, ViTForImageClassification

import tiny_models
from common import assert_close, compress, sample_ids
from optimum_flatten import FlattenConfig, get_adapter
from optimum_flatten.export.checkpoint import REPORT_NAME
from optimum_flatten.methods.ffn_merge import retie_ffn_
from optimum_flatten.utils.torch_utils import count_parameters

FAMILIES = {
    "bert": (BertForMaskedLM, lambda: tiny_models.sample_texts(), lambda m: m(input_ids=sample_ids()).logits),
    "vit": (
        ViTForImageClassification,
        lambda: tiny_models.sample_pixel_values(16, seed=5),
        lambda m: m(pixel_values=tiny_models.sample_pixel_values(2, seed=7)).logits,
    ),
}


def _mlp_numel(model, index: int) -> int:
    mlp = get_adapter(model).block("encoder", index).mlp
    return sum(p.numel() for v in (mlp.up, mlp.down) for p in v.module.parameters())


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("variant", ["permute", "vanilla"])
def test_ffn_merge_ties_saves_and_reties_on_encoders(tmp_path, family, variant):
    cls, data, outputs = FAMILIES[family]
    model = tiny_models.FACTORIES[family]().eval()
    with torch.no_grad():
        before = outputs(model)
    params = count_parameters(model)
    freed = _mlp_numel(model, 0)
    config = FlattenConfig(
        method="ffn_merge", window_size=2, num_windows=1, variant=variant, dataset=data(), nsamples=8, seqlen=24
    )
    quantizer = compress(model, config)
    (group,) = quantizer.report["ffn_groups"]
    first, second = group["layers"]
    adapter = get_adapter(model)
    a, b = adapter.block("encoder", first).mlp, adapter.block("encoder", second).mlp
    assert a.up.module.weight.data_ptr() == b.up.module.weight.data_ptr()
    assert a.down.module.weight.data_ptr() == b.down.module.weight.data_ptr()
    assert count_parameters(model) == params - freed
    with torch.no_grad():
        merged = outputs(model)
    assert not torch.allclose(merged, before, atol=1e-4)

    path = quantizer.save(model, tmp_path / "merged")
    reloaded = cls.from_pretrained(path).eval()
    with torch.no_grad():
        assert_close(outputs(reloaded), merged)
    assert count_parameters(reloaded) == params
    assert retie_ffn_(reloaded, json.loads((path / REPORT_NAME).read_text())) == freed
    assert count_parameters(reloaded) == params - freed
    with torch.no_grad():
        assert_close(outputs(reloaded), merged)
