"""FFN merging: invariants on logits, tying, window choice against a naive re-computation, save/reload, errors."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from scipy.optimize import linear_sum_assignment
from transformers import AutoModelForCausalLM

import tiny_models
from common import assert_close, compress, logits, sample_ids
from optimum_flatten import FlattenConfig, get_adapter
from optimum_flatten.calibration import CalibrationBatch
from optimum_flatten.compression.method import MethodContext
from optimum_flatten.methods.ffn_merge import FfnMergeConfig, FfnMergeMethod, read_mlp, retie_ffn_, write_mlp_
from optimum_flatten.ops.ffn_alignment import permute_mlp_units
from optimum_flatten.utils.errors import InvalidTargetError
from optimum_flatten.utils.torch_utils import count_parameters

FACTORIES = ["llama_gqa", "qwen2"]
NAMES = ("gate_proj", "up_proj", "down_proj")


def _batches(seed: int = 3) -> list[CalibrationBatch]:
    ids = sample_ids(batch=2, length=16, seed=seed)
    mask = torch.ones_like(ids)
    mask[1, -4:] = 0  # a right-padded row: padding must stay out of every statistic
    return [CalibrationBatch(ids, mask)]


def _state(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _assert_unchanged(model, before: dict[str, torch.Tensor]) -> None:
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], before[k]) for k in before)


def _mlp_numel(model, layer: int) -> int:
    return sum(p.numel() for p in model.model.layers[layer].mlp.parameters())


def _random_perm(n: int, seed: int) -> torch.Tensor:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------------ invariants
@pytest.mark.parametrize("factory", FACTORIES)
def test_aligning_a_layer_is_function_preserving(factory):
    """Every permutation the method finds (and a random one) leaves the model's logits unchanged."""
    model = tiny_models.FACTORIES[factory]()
    adapter = get_adapter(model)
    ids = sample_ids()
    reference = logits(model, ids)
    method = FfnMergeMethod(FfnMergeConfig(window_size=3, window_starts=[1], anchor="middle"))
    context = MethodContext(batches=_batches(), progress=False)
    method.plan(adapter, context, 0)
    for member in (1, 3):
        perm = method._scorer.permutation(2, member)
        assert sorted(perm.tolist()) == list(range(48))
        view = adapter.block("decoder", member).mlp
        write_mlp_(view, permute_mlp_units(read_mlp(view), perm))
        assert_close(logits(model, ids), reference)
    view = adapter.block("decoder", 4).mlp
    write_mlp_(view, permute_mlp_units(read_mlp(view), _random_perm(48, 0)))
    assert_close(logits(model, ids), reference)


def _make_permuted_copies(model, source: int, targets: list[int], seeds: list[int]) -> list[torch.Tensor]:
    """Sets each target layer's MLP to the source's with its units shuffled; returns the shuffles."""
    adapter = get_adapter(model)
    source_weights = read_mlp(adapter.block("decoder", source).mlp)
    perms = []
    for target, seed in zip(targets, seeds, strict=True):
        perm = _random_perm(source_weights.num_units, seed)
        write_mlp_(adapter.block("decoder", target).mlp, permute_mlp_units(source_weights, perm))
        perms.append(perm)
    return perms


@pytest.mark.parametrize("factory", FACTORIES)
@pytest.mark.parametrize("anchor", ["first", "middle", "last"])
def test_merging_shuffled_copies_of_one_mlp_recovers_it(factory, anchor):
    """Layers 2 and 3 hold layer 1's MLP with shuffled units: the alignment finds the shuffles exactly, and the
    merged (tied) model computes the same function, in the anchor's own unit order.

    The copies read different inputs (each layer's own residual stream), so exact recovery here also relies on
    adjacent residual streams being alike; the exact-input case is proven in tests/ops/test_ffn_alignment.py."""
    model = tiny_models.FACTORIES[factory]()
    perms = _make_permuted_copies(model, 1, [2, 3], [1, 2])
    window = [1, 2, 3]
    anchor_index = {"first": 1, "middle": 2, "last": 3}[anchor]
    anchor_weights = {n: getattr(model.model.layers[anchor_index].mlp, n).weight.clone() for n in NAMES}
    ids = sample_ids()
    reference = logits(model, ids)
    method = FfnMergeMethod(FfnMergeConfig(window_size=3, window_starts=[1], anchor=anchor))
    method.plan(get_adapter(model), MethodContext(batches=_batches(), progress=False), 0)
    shuffles = {1: torch.arange(48), 2: perms[0], 3: perms[1]}  # layer l's unit j is layer 1's unit shuffles[l][j]
    for member in window:
        if member != anchor_index:
            # Assignment is correct: member's units are put back in the anchor's order.
            found = method._scorer.permutation(anchor_index, member)
            assert torch.equal(shuffles[member][found], shuffles[anchor_index])
    quantizer = compress(model, "ffn_merge", window_size=3, window_starts=[1], anchor=anchor)
    assert quantizer.report["ffn_groups"] == [
        {"stack": "decoder", "layers": window, "anchor": anchor_index, "variant": "permute", "tied": True}
    ]
    assert_close(logits(model, ids), reference)
    for name in NAMES:
        # Every member is now exactly the anchor's MLP (the aligned copies average to it).
        assert_close(getattr(model.model.layers[1].mlp, name).weight, anchor_weights[name])


