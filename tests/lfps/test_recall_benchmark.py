"""``benchmarks/lfps_recall.py``'s shared-selection mode: with one query head per selection head
and room for every candidate it is the reference step, and with GQA it reports what it cut."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import lfps_recall as lr

from redknot.lfps import LfpsParams


def test_one_query_head_per_list_and_room_for_all_is_the_reference():
    params = LfpsParams(budget=0.02)
    q, k, v = lr.synthetic_qkv(608, 4, 64, seed=1)
    ref = lr.run_lfps(q, k, v, 600, 8, params)
    shared = lr.run_lfps_shared(q, k, v, 600, 8, params, kv_heads=4, factor=1000)
    assert shared["overflow_share"] == 0.0
    for key in ("recall", "candidate_share", "bypass_share"):
        assert shared[key] == pytest.approx(ref[key], abs=1e-6), key
    assert shared["recall_group_topk"] == pytest.approx(ref["recall"], abs=1e-6)


def test_a_shared_list_over_capacity_is_counted():
    params = LfpsParams(budget=0.02)
    q, k, v = lr.synthetic_qkv(601, 4, 64, seed=1)
    k, v = k[::2].repeat_interleave(2, 0), v[::2].repeat_interleave(2, 0)  # 2 KV heads
    tight = lr.run_lfps_shared(q, k, v, 600, 1, params, kv_heads=2, factor=4)
    roomy = lr.run_lfps_shared(q, k, v, 600, 1, params, kv_heads=2, factor=1000)
    assert tight["overflow_share"] == 1.0 and roomy["overflow_share"] == 0.0
    # one step from the same tables: the same candidates were found, fewer were kept
    assert tight["candidate_share"] == pytest.approx(roomy["candidate_share"])
    assert 0.0 < tight["recall"] < 1.0


def test_a_wider_shared_selection_contains_the_narrower_one():
    params = LfpsParams(budget=0.02)
    q, k, v = lr.synthetic_qkv(601, 4, 64, seed=2)
    k, v = k[::2].repeat_interleave(2, 0), v[::2].repeat_interleave(2, 0)
    one, two = (lr.run_lfps_shared(q, k, v, 600, 1, params, kv_heads=2, factor=1000, widen=w)
                for w in (1.0, 2.0))  # fmt: skip
    assert two["candidate_share"] == pytest.approx(one["candidate_share"])
    assert one["recall"] <= two["recall"] <= 1.0
    assert two["recall"] > one["recall"], "twice the keys of the same ranking recall more here"


def test_the_shared_list_bound_on_top_k_sets_written_out():
    """Two query heads of one KV head over 4 sinks and 6 keys, K = 2 (budget 2): head 0's own
    Top-2 are keys 0 and 1, head 1's keys 3 and 1. The best shared list holds key 1 (in both)
    and one of the others: 3 of the 4 own entries, 0.75. Ranked by the group's highest logit it
    is keys 0 (9.0) and 3 (8.5): 2 of 4."""
    params = LfpsParams(budget=2.0, num_sink=4)
    n = 4 + 6
    logits = torch.full((2, n), -5.0)
    logits[0, 4:] = torch.tensor([9.0, 6.0, 0.0, -9.0, 0.0, 0.0])  # own Top-2: keys 0, 1
    logits[1, 4:] = torch.tensor([-9.0, 5.0, 4.0, 8.5, 0.0, 0.0])  # own Top-2: keys 3, 1
    # q . k = logit: one-hot keys, the queries carry the logits
    k = torch.eye(n)[None].expand(2, n, n).contiguous()
    q = torch.zeros(2, n, n)
    q[:, n - 1] = logits
    got = lr.shared_list_bound(q, k, n - 1, 1, params, kv_heads=1)
    assert got["recall"] == pytest.approx(0.75)
    # highest logit over the group: key 0 (9.0) and key 3 (8.5): 1 + 1 of 4 own entries
    assert got["recall_max_logit"] == pytest.approx(0.5)
