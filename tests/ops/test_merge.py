import torch

from common import UNIT_ROUNDOFF, assert_within
from optimum_flatten.ops import merge_as_reference_code, merge_by_differences


def _states(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"a": torch.randn(3, 4, generator=g), "b": torch.randn(4, generator=g)} for _ in range(n)]


def test_differences_match_naive_sum():
    """θ_0 + (θ_1 − θ_0) + (θ_2 − θ_0) in float32 against float64, within the rounding of its four float32 steps.

    Each step (two differences, two additions) is exact up to u32 times its result, so the float32 merge is within
    u32 (|θ_1 − θ_0| + |θ_1| + |θ_2 − θ_0| + |θ_1 + θ_2 − θ_0|) of the exact value, plus 1% for second-order terms.
    The float64 reference of float32 inputs is exact here (differences and sums of numbers of a few units with
    24-bit mantissas fit in 53 bits).
    """
    states = _states(3)
    merged = merge_by_differences(states)
    u32 = UNIT_ROUNDOFF[torch.float32]
    for name in ("a", "b"):
        a, b1, b2 = (s[name].double() for s in states)
        expected = a.clone()
        for k in (1, 2):
            expected += states[k][name].double() - a
        bound = 1.01 * u32 * ((b1 - a).abs() + b1.abs() + (b2 - a).abs() + (b1 + b2 - a).abs())
        assert_within(merged[name], expected, bound, f"merged {name}")
    # equivalently θ_1 + θ_2 − θ_0, evaluated in float32 in another order: both roundings count
    a, b1, b2 = (s["a"].double() for s in states)
    other_order = u32 * ((b1 + b2).abs() + (b1 + b2 - a).abs())
    bound = 1.01 * u32 * ((b1 - a).abs() + b1.abs() + (b2 - a).abs() + (b1 + b2 - a).abs()) + 1.01 * other_order
    assert_within(merged["a"], states[1]["a"] + states[2]["a"] - states[0]["a"], bound, "θ_1 + θ_2 − θ_0")


def test_window_of_one_is_identity_and_inputs_untouched():
    states = _states(2)
    copies = [{k: v.clone() for k, v in s.items()} for s in states]
    assert all(torch.equal(merge_by_differences(states[:1])[k], states[0][k]) for k in ("a", "b"))
    merge_by_differences(states)
    assert all(torch.equal(states[i][k], copies[i][k]) for i in range(2) for k in ("a", "b"))


def test_reference_code_is_the_in_place_update_of_the_published_loop():
    states = _states(3, seed=1)
    # The published code updates the base in place: base += (θ_k − base) for each k, which ends at the last θ.
    base = {k: v.clone() for k, v in states[0].items()}
    for other in states[1:]:
        for k in base:
            base[k] += other[k] - base[k]
    merged = merge_as_reference_code(states)
    assert all(torch.allclose(merged[k], base[k]) for k in base)
    assert all(torch.equal(merged[k], states[-1][k]) for k in base)


def test_low_precision_is_merged_in_float32_and_cast_back():
    g = torch.Generator().manual_seed(3)
    states = [{"w": torch.randn(64, generator=g).to(torch.bfloat16)} for _ in range(4)]
    merged = merge_by_differences(states)
    first = states[0]["w"].float()
    expected = (first + sum(s["w"].float() - first for s in states[1:])).to(torch.bfloat16)
    assert merged["w"].dtype == torch.bfloat16
    assert torch.equal(merged["w"], expected)