def test_hidden_signal_correlation_matches_naive():
    """alignment_signal="hidden" correlates down's input, silu(gate x) * up x, computed here from hooked MLP inputs."""
    model = tiny_models.tiny_llama_gqa()
    batches = _batches()
    method = FfnMergeMethod(FfnMergeConfig(window_size=2, window_starts=[3], alignment_signal="hidden"))
    method.plan(get_adapter(model), MethodContext(batches=batches, progress=False), 0)
    inputs = {}
    handles = [
        model.model.layers[i].mlp.down_proj.register_forward_pre_hook(lambda _m, a, i=i: inputs.setdefault(i, a[0]))
        for i in (3, 4)
    ]
    with torch.no_grad():
        model(input_ids=batches[0].input_ids, attention_mask=batches[0].attention_mask)
    for handle in handles:
        handle.remove()
    valid = batches[0].attention_mask.reshape(-1).bool()
    hidden = [inputs[i].reshape(-1, 48)[valid].double() for i in (3, 4)]
    naive = torch.corrcoef(torch.cat(hidden, dim=1).T)[:48, 48:]
    assert_close(method._scorer.correlation(3, 4), naive, dtype=torch.float32)
    _, cols = linear_sum_assignment(naive.numpy(), maximize=True)
    assert method._scorer.permutation(3, 4).tolist() == cols.tolist()


@pytest.mark.parametrize("factory", FACTORIES)
def test_vanilla_average_of_identical_layers_is_identity(factory):
    model = tiny_models.FACTORIES[factory]()
    adapter = get_adapter(model)
    same = read_mlp(adapter.block("decoder", 2).mlp)
    for target in (3, 4):
        write_mlp_(adapter.block("decoder", target).mlp, same)
    ids = sample_ids()
    reference = logits(model, ids)
    compress(model, "ffn_merge", window_size=3, window_starts=[2], variant="vanilla")
    assert_close(logits(model, ids), reference)


@pytest.mark.parametrize("factory", FACTORIES)
def test_tied_tensors_share_storage_and_parameter_count_drops(factory):
    model = tiny_models.FACTORIES[factory]()
    original = copy.deepcopy(model)
    ids = sample_ids()
    k = 3
    quantizer = compress(model, "ffn_merge", window_size=k, num_windows=1)
    (group,) = quantizer.report["ffn_groups"]
    layers = group["layers"]
    assert len(layers) == k and layers == list(range(layers[0], layers[0] + k))
    for name in NAMES:
        params = [getattr(model.model.layers[i].mlp, name).weight for i in layers]
        assert all(p is params[0] for p in params)
        assert len({p.data_ptr() for p in params}) == 1
    others = [i for i in range(6) if i not in layers]
    assert len({model.model.layers[i].mlp.up_proj.weight.data_ptr() for i in others}) == len(others)
    saved = (k - 1) * _mlp_numel(original, 0)
    assert count_parameters(original) - count_parameters(model) == saved
    assert quantizer.report["ffn_parameters_shared"] == saved
    assert quantizer.report["parameters_before"] - quantizer.report["parameters_after"] == saved
    assert model.config.num_hidden_layers == 6
    # Non-identity: a real merge of different layers changes the outputs.
    assert not torch.allclose(logits(model, ids), logits(original, ids), atol=1e-3)


def test_untied_variant_has_equal_values_in_separate_storage():
    tied, untied = tiny_models.tiny_llama_gqa(), tiny_models.tiny_llama_gqa()
    before = count_parameters(untied)
    compress(tied, "ffn_merge", window_size=2, window_starts=[3])
    compress(untied, "ffn_merge", window_size=2, window_starts=[3], tie=False)
    a, b = untied.model.layers[3].mlp, untied.model.layers[4].mlp
    for name in NAMES:
        assert torch.equal(getattr(a, name).weight, getattr(b, name).weight)
        assert getattr(a, name).weight.data_ptr() != getattr(b, name).weight.data_ptr()
    assert count_parameters(untied) == before
    ids = sample_ids()
    assert_close(logits(untied, ids), logits(tied, ids))


