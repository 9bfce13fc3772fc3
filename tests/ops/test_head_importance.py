import torch

from common import assert_close
from optimum_flatten.ops import accumulate_head_importance, kv_group_scores, o_proj_column_norms


def test_head_importance_matches_naive_loops():
    g = torch.Generator().manual_seed(0)
    batch, seq, heads, head_dim, hidden = 2, 5, 3, 4, 6
    head_inputs = torch.randn(batch, seq, heads * head_dim, generator=g, dtype=torch.float64)
    o_weight = torch.randn(hidden, heads * head_dim, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    norms = o_proj_column_norms(o_weight, heads)
    total, count = accumulate_head_importance(head_inputs, norms, mask)
    assert count == 8
    expected = torch.zeros(heads, dtype=torch.float64)
    for h in range(heads):
        # W_O,i (head_dim x hidden) is the slice of W_O's columns for head h, transposed.
        w_oi = o_weight[:, h * head_dim : (h + 1) * head_dim].T
        scale = torch.diag(w_oi @ w_oi.T).sqrt()
        for b in range(batch):
            for t in range(seq):
                if mask[b, t]:
                    expected[h] += (head_inputs[b, t, h * head_dim : (h + 1) * head_dim] * scale).norm()
    assert_close(total, expected)


def test_kv_group_scores_sum_attached_queries():
    scores = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], dtype=torch.float64)
    assert kv_group_scores(scores, 2).tolist() == [6.0, 15.0]
    assert kv_group_scores(scores, 6).tolist() == scores.tolist()
