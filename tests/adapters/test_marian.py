"""Marian (OPUS-MT) adapter: two post-LN stacks, cross-attention, the EncoderDecoderCache, calibration on each stack,
and the layer-dropping and merging methods end to end on each stack.

Each stack goes through the shared `AdapterConformance` checks (one subclass per stack, fed with source and target
ids, with the stack's own config keys; post-LN, so folding and concatenation must be refused); what is Marian's own
is checked here: cross-attention, the decoder's layer_idx and seq2seq cache, teacher forcing, merges and methods on
one stack. The naive references are written here: a freshly built shallower MarianMTModel holding copied (or
hand-merged) weights, Block Influence recomputed from the model's own ``output_hidden_states``, and transformers' own
``labels`` loss for the decoder's teacher-forcing alignment.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import MarianConfig, MarianForCausalLM, MarianMTModel

import tiny_models
from common import assert_close, compress, sample_ids, tiny_config
from optimum_flatten import FlattenConfig, get_adapter
from optimum_flatten.adapters.marian import MarianAdapter, MarianLogitsHead, teacher_forcing_inputs
from optimum_flatten.calibration import CalibrationBatch, LayerwiseRunner
from optimum_flatten.calibration.data import build_calibration_batches
from optimum_flatten.methods.sleb import calibration_nll
from optimum_flatten.ops import MERGE_RULES
from optimum_flatten.utils.errors import UnsupportedArchitectureError
from tests.adapters.test_conformance import AdapterConformance

STACKS = ["encoder", "decoder"]
#: Per stack of the tiny factory: (layers, heads, head_dim, MLP width).
SHAPES = {"encoder": (5, 4, 8, 48), "decoder": (4, 2, 16, 40)}
HIDDEN = 32
LAYER_KEYS = {"encoder": "encoder_layers", "decoder": "decoder_layers"}
START = PAD = 0


# ------------------------------------------------------------------------------------------------ helpers
@pytest.fixture
def model():
    return tiny_models.tiny_marian()


def _source_target(batch: int = 2):
    source = sample_ids(batch, 10, seed=0)
    target = sample_ids(batch, 7, seed=1)
    target[:, 0] = START
    return source, target


@torch.no_grad()
def mt_logits(model, source=None, target=None) -> torch.Tensor:
    if source is None:
        source, target = _source_target()
    return model(input_ids=source, decoder_input_ids=target, use_cache=False).logits


@torch.no_grad()
def greedy_both_ways(model, source, new_tokens: int = 6):
    """Greedy generation with and without the cache: the tokens and the per-step scores."""
    kwargs = dict(max_new_tokens=new_tokens, do_sample=False, return_dict_in_generate=True, output_scores=True)
    cached = model.generate(source, use_cache=True, **kwargs)
    uncached = model.generate(source, use_cache=False, **kwargs)
    return cached, uncached


def assert_cache_consistent(model) -> None:
    source = _source_target()[0]
    cached, uncached = greedy_both_ways(model, source)
    assert torch.equal(cached.sequences, uncached.sequences)
    for a, b in zip(cached.scores, uncached.scores, strict=True):
        assert_close(a, b)


def _state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_state_equal(model, state) -> None:
    after = model.state_dict()
    assert after.keys() == state.keys()
    assert all(torch.equal(after[k], v) for k, v in state.items())


def fresh_marian_from_groups(model, stack: str, groups, rule: str = "differences") -> MarianMTModel:
    """A MarianMTModel built from a config with ``len(groups)`` layers in `stack`, layer p holding group p by hand.

    A group of one is a copy of that layer; a larger group combines the attention (self and cross) and fc1/fc2
    parameters by `rule` and keeps the first member's three LayerNorms. The other stack is copied unchanged.
    """
    original = _state(model)
    config = copy.deepcopy(model.config)
    setattr(config, LAYER_KEYS[stack], len(groups))
    fresh = MarianMTModel(config).to(torch.float32).eval()
    prefix = f"model.{stack}.layers."
    state = {k: v for k, v in original.items() if not k.startswith(prefix)}
    for new, group in enumerate(groups):
        members = [
            {k[len(f"{prefix}{old}.") :]: v for k, v in original.items() if k.startswith(f"{prefix}{old}.")}
            for old in group
        ]
        merged = dict(members[0])
        for name in merged:
            if len(members) > 1 and name.split(".")[0] in ("self_attn", "encoder_attn", "fc1", "fc2"):
                if rule == "differences":
                    merged[name] = members[0][name] + sum(m[name] - members[0][name] for m in members[1:])
                else:
                    merged[name] = members[-1][name]
        state.update({f"{prefix}{new}.{k}": v for k, v in merged.items()})
    fresh.load_state_dict(state)
    return fresh


def naive_decoder_inputs(ids: torch.Tensor, mask: torch.Tensor):
    """Loop version of the documented teacher forcing: start token, then the text from its second token."""
    decoder_ids, decoder_mask = ids.clone(), mask.clone()
    for row in range(ids.shape[0]):
        decoder_ids[row, 0], decoder_mask[row, 0] = START, 1
        for t in range(1, ids.shape[1]):
            if mask[row, t] == 0:
                decoder_ids[row, t] = PAD
    return decoder_ids, decoder_mask


def _padded_batch() -> CalibrationBatch:
    ids = sample_ids(3, 12, seed=3)
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    mask[2, 5:] = 0
    ids[mask == 0] = PAD
    return CalibrationBatch(input_ids=ids, attention_mask=mask)


@torch.no_grad()
def model_hidden_states(model, stack: str, batch: CalibrationBatch):
    """The states entering each layer of `stack` (and leaving the last), from the model's own output_hidden_states."""
    if stack == "encoder":
        out = model.model.encoder(
            input_ids=batch.input_ids, attention_mask=batch.attention_mask, output_hidden_states=True
        )
        return out.hidden_states, batch.attention_mask
    decoder_ids, decoder_mask = naive_decoder_inputs(batch.input_ids, batch.attention_mask)
    out = model.model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        decoder_input_ids=decoder_ids,
        decoder_attention_mask=decoder_mask,
        output_hidden_states=True,
        use_cache=False,
    )
    return out.decoder_hidden_states, decoder_mask