# --------------------------------------------------------------------------------- window choice, naive
def _naive_merged_model(model, batches, window, anchor):
    """Aligns and averages the window's MLPs by hand: hooks on the MLPs, torch.corrcoef, scipy, index shuffles."""
    inputs = {}
    handles = [
        model.model.layers[i].mlp.register_forward_pre_hook(lambda _m, a, i=i: inputs.setdefault(i, []).append(a[0]))
        for i in window
    ]
    with torch.no_grad():
        for batch in batches:
            model(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
    for handle in handles:
        handle.remove()
    valid = torch.cat([b.attention_mask.reshape(-1) for b in batches]).bool()

    def pre(i, name):
        x = torch.cat([t.reshape(-1, t.shape[-1]) for t in inputs[i]])[valid].double()
        return x @ getattr(model.model.layers[i].mlp, name).weight.detach().double().T

    units = model.config.intermediate_size
    aligned = []
    for i in window:
        weights = {n: getattr(model.model.layers[i].mlp, n).weight.detach() for n in NAMES}
        if i != anchor:
            corr = sum(
                torch.corrcoef(torch.cat([pre(anchor, n), pre(i, n)], dim=1).T)[:units, units:]
                for n in ("gate_proj", "up_proj")
            )
            _, cols = linear_sum_assignment(corr.numpy() / 2, maximize=True)
            perm = torch.as_tensor(cols)
            weights = {
                "gate_proj": weights["gate_proj"][perm],
                "up_proj": weights["up_proj"][perm],
                "down_proj": weights["down_proj"][:, perm],
            }
        aligned.append(weights)
    merged = copy.deepcopy(model)
    with torch.no_grad():
        for i in window:
            for n in NAMES:
                getattr(merged.model.layers[i].mlp, n).weight.copy_(sum(a[n] for a in aligned) / len(aligned))
    return merged


def _naive_score(model, reference_model, batches, selection):
    total, count = 0.0, 0
    with torch.no_grad():
        for batch in batches:
            mask = batch.attention_mask.bool()
            if selection == "cosine":
                a = model.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state
                b = reference_model.model(
                    input_ids=batch.input_ids, attention_mask=batch.attention_mask
                ).last_hidden_state
                cos = torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=-1)
                total += float(cos[mask].sum())
                count += int(mask.sum())
            else:
                out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.double()
                for row in range(out.shape[0]):
                    for t in range(out.shape[1] - 1):
                        if mask[row, t] and mask[row, t + 1]:
                            total += float(torch.nn.functional.cross_entropy(out[row, t], batch.input_ids[row, t + 1]))
                            count += 1
    return total / count


@pytest.mark.parametrize("selection", ["cosine", "nll"])
def test_chosen_window_and_scores_match_a_naive_recomputation(selection):
    model = tiny_models.tiny_llama_gqa()
    batches = _batches(seed=5)
    method = FfnMergeMethod(FfnMergeConfig(window_size=2, num_windows=1, selection=selection))
    context = MethodContext(batches=batches, progress=False)
    plan = method.plan(get_adapter(model), context, 0)
    assert plan.group_lists() == [[i] for i in range(6)]
    (scores,) = context.report["ffn_window_scores"]
    naive = {}
    for start in range(5):
        window = [start, start + 1]
        naive[start] = _naive_score(_naive_merged_model(model, batches, window, start), model, batches, selection)
    for entry in scores:
        assert entry["score"] == pytest.approx(naive[entry["start"]], abs=1e-5)
    pick = max if selection == "cosine" else min
    best = pick(naive, key=naive.get)
    assert context.report["ffn_groups"][0]["layers"] == [best, best + 1]
    assert context.report["ffn_final_score"] == pytest.approx(naive[best], abs=1e-5)


def test_second_window_is_scored_with_the_first_merged_and_never_overlaps():
    model = tiny_models.tiny_llama_gqa()
    quantizer = compress(model, "ffn_merge", window_size=2, num_windows=3)
    windows = [g["layers"] for g in quantizer.report["ffn_groups"]]
    assert sorted(i for w in windows for i in w) == list(range(6))
    rounds = quantizer.report["ffn_window_scores"]
    # Round 1 only offers windows that leave room for two more: starts 0, 2, 4.
    assert [len(r) for r in rounds] == [3, 2, 1]
    assert count_parameters(model) == quantizer.report["parameters_before"] - 3 * _mlp_numel(model, 0)


