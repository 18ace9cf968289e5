"""FLOP accounting against a hand count on the tiny model, and visible-key counts."""

from __future__ import annotations

import pytest
import torch

from redknot.headmap import HeadMap
from redknot.recovery import FlopShape, RecoveryOptions, create_policy, serve, visible_keys
from redknot.reference.attention import visible

from .conftest import compose, random_ids

# tiny Llama: D 64, FFN 128 (gated, 3 matrices), 4 query / 2 KV heads of dim 16, vocab 128
D, I, HQ, D_HEAD, V, LAYERS = 64, 128, 4, 16, 128, 3


@pytest.fixture
def prompt(runner):
    """new 3, segment 4, new 2: 9 rows, segment rows 3..6."""
    return [("new", random_ids(3, 11)), ("seg", random_ids(4, 12)), ("new", random_ids(2, 13))]


def test_shape_from_config(runner):
    shape = FlopShape.from_hf_config(runner.model.config)
    assert shape == FlopShape(D, I, HQ, 2, D_HEAD, V, 3)


@pytest.mark.parametrize("window,sink", [(1, 0), (2, 1), (5, 3), (64, 4)])
def test_visible_keys_count_the_attention_mask(window, sink):
    positions = torch.tensor([0, 1, 2, 5, 9, 40])
    for local in (False, True):
        mask = visible(positions, torch.arange(41), local=local, window=window, sink=sink)
        got = visible_keys(positions, local=local, window=window, sink=sink)
        assert got == int(mask.sum())


def test_full_prefill_hand_count(runner, prompt):
    out = serve(runner, create_policy("full", compose(runner, prompt), shape=runner.shape))
    per_layer = {
        "q_proj": 2 * D * HQ * D_HEAD * 9,
        "o_proj": 2 * HQ * D_HEAD * D * 9,
        "kv_proj": 4 * D * D_HEAD * 2 * 9,
        "attention_global": 4 * D_HEAD * HQ * sum(p + 1 for p in range(9)),
        "ffn": 2 * 3 * D * I * 9,
    }
    got = out.flops.to_json()
    for term, value in per_layer.items():
        assert got[term] == LAYERS * value, term
    assert got["attention_local"] == got["probe"] == got["rope_align"] == 0
    assert got["lm_head"] == 2 * D * V
    assert got["total"] == LAYERS * sum(per_layer.values()) + 2 * D * V


def test_naive_hand_count(runner, prompt):
    out = serve(runner, create_policy("naive", compose(runner, prompt), shape=runner.shape))
    new = [0, 1, 2, 7, 8]
    got = out.flops.to_json()
    assert got["q_proj"] == LAYERS * 2 * D * HQ * D_HEAD * 5
    assert got["kv_proj"] == LAYERS * 4 * D * D_HEAD * 2 * 5
    assert got["attention_global"] == LAYERS * 4 * D_HEAD * HQ * sum(p + 1 for p in new)
    assert got["ffn"] == LAYERS * 2 * 3 * D * I * 5
    assert got["rope_align"] == LAYERS * 3 * D_HEAD * 2 * 4
    assert out.fractions == {"attention": 0.0, "ffn": 0.0, "kv_heads": 0.0}


def test_redknot_hand_count(runner, prompt):
    """Map GL in every layer, window 2, sink 1; dense FFN in layer 0 only; no importance."""
    hm = HeadMap(runner.shape, ("GL",) * LAYERS, window=2, sink=1, dense_layers=1)
    opts = RecoveryOptions(
        dense_layers=1, mass_thresh=0.0, recent_n=1, restore_thresh=None, skipped="residual"
    )
    policy = create_policy(
        "redknot", compose(runner, prompt, hm), shape=runner.shape, head_map=hm, options=opts
    )
    out = serve(runner, policy)
    got = out.flops.to_json()
    local_visible = 1 + 2 + 3 * 7  # positions 0, 1, then 2..8 see sink 0 + window of 2
    assert got["q_proj"] == LAYERS * 2 * D * HQ * D_HEAD * 9
    assert got["kv_proj"] == LAYERS * 4 * D * D_HEAD * (9 + 5)  # G: all rows, L: new rows
    assert got["attention_global"] == LAYERS * 4 * D_HEAD * 2 * 45
    assert got["attention_local"] == LAYERS * 4 * D_HEAD * 2 * local_visible
    assert got["ffn"] == 2 * 3 * D * I * (9 + 5 + 5)  # layer 0 every row, then new rows
    assert got["rope_align"] == LAYERS * 3 * D_HEAD * 1 * 4
    assert got["probe"] == 0
    assert out.fractions == {"attention": 1.0, "ffn": pytest.approx(1 / 3), "kv_heads": 0.5}