def _config(method: str, stack: str | None, **method_args) -> FlattenConfig:
    return tiny_config(method, num_layers_to_remove=2, stacks=None if stack is None else [stack], **method_args)


def _check_plain_reload(model, out) -> None:
    """`out` holds `model` as a plain Marian checkpoint: plain from_pretrained gives equal logits and generation."""
    saved = (out / "config.json").read_text()
    assert '"model_type": "marian"' in saved and "quantization_config" not in saved
    reloaded = MarianMTModel.from_pretrained(out, dtype=torch.float32).eval()
    for stack in STACKS:
        key = LAYER_KEYS[stack]
        assert getattr(reloaded.config, key) == len(getattr(reloaded.model, stack).layers) == getattr(model.config, key)
    assert_close(mt_logits(reloaded), mt_logits(model))
    source = _source_target()[0]
    assert torch.equal(greedy_both_ways(reloaded, source)[0].sequences, greedy_both_ways(model, source)[0].sequences)
    assert_cache_consistent(reloaded)


# ------------------------------------------------------------------------------------ shared conformance
class MarianStackConformance(AdapterConformance):
    """The shared checks on one of Marian's stacks (`stack` set by the two subclasses below)."""

    factory = "marian"
    norm_position = "post"
    concat_supported = False
    concat_refusal = "post-LN"

    @property
    def layer_count_key(self) -> str:
        return LAYER_KEYS[self.stack]

    @property
    def kept_layers(self) -> tuple[int, ...]:
        return {"encoder": (0, 2, 4), "decoder": (1, 3)}[self.stack]

    def sample_inputs(self):
        return _source_target()

    def outputs(self, model, inputs) -> torch.Tensor:
        return mt_logits(model, *inputs)

    def assert_generation_consistent(self, model, inputs) -> None:
        assert_cache_consistent(model)

    def expected_stacks(self) -> list[str]:
        return STACKS

    def expected_num_heads(self, config) -> int:
        return getattr(config, f"{self.stack}_attention_heads")

    def expected_num_kv_heads(self, config) -> int:
        return self.expected_num_heads(config)

    def expected_intermediate_size(self, config) -> int:
        return getattr(config, f"{self.stack}_ffn_dim")

    def shallower_reference(self, model, kept):
        return fresh_marian_from_groups(model, self.stack, [(i,) for i in kept])

    def test_keep_layers_and_reindex_match_a_fresh_shallower_model(self, model):
        super().test_keep_layers_and_reindex_match_a_fresh_shallower_model(model)
        other = "decoder" if self.stack == "encoder" else "encoder"
        assert getattr(model.config, LAYER_KEYS[other]) == SHAPES[other][0]  # the other stack's count is untouched
        for attn in ("self_attn", "encoder_attn"):
            indices = [getattr(layer, attn).layer_idx for layer in model.model.decoder.layers]
            assert indices == list(range(model.config.decoder_layers))

    def test_gqa_head_pruning_keeps_queries_with_their_kv_heads(self, model):
        super().test_gqa_head_pruning_keeps_queries_with_their_kv_heads(model)
        with pytest.raises(ValueError, match="1 heads"):
            get_adapter(model).validate()  # the config cannot describe per-layer head counts


