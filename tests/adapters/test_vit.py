"""ViT adapter: views, the shared conformance checks, image calibration, merges and every applicable method end to end.

Naive references are written here from copies of the original weights: a freshly built shallower ViT (kept or
merged layers copied by state-dict name), two blocks run in parallel by hand, Block Influence recomputed from
``output_hidden_states``. The compressed models reload through plain ``AutoModelForImageClassification``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForImageClassification, ViTForImageClassification, ViTModel

import tiny_models
from common import assert_close, compress, tiny_config
from optimum_flatten import FlattenQuantizer, get_adapter
from optimum_flatten.adapters.vit import ViTAdapter
from optimum_flatten.calibration import CalibrationBatch, LayerwiseRunner, build_calibration_batches
from optimum_flatten.calibration.data import is_image_dataset
from optimum_flatten.config import CalibrationConfig
from optimum_flatten.ops import MERGE_RULES
from optimum_flatten.utils.errors import CalibrationDataError, UnsupportedArchitectureError
from tests.adapters.test_conformance import AdapterConformance

HIDDEN, HEADS, HEAD_DIM, INNER, LAYERS = 32, 4, 8, 48, 6
POSITIONS = 1 + (tiny_models.VIT_IMAGE_SIZE // tiny_models.VIT_PATCH_SIZE) ** 2  # CLS + 16 patches


# ------------------------------------------------------------------------------------------------ helpers
@pytest.fixture
def model():
    return tiny_models.tiny_vit()


def _state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@torch.no_grad()
def vit_outputs(model, pixel_values) -> torch.Tensor:
    """Class logits and every position's final (normed) state, so a change anywhere in the stack shows."""
    out = model(pixel_values=pixel_values, output_hidden_states=True)
    final = model.vit.layernorm(out.hidden_states[-1])
    return torch.cat([out.logits, final.flatten(1)], dim=1)


def fresh_vit_from_groups(model, groups, rule: str = "differences") -> ViTForImageClassification:
    """A freshly built ViT whose layer p holds `groups[p]`; merged groups combine attention and MLP parameters by
    `rule` (norms from the first member), computed by hand on state-dict entries."""
    original = _state(model)
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = len(groups)
    fresh = ViTForImageClassification(config).to(torch.float32).eval()
    state = {k: v for k, v in original.items() if not k.startswith("vit.layers.")}
    for new, group in enumerate(groups):
        members = [
            {k[len(f"vit.layers.{old}.") :]: v for k, v in original.items() if k.startswith(f"vit.layers.{old}.")}
            for old in group
        ]
        merged = dict(members[0])
        for name in merged:
            if name.startswith(("attention.", "mlp.")) and len(members) > 1:
                if rule == "differences":
                    merged[name] = members[0][name] + sum(m[name] - members[0][name] for m in members[1:])
                else:
                    merged[name] = members[-1][name]
        state.update({f"vit.layers.{new}.{k}": v for k, v in merged.items()})
    fresh.load_state_dict(state)
    return fresh


def _compress(model, method: str, num_layers_to_remove: int = 2, **method_args) -> FlattenQuantizer:
    """`common.compress` calibrated on 12 tiny images (no tokenizer)."""
    return compress(
        model,
        method,
        tokenizer=None,
        num_layers_to_remove=num_layers_to_remove,
        dataset=tiny_models.sample_pixel_values(12, seed=1),
        batch_size=4,
        **method_args,
    )


def _check_reload(model, out) -> None:
    """`out` holds `model` saved as a plain ViT: it reloads (eager and SDPA) with equal outputs."""
    pixels = tiny_models.sample_pixel_values(3, seed=5)
    saved = (out / "config.json").read_text()
    assert '"model_type": "vit"' in saved and "quantization_config" not in saved
    for implementation in ("eager", "sdpa"):
        reloaded = AutoModelForImageClassification.from_pretrained(
            out, dtype=torch.float32, attn_implementation=implementation
        ).eval()
        assert type(reloaded) is ViTForImageClassification
        assert reloaded.config.num_hidden_layers == len(reloaded.vit.layers) == model.config.num_hidden_layers
        assert_close(vit_outputs(reloaded, pixels), vit_outputs(model, pixels))


class FakeImageProcessor:
    """Stands in for a transformers image processor: HWC uint8 arrays -> normalised (N, C, H, W) pixel values."""

    def __call__(self, images, return_tensors="pt"):
        stacked = torch.stack([torch.as_tensor(image).permute(2, 0, 1).float() / 127.5 - 1.0 for image in images])
        return {"pixel_values": stacked}