def test_redknot_skipped_tokens_left_to_cache_hand_count(runner, prompt):
    """skipped="cached": segment rows 3..6 skip the FFN of layer 1 (nothing is important at
    mass_thresh 0), so in layer 2 they take the cached KV in every head and compute nothing."""
    hm = HeadMap(runner.shape, ("GL",) * LAYERS, window=2, sink=1, dense_layers=1)
    opts = RecoveryOptions(
        dense_layers=1, mass_thresh=0.0, recent_n=1, restore_thresh=None, skipped="cached"
    )
    policy = create_policy(
        "redknot", compose(runner, prompt, hm), shape=runner.shape, head_map=hm, options=opts
    )
    out = serve(runner, policy)
    got = out.flops.to_json()
    new = [0, 1, 2, 7, 8]
    assert got["q_proj"] == 2 * D * HQ * D_HEAD * (9 + 9 + 5)
    assert got["kv_proj"] == 4 * D * D_HEAD * (14 + 14 + 10)
    assert got["attention_global"] == 4 * D_HEAD * 2 * (45 + 45 + sum(p + 1 for p in new))
    assert got["attention_local"] == 4 * D_HEAD * 2 * (24 + 24 + (1 + 2 + 3 + 3 + 3))
    assert got["ffn"] == 2 * 3 * D * I * (9 + 5 + 5)
    assert got["rope_align"] == 3 * D_HEAD * (4 + 4 + 8)
    assert out.fractions == {
        "attention": pytest.approx(2 / 3),
        "ffn": pytest.approx(1 / 3),
        "kv_heads": pytest.approx(1 / 3),
    }
    assert policy.frozen.tolist() == [False] * 3 + [True] * 4 + [False] * 2


def _token_policy(runner, prompt, name, **knobs):
    policy = create_policy(
        name, compose(runner, prompt), shape=runner.shape, options=RecoveryOptions(**knobs)
    )
    return policy, serve(runner, policy)


def test_epic_hand_count(runner, prompt):
    """epic_k 2: rows 0-4 and 7-8 computed in every layer, rows 5-6 served from the cache."""
    _, out = _token_policy(runner, prompt, "epic", epic_k=2)
    kept = [0, 1, 2, 3, 4, 7, 8]
    got = out.flops.to_json()
    assert got["q_proj"] == got["o_proj"] == LAYERS * 2 * D * HQ * D_HEAD * 7
    assert got["kv_proj"] == LAYERS * 4 * D * D_HEAD * 2 * 7
    assert got["attention_global"] == LAYERS * 4 * D_HEAD * HQ * (1 + 2 + 3 + 4 + 5 + 8 + 9)
    assert sum(p + 1 for p in kept) == 32
    assert got["ffn"] == LAYERS * 2 * 3 * D * I * 7
    assert got["rope_align"] == LAYERS * 3 * D_HEAD * 2 * 2  # 2 KV heads x rows 5, 6
    assert got["attention_local"] == got["probe"] == got["deviation"] == 0
    assert got["total"] == sum(v for k, v in got.items() if k != "total")
    assert out.fractions == {"attention": 0.5, "ffn": 0.5, "kv_heads": 0.5}


def test_cacheblend_hand_count(runner, prompt):
    """Check layer 0, ratio 0.5: layer 0 dense plus the deviation of 4 segment rows x 2 KV
    heads (each cached key re-aligned to compare); layers 1-2 compute the new rows and the 2
    selected rows, the other 2 segment rows come from the cache."""
    policy, out = _token_policy(runner, prompt, "cacheblend", blend_check_layer=0, blend_ratio=0.5)
    chosen = policy.selected.tolist()
    assert len(chosen) == 2 and set(chosen) <= {3, 4, 5, 6}
    kept = [0, 1, 2, 7, 8] + chosen
    got = out.flops.to_json()
    assert got["q_proj"] == 2 * D * HQ * D_HEAD * (9 + 7 + 7)
    assert got["kv_proj"] == 4 * D * D_HEAD * 2 * (9 + 7 + 7)
    dense_pairs = sum(p + 1 for p in range(9))
    kept_pairs = sum(p + 1 for p in kept)
    assert got["attention_global"] == 4 * D_HEAD * HQ * (dense_pairs + 2 * kept_pairs)
    assert got["ffn"] == 2 * 3 * D * I * (9 + 7 + 7)
    assert got["deviation"] == 6 * D_HEAD * 4 * 2
    assert got["rope_align"] == 3 * D_HEAD * (4 * 2 + 2 * 2 + 2 * 2)
    assert got["probe"] == 0 and got["lm_head"] == 2 * D * V
    assert out.fractions["ffn"] == pytest.approx((4 + 2 + 2) / 12)


def test_sparsex_hand_count(runner, prompt):
    """Boundary 1, k 1, block 1: layer 0 dense, and the new rows 0-2, 7-8 probe every key they
    see (4 query heads); the overflow is rows 3 and 6 (a block either side of the segment);
    layers 1-2 compute the new rows, the overflow and the top-1 row."""
    policy, out = _token_policy(
        runner, prompt, "sparsex", sparseq_boundary=1, sparseq_k=1, sparseq_block=1
    )
    kept = sorted({0, 1, 2, 3, 6, 7, 8} | set(policy.selection.key.tolist()))
    n = len(kept)
    reused = 9 - n  # segment rows served from the cache above the boundary
    got = out.flops.to_json()
    assert got["probe"] == 2 * D_HEAD * HQ * (1 + 2 + 3 + 8 + 9)
    assert got["q_proj"] == 2 * D * HQ * D_HEAD * (9 + 2 * n)
    assert got["kv_proj"] == 4 * D * D_HEAD * 2 * (9 + 2 * n)
    assert got["attention_global"] == 4 * D_HEAD * HQ * (45 + 2 * sum(p + 1 for p in kept))
    assert got["ffn"] == 2 * 3 * D * I * (9 + 2 * n)
    assert got["rope_align"] == 3 * D_HEAD * 2 * 2 * reused
    assert got["deviation"] == 0