class TestMarianEncoderConformance(MarianStackConformance):
    stack = "encoder"


class TestMarianDecoderConformance(MarianStackConformance):
    stack = "decoder"

    def test_cross_attention_head_pruning_equals_zeroed_output_columns(self, model):
        self.check_head_pruning(model, cross=True)
        with pytest.raises(ValueError, match="1 heads"):
            get_adapter(model).validate()


# ------------------------------------------------------------------------------------------------- views
def test_views_bind_both_stacks(model):
    adapter = get_adapter(model)
    assert isinstance(adapter, MarianAdapter) and adapter.stacks() == STACKS
    assert adapter.embeddings() is model.model.encoder.embed_tokens  # its weight is the tied model.shared
    assert adapter.embeddings().weight is model.model.shared.weight
    # num_hidden_layers is MarianConfig's alias of encoder_layers.
    assert model.config.num_hidden_layers == model.config.encoder_layers == 5
    for stack in STACKS:
        num_layers, heads, head_dim, _ = SHAPES[stack]
        layers = getattr(model.model, stack).layers
        assert adapter.num_layers(stack) == num_layers and adapter.layers(stack) is layers
        assert adapter.position_embeddings(stack) is getattr(model.model, stack).embed_positions
        for block, layer in zip(adapter.blocks(stack), layers, strict=True):
            assert block.attn_norm.module is layer.self_attn_layer_norm and block.attn_norm.kind == "layer"
            assert block.mlp_norm.module is layer.final_layer_norm
            attentions = [(block.attention, layer.self_attn)]
            if stack == "decoder":
                attentions.append((block.cross_attention, layer.encoder_attn))
                assert adapter.cross_attn_norm(block).module is layer.encoder_attn_layer_norm
            else:
                assert block.cross_attention is None and adapter.cross_attn_norm(block) is None
            for view, module in attentions:
                g = view.geometry
                assert (g.num_heads, g.num_kv_heads, g.head_dim, g.hidden_size) == (heads, heads, head_dim, HIDDEN)
                assert view.module is module and view.position_scheme == "sinusoidal"
                for name, attr in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"), ("o", "out_proj")):
                    assert getattr(view, name).module is getattr(module, attr)
            assert block.mlp.gate is None and block.mlp.activation is layer.activation_fn
            assert block.mlp.up.module is layer.fc1 and block.mlp.down.module is layer.fc2


def test_model_level_views(model):
    adapter = get_adapter(model)
    hidden = torch.randn(2, 3, HIDDEN)
    for stack in STACKS:
        assert torch.equal(adapter.final_norm(stack)(hidden), hidden)  # Marian's stacks end without a norm
    assert torch.equal(adapter.final_norm()(hidden), hidden)
    head = adapter.lm_head()
    assert isinstance(head, MarianLogitsHead) and head.linear is model.lm_head
    assert torch.equal(head(hidden), model.lm_head(hidden) + model.final_logits_bias)
    assert adapter.lm_head("encoder") is None
    with pytest.raises(ValueError, match="has stacks"):
        adapter.layers("cross")