def _raw_images(num: int) -> list:
    generator = torch.Generator().manual_seed(3)
    size = tiny_models.VIT_IMAGE_SIZE
    return [torch.randint(0, 256, (size, size, 3), generator=generator, dtype=torch.uint8).numpy() for _ in range(num)]


# ------------------------------------------------------------------------------------ shared conformance
class TestViTConformance(AdapterConformance):
    """The shared checks, fed with images, on the encoder stack."""

    factory = "vit"
    stack = "encoder"
    generates = False

    def sample_inputs(self):
        return tiny_models.sample_pixel_values()

    def outputs(self, model, inputs) -> torch.Tensor:
        return vit_outputs(model, inputs)

    def calibration_batch(self, inputs) -> CalibrationBatch:
        return CalibrationBatch.from_images(inputs)

    def expected_num_kv_heads(self, config) -> int:
        return config.num_attention_heads

    def naive_parallel(self, members, hidden, kwargs):
        """Two ViT layers on one input: attention outputs summed, then MLP outputs summed."""
        mask = kwargs.get("attention_mask")
        attn = sum(m.attention(m.layernorm_before(hidden), mask)[0] for m in members)
        mid = hidden + attn
        return mid + sum(m.mlp(m.layernorm_after(mid)) for m in members)

    def shallower_reference(self, model, kept):
        return fresh_vit_from_groups(model, [(i,) for i in kept])


# ------------------------------------------------------------------------------------------------- views
def test_views_bind_vit_modules(model):
    adapter = get_adapter(model)
    assert isinstance(adapter, ViTAdapter)
    assert adapter.stacks() == ["encoder"] and adapter.num_layers() == LAYERS
    assert adapter.base_model() is model.vit and adapter.layers() is model.vit.layers
    assert adapter.embeddings() is model.vit.embeddings
    assert adapter.position_embeddings() is model.vit.embeddings.position_embeddings
    assert adapter.final_norm() is model.vit.layernorm and adapter.lm_head() is None
    for block, layer in zip(adapter.blocks(), model.vit.layers, strict=True):
        att, mlp = block.attention, block.mlp
        assert block.norm_position == "pre" and block.cross_attention is None
        assert block.attn_norm.module is layer.layernorm_before and block.mlp_norm.module is layer.layernorm_after
        assert block.attn_norm.kind == "layer" and block.attn_norm.bias is not None
        assert (att.geometry.num_heads, att.geometry.num_kv_heads, att.geometry.head_dim) == (HEADS, HEADS, HEAD_DIM)
        assert att.position_scheme == "learned"
        for view, name in ((att.q, "q_proj"), (att.k, "k_proj"), (att.v, "v_proj"), (att.o, "o_proj")):
            assert view.module is getattr(layer.attention, name)
        assert mlp.gate is None and mlp.up.module is layer.mlp.fc1 and mlp.down.module is layer.mlp.fc2
        assert mlp.activation is layer.mlp.activation_fn and mlp.intermediate_size == INNER


def test_view_round_trip_is_the_identity(model):
    adapter = get_adapter(model)
    pixels = tiny_models.sample_pixel_values()
    before_state, before = _state(model), vit_outputs(model, pixels)
    for block in adapter.blocks():
        att, mlp = block.attention, block.mlp
        for view in (att.q, att.k, att.v, att.o, mlp.up, mlp.down):
            view.set_(view.weight.clone(), view.bias.clone())
    after = model.state_dict()
    assert after.keys() == before_state.keys()
    assert all(torch.equal(after[k], v) for k, v in before_state.items())
    assert torch.equal(vit_outputs(model, pixels), before)


def test_bare_vit_model_binds_itself():
    torch.manual_seed(0)
    bare = ViTModel(tiny_models.tiny_vit().config).eval()
    adapter = get_adapter(bare)
    assert adapter.base_model() is bare and adapter.final_norm() is bare.layernorm
    adapter.keep_layers_("encoder", [1, 4])
    adapter.update_config_("encoder", [1, 4])
    adapter.validate()


def test_capabilities_are_honest(model):
    adapter = get_adapter(model)
    assert {"head_geometry", "pre_norm", "concat_heads", "layer_drop"} <= adapter.capabilities
    assert "without a gate projection" in adapter.missing_capabilities({"gated_mlp", "layer_drop"})["gated_mlp"]
    assert set(adapter.missing_capabilities({"gated_mlp", "layer_drop"})) == {"gated_mlp"}


