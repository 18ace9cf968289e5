"""The overlap rates against brute force: per query head, and per KV head against the exact
Top-k of a list shared by the group (keys ranked by their highest logit over its active heads)."""

from __future__ import annotations

import math

import torch

from redknot.lfps.metrics import recall_vs_exact_topk, recall_vs_group_topk


def test_group_recall_against_brute_force():
    torch.manual_seed(0)
    H, rows, N, D, k, sink = 6, 3, 40, 8, 5, 2
    q, keys = torch.randn(H, D), torch.randn(H, N, D)
    chosen = torch.rand(H // rows, N) < 0.4
    active = torch.tensor([True, False, True, False, False, False])
    got = recall_vs_group_topk(q, keys, chosen, k, sink, rows, active)
    # group 0: heads 0 and 2 rank the keys; group 1: every head bypassed
    scores = []
    for n in range(sink, N):
        best = max(float(q[h] @ keys[h, n]) for h in (0, 2))
        scores.append((best, n))
    top = [n for _, n in sorted(scores, reverse=True)[:k]]
    assert math.isclose(float(got[0]), sum(bool(chosen[0, n]) for n in top) / k, abs_tol=1e-6)
    assert math.isnan(float(got[1]))


def test_group_recall_of_one_head_per_list_is_the_per_head_recall():
    torch.manual_seed(1)
    H, N, D = 4, 64, 16
    q, keys = torch.randn(H, D), torch.randn(H, N, D)
    chosen = torch.rand(H, N) < 0.3
    active = torch.ones(H, dtype=torch.bool)
    per_head = recall_vs_exact_topk(q, keys, chosen, 7, 4)
    grouped = recall_vs_group_topk(q, keys, chosen, 7, 4, 1, active)
    assert torch.allclose(per_head, grouped)
    assert 0.0 < float(per_head.mean()) < 1.0