def test_view_round_trip_is_the_identity(model):
    adapter = get_adapter(model)
    before_state, before = _state(model), mt_logits(model)
    for stack in STACKS:
        for block in adapter.blocks(stack):
            attentions = [block.attention] + ([block.cross_attention] if block.cross_attention else [])
            views = [v for a in attentions for v in (a.q, a.k, a.v, a.o)] + [block.mlp.up, block.mlp.down]
            for view in views:
                view.set_(view.weight.clone(), view.bias.clone())
    _assert_state_equal(model, before_state)
    assert torch.equal(mt_logits(model), before)


def test_refuses_models_it_does_not_bind():
    config = tiny_models.tiny_marian().config
    with pytest.raises(UnsupportedArchitectureError, match=r"MarianForCausalLM.*no encoder"):
        get_adapter(MarianForCausalLM(copy.deepcopy(config)))
    pre_ln = MarianConfig(**{**config.to_dict(), "normalize_before": True})
    with pytest.raises(UnsupportedArchitectureError, match="normalize_before=True"):
        get_adapter(MarianMTModel(pre_ln))


# ---------------------------------------------------------------------------------------- cross-attention
def test_cross_attention_pruning_in_the_encoder_is_refused(model):
    adapter = get_adapter(model)
    with pytest.raises(ValueError, match="no cross-attention"):
        adapter.keep_heads_(adapter.block("encoder", 0), [0], cross=True)


# ---------------------------------------------------------------------------------- dropping and reindexing
def test_validate_requires_reindexed_decoder(model):
    """The config's layer counts are checked per stack by the conformance base; the decoder's cache slots here."""
    adapter = get_adapter(model)
    adapter.keep_layers_("decoder", [0, 2, 3])
    adapter.update_config_("decoder", [0, 2, 3])
    with pytest.raises(ValueError, match="decoder layer 1 self_attn has layer_idx 2"):
        adapter.validate()
    adapter.reindex_("decoder")
    adapter.validate()


def test_cache_check_catches_a_wrong_decoder_index(model):
    from optimum_flatten.adapters.marian import check_cached_seq2seq_forward

    check_cached_seq2seq_forward(model)
    # Two layers sharing one cache slot: each reads the other's keys on the cached steps.
    model.model.decoder.layers[2].self_attn.layer_idx = 1
    model.model.decoder.layers[2].encoder_attn.layer_idx = 1
    with pytest.raises(ValueError, match=r"cached (and uncached )?decoding (disagree|failed)"):
        check_cached_seq2seq_forward(model)


# ---------------------------------------------------------------------------------------------- merges
def test_mergeable_state_covers_attention_and_mlp_only(model):
    adapter = get_adapter(model)
    linear = ("weight", "bias")
    projections = ("q_proj", "k_proj", "v_proj", "out_proj")
    mlp = {f"{m}.{p}" for m in ("fc1", "fc2") for p in linear}
    self_attn = {f"self_attn.{m}.{p}" for m in projections for p in linear}
    cross = {f"encoder_attn.{m}.{p}" for m in projections for p in linear}
    assert set(adapter.mergeable_state(model.model.encoder.layers[1])) == self_attn | mlp
    assert set(adapter.mergeable_state(model.model.decoder.layers[1])) == self_attn | cross | mlp


@pytest.mark.parametrize("rule", ["differences", "reference_code"])
@pytest.mark.parametrize(("stack", "groups"), [("encoder", [(0,), (1, 2, 3), (4,)]), ("decoder", [(0,), (1, 2), (3,)])])
def test_parameter_merge_equals_naive_merge_in_a_fresh_model(model, stack, groups, rule):
    reference = fresh_marian_from_groups(model, stack, groups, rule)
    adapter = get_adapter(model)
    layers = adapter.layers(stack)
    merged_group = groups[1]
    state = MERGE_RULES[rule]([adapter.mergeable_state(layers[i]) for i in merged_group])
    adapter.replace_block_(stack, 1, adapter.build_merged_block(stack, 1, state))
    first_indices = [g[0] for g in groups]
    adapter.keep_layers_(stack, first_indices)
    adapter.reindex_(stack)
    adapter.update_config_(stack, first_indices)
    adapter.validate()
    assert_close(mt_logits(model), mt_logits(reference))


