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