def test_head_pruning_keeps_the_head_count_attribute_in_sync(model):
    adapter = get_adapter(model)
    adapter.keep_heads_(adapter.block("encoder", 2), [1, 2, 3])
    assert model.vit.layers[2].attention.num_attention_heads == 3
    assert vit_outputs(model, tiny_models.sample_pixel_values()).isfinite().all()


def test_concat_syncs_the_head_count_of_the_wide_block(model):
    from optimum_flatten.methods.flattengpt import fold_block_norms_

    adapter = get_adapter(model)
    members = [adapter.detached_block("encoder", i) for i in (3, 4)]
    for member in members:
        fold_block_norms_(member)
    wide = adapter.build_concat_block(members)
    assert wide.attention.num_attention_heads == 2 * HEADS and wide.mlp.fc1.out_features == 2 * INNER


# ---------------------------------------------------------------------------------------------- calibration
def test_runner_feeds_pixels_and_marks_every_position_real(model):
    pixels = tiny_models.sample_pixel_values(3)
    adapter = get_adapter(model)
    batch = CalibrationBatch.from_images(pixels)
    assert adapter.forward_inputs("encoder", batch, torch.device("cpu")).keys() == {"pixel_values"}
    runner = LayerwiseRunner(adapter, [batch], "encoder")
    assert torch.equal(runner.masks[0], torch.ones(3, POSITIONS, dtype=torch.long))
    with torch.no_grad():
        expected = model.vit(pixels, output_hidden_states=True).hidden_states
    current = runner.inputs
    for i, layer in enumerate(model.vit.layers):
        assert_close(current[0], expected[i])
        current = runner.run(layer, i, current)
    assert_close(current[0], expected[-1])


def test_a_text_batch_is_refused_with_the_image_api(model):
    ids = torch.ones(1, 4, dtype=torch.long)
    with pytest.raises(CalibrationDataError, match=r"ViT calibrates on images.*\(N, C, H, W\) tensor"):
        LayerwiseRunner(get_adapter(model), [CalibrationBatch(ids, torch.ones_like(ids))], "encoder")


def test_image_batches_from_a_tensor_sample_with_the_seed():
    images = tiny_models.sample_pixel_values(12, seed=1)
    config = CalibrationConfig(dataset=images, nsamples=8, batch_size=3, seed=4)
    batches = build_calibration_batches(None, config)
    assert [b.num_images for b in batches] == [3, 3, 2]
    assert all(b.input_ids.shape == (b.num_images, 0) and b.num_tokens == 0 for b in batches)
    drawn = torch.cat([b.pixel_values for b in batches])
    # Naive: the drawn images are 8 distinct rows of the input, in input order, the same for the same seed.
    rows = [next(i for i in range(12) if torch.equal(images[i], image)) for image in drawn]
    assert rows == sorted(set(rows)) and len(rows) == 8
    again = torch.cat([b.pixel_values for b in build_calibration_batches(None, config)])
    assert torch.equal(drawn, again)


def test_image_batches_from_lists_processors_and_datasets():
    images = tiny_models.sample_pixel_values(8, seed=1)
    config = CalibrationConfig(dataset=[images[:3], *images[3:].unbind(0)], nsamples=8)
    assert torch.equal(build_calibration_batches(None, config)[0].pixel_values, images)
    raw = _raw_images(8)
    processed = build_calibration_batches(FakeImageProcessor(), CalibrationConfig(dataset=raw, nsamples=8))
    assert torch.equal(processed[0].pixel_values, FakeImageProcessor()(raw)["pixel_values"])
    datasets = pytest.importorskip("datasets")
    table = datasets.Dataset.from_dict({"image": raw, "label": list(range(8))})
    from_table = build_calibration_batches(FakeImageProcessor(), CalibrationConfig(dataset=table, nsamples=8))
    assert_close(from_table[0].pixel_values, processed[0].pixel_values)
    pixels_table = datasets.Dataset.from_dict({"pixel_values": images.tolist()})
    assert_close(
        build_calibration_batches(None, CalibrationConfig(dataset=pixels_table, nsamples=8))[0].pixel_values, images
    )


def test_text_data_stays_text():
    assert not is_image_dataset(["a text", "another"]) and not is_image_dataset("wikitext2")
    assert is_image_dataset(tiny_models.sample_pixel_values(2))