# ------------------------------------------------------------------------------------------- calibration
def test_teacher_forcing_inputs_match_the_loop_reference():
    batch = _padded_batch()
    got = teacher_forcing_inputs(batch.input_ids, batch.attention_mask, START, PAD)
    expected = naive_decoder_inputs(batch.input_ids, batch.attention_mask)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    with pytest.raises(ValueError, match="decoder_start_token_id"):
        teacher_forcing_inputs(batch.input_ids, batch.attention_mask, None, PAD)


@pytest.mark.parametrize("stack", STACKS)
def test_recorded_states_equal_the_models_own_hidden_states(model, stack):
    batch = _padded_batch()
    adapter = get_adapter(model)
    calls = {"encoder": 0, "decoder": 0}
    hooks = [
        getattr(model.model, name).register_forward_pre_hook(
            lambda *_, name=name: calls.__setitem__(name, 1 + calls[name])
        )
        for name in STACKS
    ]
    last_encoder_layer = []
    hooks.append(model.model.encoder.layers[-1].register_forward_hook(lambda *_: last_encoder_layer.append(1)))
    try:
        runner = LayerwiseRunner(adapter, [batch], stack)
    finally:
        for hook in hooks:
            hook.remove()
    # The encoder stack's forward never reaches the decoder; the decoder stack's runs the whole encoder first.
    assert calls == ({"encoder": 1, "decoder": 0} if stack == "encoder" else {"encoder": 1, "decoder": 1})
    assert last_encoder_layer == ([] if stack == "encoder" else [1])
    expected, mask = model_hidden_states(model, stack, batch)
    assert torch.equal(runner.masks[0], mask)
    current = runner.inputs
    for i, layer in enumerate(adapter.layers(stack)):
        assert_close(current[0], expected[i])
        current = runner.run(layer, i, current)
    assert_close(current[0], expected[-1])
    if stack == "decoder":
        recorded = runner.layer_kwargs[1][0]
        assert recorded["encoder_hidden_states"].shape == (3, 12, HIDDEN)  # named through the layer's signature


def test_decoder_teacher_forcing_nll_is_the_models_translation_loss(model):
    """SLEB's next-token NLL over input_ids, on decoder states, is MarianMTModel's own loss for the target
    ``input_ids[:, 1:]`` (transformers' labels path shifts it right behind the start token itself)."""
    ids = sample_ids(2, 12, seed=5)
    batch = CalibrationBatch(input_ids=ids, attention_mask=torch.ones_like(ids))
    runner = LayerwiseRunner(get_adapter(model), [batch], "decoder")
    current = runner.inputs
    for i, layer in enumerate(get_adapter(model).layers("decoder")):
        current = runner.run(layer, i, current)
    with torch.no_grad():
        expected = model(input_ids=ids, labels=ids[:, 1:].contiguous()).loss
    assert calibration_nll(get_adapter(model), current, [batch]) == pytest.approx(float(expected), rel=1e-5)


# ------------------------------------------------------------------------------------ methods end to end
@torch.no_grad()
def naive_block_influence(model, stack: str) -> torch.Tensor:
    """BI_i = 1 - mean over real tokens of cos(h_i, h_{i+1}), from output_hidden_states on the calibration batches."""
    batches = build_calibration_batches(tiny_models.CharTokenizer(), _config("shortgpt", stack).calibration)
    num_layers = getattr(model.config, LAYER_KEYS[stack])
    sums, count = torch.zeros(num_layers, dtype=torch.float64), 0.0
    for batch in batches:
        states, mask = model_hidden_states(model, stack, batch)
        real = mask.bool()
        count += float(real.sum())
        for i in range(num_layers):
            cos = torch.nn.functional.cosine_similarity(states[i].double(), states[i + 1].double(), dim=-1)
            sums[i] += cos[real].sum()
    return 1.0 - sums / count


