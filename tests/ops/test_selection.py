import pytest
import torch

from optimum_flatten.ops import greedy_adjacent_groups, top_k_indices


def _matrix(entries, size):
    s = torch.full((size, size), float("nan"), dtype=torch.float64)
    for (i, j), v in entries.items():
        s[i, j] = s[j, i] = v
    return s


def test_greedy_merges_most_similar_adjacent_pair():
    s = _matrix({(0, 1): 0.5, (1, 2): 0.9, (2, 3): 0.7, (0, 2): 0.1, (1, 3): 0.2, (0, 3): 0.0}, 4)
    assert greedy_adjacent_groups(s, 1) == [(0,), (1, 2), (3,)]


def test_chain_is_judged_by_first_and_last_member():
    # After merging (1, 2), extending to 3 is judged by S[1, 3] (row of the first, column of the last),
    # not by S[2, 3]; S[0, 2] judges extending to the left.
    s = _matrix({(0, 1): 0.5, (1, 2): 0.9, (2, 3): 0.85, (1, 3): 0.3, (0, 2): 0.6, (0, 3): 0.0}, 4)
    assert greedy_adjacent_groups(s, 2, max_group_size=None) == [(0, 1, 2), (3,)]


def test_max_group_size_blocks_chains():
    s = _matrix({(0, 1): 0.5, (1, 2): 0.9, (2, 3): 0.85, (3, 4): 0.4, (1, 3): 0.95, (0, 2): 0.1}, 5)
    assert greedy_adjacent_groups(s, 2, max_group_size=None) == [(0,), (1, 2, 3), (4,)]
    assert greedy_adjacent_groups(s, 2, max_group_size=2) == [(0,), (1, 2), (3, 4)]


def test_greedy_raises_when_no_merge_fits():
    s = _matrix({(0, 1): 0.5, (1, 2): 0.9}, 3)
    with pytest.raises(ValueError, match="max_group_size=2"):
        greedy_adjacent_groups(s, 2, max_group_size=2)


def test_top_k_is_sorted_and_breaks_ties_by_index():
    assert top_k_indices(torch.tensor([0.1, 0.5, 0.5, 0.9]), 2) == [1, 3]
    assert top_k_indices(torch.tensor([0.5, 0.5, 0.5]), 2) == [0, 1]


def _balanced_by_enumeration(scores: torch.Tensor, k: int, parts: int) -> list[int]:
    """The definition, by brute force: among subsets of size k with every segment's count k // parts or one more,
    the one whose sorted score vector is largest (each segment's best first), ties to the lower indices."""
    import itertools

    size = scores.numel() // parts
    best, best_key = None, None
    for subset in itertools.combinations(range(scores.numel()), k):
        counts = [sum(1 for i in subset if i // size == p) for p in range(parts)]
        if any(c not in (k // parts, k // parts + 1) for c in counts):
            continue
        # Within a segment only its top-c can be chosen (each keeps its best).
        tops = {p * size + j for p in range(parts) for j in top_k_indices(scores[p * size : (p + 1) * size], counts[p])}
        if set(subset) != tops:
            continue
        key = sorted((-float(scores[i]), i) for i in subset)
        if best_key is None or key < best_key:
            best, best_key = sorted(subset), key
    return best


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(("size", "parts", "k"), [(6, 2, 3), (4, 2, 2), (9, 3, 4), (8, 2, 5)])
def test_balanced_top_k_takes_each_members_best_in_even_shares(seed, size, parts, k):
    from optimum_flatten.ops import balanced_top_k

    scores = torch.rand(size, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    chosen = balanced_top_k(scores, k, parts)
    assert chosen == _balanced_by_enumeration(scores, k, parts)
    segment = size // parts
    counts = [sum(1 for i in chosen if i // segment == p) for p in range(parts)]
    assert max(counts) - min(counts) <= 1 and sum(counts) == k


def test_balanced_top_k_refuses_uneven_segments():
    from optimum_flatten.ops import balanced_top_k

    with pytest.raises(ValueError, match="evenly"):
        balanced_top_k(torch.rand(5), 2, 2)