@pytest.mark.parametrize(
    ("dataset", "processor", "match"),
    [
        (tiny_models.sample_pixel_values(4), None, r"holds 4 images, fewer than nsamples=8"),
        (torch.zeros(8, 3, 16), None, r"shape \(N, C, H, W\), got torch.float32 of shape \(8, 3, 16\)"),
        (_raw_images(8), None, r"need an image processor.*compress\(model, image_processor\)"),
        ([torch.zeros(3, 16, 16)] * 4 + [torch.zeros(3, 8, 8)] * 4, None, r"of one shape"),
    ],
)
def test_bad_image_data_is_refused(dataset, processor, match):
    with pytest.raises(CalibrationDataError, match=match):
        build_calibration_batches(processor, CalibrationConfig(dataset=dataset, nsamples=8))


# ---------------------------------------------------------------------------------------------- merges
@pytest.mark.parametrize("rule", ["differences", "reference_code"])
def test_parameter_merge_equals_naive_merge_in_a_fresh_model(model, rule):
    groups = [(0,), (1, 2, 3), (4,), (5,)]
    reference = fresh_vit_from_groups(model, groups, rule)
    adapter = get_adapter(model)
    state = MERGE_RULES[rule]([adapter.mergeable_state(adapter.layers()[i]) for i in groups[1]])
    adapter.replace_block_("encoder", 1, adapter.build_merged_block("encoder", 1, state))
    adapter.keep_layers_("encoder", [0, 1, 4, 5])
    adapter.reindex_("encoder")
    adapter.update_config_("encoder", [0, 1, 4, 5])
    adapter.validate()
    pixels = tiny_models.sample_pixel_values()
    assert_close(vit_outputs(model, pixels), vit_outputs(reference, pixels))


# ------------------------------------------------------------------------------------- methods end to end
@pytest.mark.parametrize(
    ("method", "method_args"),
    [("shortgpt", {}), ("laco", {"threshold": None}), ("sliding_window", {"threshold": None})],
)
def test_method_compresses_and_reloads_as_plain_vit(tmp_path, model, method, method_args):
    pixels = tiny_models.sample_pixel_values()
    original_model = copy.deepcopy(model)
    original = vit_outputs(model, pixels)
    quantizer = _compress(model, method, **method_args)
    assert model.config.num_hidden_layers == len(model.vit.layers) == LAYERS - 2
    assert not torch.allclose(vit_outputs(model, pixels), original, atol=1e-3)
    rule = getattr(quantizer.config.method_config, "merge_rule", "differences")
    reference = fresh_vit_from_groups(original_model, [tuple(g) for g in quantizer.plan.group_lists()], rule)
    assert_close(vit_outputs(model, pixels), vit_outputs(reference, pixels))
    _check_reload(model, quantizer.save(model, tmp_path / "compressed"))


@pytest.mark.parametrize("qkv_bias", [True, False])
def test_flattengpt_on_vit(tmp_path, qkv_bias):
    """Pre-LN with LayerNorm biases (folded) and a plain GELU MLP: FlattenGPT merges and prunes back to the width.
    Without q/k/v biases the fold gives the merged layer's q/k/v the LayerNorm's: the saved config used to keep
    ``qkv_bias=False``, and the reload dropped them (logits 0.23 off)."""
    model = tiny_models.tiny_vit(qkv_bias=qkv_bias)
    pixels = tiny_models.sample_pixel_values()
    original = vit_outputs(model, pixels)
    quantizer = _compress(model, "flattengpt", num_layers_to_remove=1)
    assert model.config.num_hidden_layers == len(model.vit.layers) == LAYERS - 1
    assert quantizer.plan.merged_groups and quantizer.plan.rule
    for block in get_adapter(model).blocks():
        assert block.attention.geometry.num_heads == HEADS and block.mlp.intermediate_size == INNER
        assert block.module.attention.num_attention_heads == HEADS
    assert not torch.allclose(vit_outputs(model, pixels), original, atol=1e-3)
    _check_reload(model, quantizer.save(model, tmp_path / "compressed"))