@pytest.mark.parametrize("stack", STACKS)
def test_shortgpt_drops_the_layers_a_naive_block_influence_picks(tmp_path, model, stack):
    scores = naive_block_influence(model, stack)
    original = copy.deepcopy(model)
    quantizer = compress(model, _config("shortgpt", stack))
    assert quantizer.report["block_influence"] == pytest.approx(scores.tolist(), abs=1e-5)
    kept = sorted(torch.topk(scores, len(scores) - 2).indices.tolist())
    assert quantizer.plan.first_indices == kept
    assert_close(mt_logits(model), mt_logits(fresh_marian_from_groups(original, stack, [(i,) for i in kept])))
    _check_plain_reload(model, quantizer.save(model, tmp_path / "compressed"))


@pytest.mark.parametrize(
    ("stack", "method", "method_args"),
    [
        ("encoder", "laco", {"threshold": None, "window_size": 3}),
        ("decoder", "laco", {"threshold": None, "window_size": 3}),
        ("encoder", "sliding_window", {"threshold": None}),
        ("decoder", "sliding_window", {"threshold": None}),
        ("decoder", "sleb", {}),
    ],
)
def test_method_compresses_one_stack_and_reloads_as_plain_marian(tmp_path, model, stack, method, method_args):
    original = copy.deepcopy(model)
    before = mt_logits(model)
    other = "decoder" if stack == "encoder" else "encoder"
    other_layers = list(getattr(model.model, other).layers)
    quantizer = compress(model, _config(method, stack, **method_args))
    assert quantizer.plan.stack == stack
    assert getattr(model.config, LAYER_KEYS[stack]) == len(getattr(model.model, stack).layers) == SHAPES[stack][0] - 2
    assert list(getattr(model.model, other).layers) == other_layers  # the other stack keeps its very modules
    assert not torch.allclose(mt_logits(model), before, atol=1e-3)  # the plan really changed the model
    groups = [tuple(g) for g in quantizer.plan.group_lists()]
    assert_close(mt_logits(model), mt_logits(fresh_marian_from_groups(original, stack, groups)))
    assert_cache_consistent(model)
    _check_plain_reload(model, quantizer.save(model, tmp_path / "compressed"))


# ------------------------------------------------------------------------------------------------ refusals
@pytest.mark.parametrize(
    ("method", "stack", "match"),
    [
        ("sleb", "encoder", r"'sleb' scores layer removals.*'encoder' stack.*lm_head\(\) is None"),
        ("flattengpt", "decoder", r"'flattengpt' needs \['concat_heads', 'pre_norm'\].*post-LN.*laco.*shortgpt.*sleb"),
        ("shortgpt", None, r"one stack at a time, got stacks=\['encoder', 'decoder'\]"),
        ("shortgpt", "cross", r"stacks \['cross'\] do not exist"),
    ],
)
def test_refusals_come_before_any_change(model, method, stack, match):
    state, config = _state(model), model.config.to_dict()
    with pytest.raises(ValueError, match=match):
        compress(model, _config(method, stack))
    _assert_state_equal(model, state)
    assert model.config.to_dict() == config


def test_capabilities_are_honest(model):
    """Concatenation itself is refused (with the reason) by the conformance base; here what the refusal offers."""
    adapter = get_adapter(model)
    assert "pre_norm" not in adapter.capabilities and "concat_heads" not in adapter.capabilities
    from optimum_flatten.registry import methods_for

    assert {"laco", "shortgpt", "sleb", "sliding_window"} <= set(methods_for(adapter.capabilities))
    assert "flattengpt" not in methods_for(adapter.capabilities)
    with pytest.raises(UnsupportedArchitectureError, match=r"Methods that run on this MarianMTModel: \[.*'shortgpt'"):
        compress(model, _config("flattengpt", "decoder"))
    # The alternatives are those whose own preflight passes on the stack: SLEB scores with an LM head, which reads
    # the decoder only; ReplaceMe folds into pre-norm blocks (it used to be offered, then refused, offering SLEB).
    from optimum_flatten.registry import runnable_methods

    assert "sleb" in runnable_methods(adapter, "decoder") and "sleb" not in runnable_methods(adapter, "encoder")
    assert not {"replaceme", "greedy_replace", "flattengpt"} & set(runnable_methods(adapter, "decoder"))