# --------------------------------------------------------------------------------------- save and reload
@pytest.mark.parametrize("factory", FACTORIES)
def test_save_reload_plain_then_retie(factory, tmp_path):
    model = tiny_models.FACTORIES[factory]()
    quantizer = compress(model, "ffn_merge", window_size=2, num_windows=2)
    ids = sample_ids()
    expected = logits(model, ids)
    path = quantizer.save(model, tmp_path / "out")
    # The in-memory model keeps its sharing after saving.
    assert model.model.layers[quantizer.report["ffn_groups"][0]["layers"][1]].mlp.up_proj.weight is (
        model.model.layers[quantizer.report["ffn_groups"][0]["layers"][0]].mlp.up_proj.weight
    )
    reloaded = AutoModelForCausalLM.from_pretrained(path).eval()
    assert_close(logits(reloaded, ids), expected)
    assert count_parameters(reloaded) == quantizer.report["parameters_before"]  # reloaded untied
    report = json.loads((path / "flatten_report.json").read_text())
    card = (path / "README.md").read_text()
    assert "share their feed-forward parameters" in card and "instead of" not in card
    freed = retie_ffn_(reloaded, report)
    assert freed == quantizer.report["ffn_parameters_shared"]
    assert count_parameters(reloaded) == quantizer.report["parameters_after"]
    for group in report["ffn_groups"]:
        ptrs = {reloaded.model.layers[i].mlp.down_proj.weight.data_ptr() for i in group["layers"]}
        assert len(ptrs) == 1
    assert_close(logits(reloaded, ids), expected)
    # A re-tied model saves as an ordinary checkpoint again (plain save_pretrained).
    reloaded.save_pretrained(tmp_path / "again")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "again").eval()
    assert_close(logits(again, ids), expected)


# ------------------------------------------------------------------------------------------- bad inputs
def test_window_larger_than_the_stack_raises_before_any_change():
    model = tiny_models.tiny_llama_gqa()
    before = _state(model)
    with pytest.raises(ValueError, match="larger than the stack of 6"):
        compress(model, "ffn_merge", window_size=7)
    with pytest.raises(ValueError, match="need 8 layers"):
        compress(model, "ffn_merge", window_size=4, num_windows=2)
    with pytest.raises(ValueError, match="run past the last layer"):
        compress(model, "ffn_merge", window_size=3, window_starts=[4])
    _assert_unchanged(model, before)
    assert count_parameters(model) == sum(t.numel() for t in before.values())


def test_bad_options_raise_at_configuration():
    with pytest.raises(ValueError, match="overlap"):
        FlattenConfig(method="ffn_merge", window_size=2, window_starts=[0, 1])
    with pytest.raises(ValueError, match="at least 2"):
        FlattenConfig(method="ffn_merge", window_size=1)
    with pytest.raises(ValueError, match="disagrees"):
        FlattenConfig(method="ffn_merge", window_starts=[0, 3], num_windows=1)
    with pytest.raises(ValueError, match="anchor must be one of"):
        FlattenConfig(method="ffn_merge", anchor="centre")
    with pytest.raises(InvalidTargetError, match="keeps every layer"):
        FlattenConfig(method="ffn_merge", num_layers_to_remove=2)
    with pytest.raises(TypeError, match="Did you mean 'window_size'"):
        FlattenConfig(method="ffn_merge", window_sizes=2)
    config = FlattenConfig(method="ffn_merge", window_size=3, window_starts=[3, 0])
    assert config.method_args["window_starts"] == [0, 3]
    assert FfnMergeConfig(window_size=3, window_starts="3,0").window_starts == [0, 3]  # the CLI's form
    with pytest.raises(ValueError, match="comma-separated"):
        FfnMergeConfig(window_starts="1;4")
    assert FlattenConfig.from_dict(config.to_dict()) == config


def test_tying_layers_of_different_shapes_raises_before_any_change():
    model = tiny_models.tiny_llama_gqa()
    adapter = get_adapter(model)
    adapter.keep_mlp_channels_(adapter.block("decoder", 2), range(40))  # layer 2 now has 40 units, the rest 48
    before = _state(model)
    with pytest.raises(ValueError, match=r"cannot merge and tie the feed-forward sublayers of layers \[1, 2\]"):
        compress(model, "ffn_merge", window_size=2, window_starts=[1])
    _assert_unchanged(model, before)
    # A search simply leaves such windows out of the candidates.
    method = FfnMergeMethod(FfnMergeConfig(window_size=2))
    assert [w[0] for w in method.candidate_windows(adapter, "decoder", [])] == [0, 3, 4]


def test_retie_refuses_layers_that_are_not_one_merged_group():
    model = tiny_models.tiny_llama_gqa()
    before = _state(model)
    with pytest.raises(ValueError, match="not identical"):
        retie_ffn_(model, [[0, 1]])
    with pytest.raises(ValueError, match="out of range"):
        retie_ffn_(model, {"ffn_groups": [{"stack": "decoder", "layers": [5, 6]}]})
    with pytest.raises(TypeError, match="ffn_groups"):
        retie_ffn_(model, {"plan": {}})
    _assert_unchanged(model, before)
    assert count_parameters(model) == sum(t.numel() for t in before.values())