def test_shortgpt_keeps_the_layers_a_naive_block_influence_ranks_highest():
    """BI_i = 1 - mean cos(h_i, h_i+1) over every image position (CLS and patches), on the residual stream."""
    model = tiny_models.tiny_vit()
    quantizer = _compress(copy.deepcopy(model), "shortgpt")
    batches = build_calibration_batches(None, quantizer.config.calibration)
    sums = torch.zeros(LAYERS, dtype=torch.float64)
    count = 0
    with torch.no_grad():
        for batch in batches:
            states = model.vit(batch.pixel_values, output_hidden_states=True).hidden_states
            for i in range(LAYERS):
                a, b = states[i].flatten(0, 1).double(), states[i + 1].flatten(0, 1).double()
                sums[i] += torch.nn.functional.cosine_similarity(a, b, dim=-1).sum()
            count += states[0].shape[0] * states[0].shape[1]
    influence = 1.0 - sums / count
    expected_kept = sorted(torch.argsort(influence, descending=True)[: LAYERS - 2].tolist())
    assert quantizer.plan.first_indices == expected_kept
    torch.testing.assert_close(
        torch.tensor(quantizer.report["block_influence"], dtype=torch.float64), influence, atol=1e-5, rtol=0
    )
    # The report counts image positions (CLS and patches), and ShortGPT's one pass is one pass.
    assert quantizer.report["calibration"]["tokens"] == count
    assert quantizer.report["cost"]["stack_passes"] == 1.0


def test_sleb_is_refused_and_leaves_the_model_untouched(model):
    before = _state(model)
    with pytest.raises(UnsupportedArchitectureError, match=r"causal LM head.*shortgpt, laco, sliding_window"):
        _compress(model, "sleb")
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())
    assert model.config.num_hidden_layers == len(model.vit.layers) == LAYERS


def test_compress_on_load_calibrated_on_pixels_needs_no_tokenizer(tmp_path):
    """``from_pretrained(..., quantization_config=FlattenConfig(dataset=pixels))`` on a ViT saved without a tokenizer
    loads what the checkpoint has (nothing here; an image processor where saved) instead of failing on a tokenizer it
    does not need, and compresses as `FlattenQuantizer.compress` does."""
    tiny_models.tiny_vit().save_pretrained(tmp_path / "dense")
    options = dict(num_layers_to_remove=2, dataset=tiny_models.sample_pixel_values(12, seed=1), batch_size=4)
    on_load = AutoModelForImageClassification.from_pretrained(
        tmp_path / "dense", quantization_config=tiny_config("shortgpt", **options)
    )
    explicit = AutoModelForImageClassification.from_pretrained(tmp_path / "dense")
    _compress(explicit, "shortgpt")
    pixels = tiny_models.sample_pixel_values(3, seed=5)
    assert on_load.config.num_hidden_layers == explicit.config.num_hidden_layers == len(on_load.vit.layers)
    assert_close(vit_outputs(on_load, pixels), vit_outputs(explicit, pixels))
    on_load.save_pretrained(tmp_path / "out")
    _check_reload(on_load, tmp_path / "out")


@pytest.mark.parametrize(
    ("family", "dataset", "message"),
    [
        ("vit", "texts", r"this ViTForImageClassification calibrates on images, and dataset= holds text"),
        ("bert", "images", r"this BertForMaskedLM calibrates on text, and dataset= holds images"),
        ("llama", "images", r"this LlamaForCausalLM calibrates on text, and dataset= holds images"),
    ],
)
def test_calibration_data_of_the_other_kind_is_refused_first(family, dataset, message):
    """Text for a ViT used to fail as "too few tokens for nsamples x seqlen" (or, at a small seqlen, with the right
    words), images for BERT or LLaMA as a reshape of 0 elements deep in the forward."""
    from common import assert_refused_before_any_change

    model = {"vit": tiny_models.tiny_vit, "bert": tiny_models.tiny_bert, "llama": tiny_models.tiny_llama_gqa}[family]()
    data = tiny_models.sample_texts() if dataset == "texts" else tiny_models.sample_pixel_values(16)
    assert_refused_before_any_change(model, "shortgpt", message, dataset=data, num_layers_to_remove=2)


def test_the_card_describes_images_and_loads_an_image_processor(tmp_path, model):
    """The card said "<12 texts>, 8 sequences x 2048 tokens" and showed AutoTokenizer, which a ViT folder lacks."""
    quantizer = _compress(model, "shortgpt")
    card = (quantizer.save(model, tmp_path / "out") / "README.md").read_text()
    assert "- Calibration: <12 images>, 8 images (136 positions, CLS and patches), seed 0" in card
    assert "AutoImageProcessor.from_pretrained" in card and "AutoTokenizer" not in card
