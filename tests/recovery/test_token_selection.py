"""CacheBlend's and SparseX's token selections against plain brute-force computations."""

from __future__ import annotations

import math

import pytest
import torch

from redknot.recovery import (
    RecoveryOptions,
    create_policy,
    kv_deviation,
    select_tokens,
    serve,
    top_rows,
)
from redknot.recovery.sparseq import TAIL_FALLBACK

from .conftest import compose

# ---- brute force, written out plainly -------------------------------------------------------


def brute_top(scores: dict[int, float], count: int) -> list[int]:
    """The ``count`` rows of highest score, ties to the lower row, ascending."""
    ranked = sorted(scores, key=lambda r: (-scores[r], r))
    return sorted(ranked[:count])


def brute_deviation(k, v, ck, cv, row) -> float:
    total = 0.0
    for h in range(k.shape[0]):
        for i in range(k.shape[2]):
            total += (float(k[h, row, i]) - float(ck[h, row, i])) ** 2
            total += (float(v[h, row, i]) - float(cv[h, row, i])) ** 2
    return total


def brute_sparseq(q, keys, spans, past_len, classes, window, sink, scale, k, block):
    """Scores, probed rows and recompute set of SparseX §3.2-3.3 by loops."""
    hq, num_rows, d = q.shape
    group = hq // keys.shape[0]
    reused = [any(s <= r < e for s, e in spans) for r in range(num_rows)]
    last_start, last_end = spans[-1] if spans else (0, 0)
    tail = set()
    if spans and last_end == num_rows:
        tail = set(range(max(last_start, last_end - TAIL_FALLBACK), last_end))
    probed = [r for r in range(num_rows) if not reused[r] or r in tail]
    scores = {r: 0.0 for r in range(num_rows)}
    for i in probed:
        p = past_len + i
        for h in range(hq):
            local = classes[h // group] == "L"
            seen = [j for j in range(p + 1) if not local or j < sink or p - j < window]
            logits = {
                j: scale * sum(float(q[h, i, x]) * float(keys[h // group, j, x]) for x in range(d))
                for j in seen
            }
            top = max(logits.values())
            norm = sum(math.exp(a - top) for a in logits.values())
            for j in seen:
                if j >= past_len:
                    scores[j - past_len] += math.exp(logits[j] - top) / norm
    key = brute_top({r: v for r, v in scores.items() if reused[r]}, k)  # reused rows only
    overflow = set()
    for s, e in spans:
        # the row before the segment: in the call, or an exact-prefix row (non-reused text)
        before_new = not reused[s - 1] if s > 0 else past_len > 0
        for r in range(s, e):
            to_left = r - s + 1  # steps to the row before the segment
            to_right = e - r  # steps to the row after the segment
            if before_new and to_left <= block:
                overflow.add(r)
            if e < num_rows and not reused[e] and to_right <= block:
                overflow.add(r)
    recompute = {r for r in range(num_rows) if not reused[r]} | set(key) | overflow | tail
    return scores, probed, key, overflow, tail, recompute


# ---- pure functions -------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(4))
def test_kv_deviation_and_top_rows(seed):
    gen = torch.Generator().manual_seed(seed)
    k, v, ck, cv = (torch.randn(2, 11, 5, generator=gen) for _ in range(4))
    got = kv_deviation(k, v, ck, cv)
    for row in range(11):
        assert float(got[row]) == pytest.approx(brute_deviation(k, v, ck, cv, row), rel=1e-9)
    candidates = torch.tensor([0, 2, 3, 5, 8, 9, 10])
    scores = got.clone()
    scores[3] = scores[5]  # a tie
    for count in range(9):
        want = brute_top({int(c): float(scores[c]) for c in candidates}, count)
        assert top_rows(scores, candidates, count).tolist() == want


SPANS = [
    ([], 20),
    ([(0, 9), (12, 20), (20, 23), (27, 31)], 34),  # adjacent segments, a short one
    ([(3, 10), (14, 85)], 85),  # ends inside a segment longer than the tail
    ([(5, 25)], 25),  # ends inside a short segment
]


@pytest.mark.parametrize("spans,num_rows", SPANS)
@pytest.mark.parametrize("classes", ["GG", "GL"])
@pytest.mark.parametrize("k,block", [(0, 0), (3, 1), (7, 4), (200, 2)])
def test_sparseq_selection_against_brute_force(spans, num_rows, classes, k, block):
    gen = torch.Generator().manual_seed(num_rows + k)
    past_len, d, window, sink, scale = 4, 6, 5, 2, 0.7
    q = torch.randn(4, num_rows, d, generator=gen)
    keys = torch.randn(2, past_len + num_rows, d, generator=gen)
    got = select_tokens(
        q,
        keys,
        spans,
        past_len=past_len,
        classes=classes,
        window=window,
        sink=sink,
        scale=scale,
        k=k,
        block=block,
    )
    scores, probed, key, overflow, tail, recompute = brute_sparseq(
        q, keys, spans, past_len, classes, window, sink, scale, k, block
    )
    assert got.probed.tolist() == probed
    for r in range(num_rows):
        assert float(got.scores[r]) == pytest.approx(scores[r], abs=1e-5)
    assert got.key.tolist() == key
    assert set(torch.nonzero(got.overflow).flatten().tolist()) == overflow
    assert set(torch.nonzero(got.tail).flatten().tolist()) == tail
    assert set(torch.nonzero(got.recompute).flatten().tolist()) == recompute


def test_sparseq_overflow_example():
    """new 0..3 | segment 4..19 | new 20..21 | segment 22..23 | segment 24..29 | new 30"""
    spans = [(4, 20), (22, 24), (24, 30)]
    got = select_tokens(
        torch.zeros(2, 31, 4),
        torch.zeros(1, 31, 4),
        spans,
        past_len=0,
        classes="G",
        window=8,
        sink=0,
        scale=1.0,
        k=0,
        block=3,
    )
    assert torch.nonzero(got.overflow).flatten().tolist() == [
        4,
        5,
        6,
        17,
        18,
        19,
        22,
        23,
        27,
        28,
        29,
    ]
    assert not got.tail.any()


@pytest.mark.parametrize("k,block", [(3, 2), (9, 4), (40, 3)])
def test_sparseq_selection_does_not_depend_on_a_cached_head(k, block):
    """The prompt's head (rows before the first segment) computed in the call, or cached
    before it (an exact-prefix hit, the reference path's prefix): the same rows recomputed."""
    gen = torch.Generator().manual_seed(k)
    head, n, d = 6, 40, 5
    spans = [(6, 18), (18, 25), (29, 36)]  # the first segment right after the head
    q = torch.randn(2, n, d, generator=gen)
    keys = torch.randn(1, n, d, generator=gen)
    common = {"classes": "G", "window": 64, "sink": 0, "scale": 0.9, "k": k, "block": block}
    inside = select_tokens(q, keys, spans, past_len=0, **common)
    cached = select_tokens(q[:, head:], keys, [(s - head, e - head) for s, e in spans],
                           past_len=head, **common)  # fmt: skip
    assert torch.equal(cached.recompute, inside.recompute[head:])
    assert inside.recompute[:head].all()  # the head itself: new text, always computed
    assert cached.overflow[:block].all()  # the first segment overflows after the head
    assert bool(inside.key.ge(head).all())  # the budget goes to reused rows


# ---- the selections inside a served request ----------------------------------------------------


def test_cacheblend_picks_the_largest_kv_deviation(runner, pieces):
    """At the check layer the fresh KV is the dense prefill's (every layer up to it is dense);
    the cached KV is each segment's cache moved to its rows."""
    prompt = compose(runner, pieces)
    check, ratio = 1, 0.2
    policy = create_policy(
        "cacheblend",
        prompt,
        shape=runner.shape,
        options=RecoveryOptions(blend_check_layer=check, blend_ratio=ratio),
    )
    serve(runner, policy, max_new_tokens=1)
    dense = runner.forward(list(prompt.ids)).kv
    k, v = dense.keys[check], dense.values[check]
    deviation = {}
    for seg in prompt.segments:
        moved = seg.cache.realigned(runner.model.rope, 0, seg.start)
        ck = torch.zeros_like(k)
        cv = torch.zeros_like(v)
        ck[:, seg.start : seg.end] = moved.keys[check]
        cv[:, seg.start : seg.end] = moved.values[check]
        for row in range(seg.start, seg.end):
            deviation[row] = brute_deviation(k, v, ck, cv, row)
    want = brute_top(deviation, round(ratio * 90))
    assert policy.selected.tolist() == want
    assert policy.record.layers[check].compared == 90 * 2
    kept = set(range(118)) - set(deviation) | set(want)
    assert torch.nonzero(policy.keep).flatten().tolist() == sorted(kept)


def test_sparsex_selection_in_layer_0_reads_token_and_position_only(runner, pieces):
    """With the boundary at 1 the selection reads layer 0, whose queries and keys depend only on
    the tokens and their positions: recompute them from the embeddings and select by loops."""
    prompt = compose(runner, pieces)
    policy = create_policy(
        "sparsex",
        prompt,
        shape=runner.shape,
        options=RecoveryOptions(sparseq_boundary=1, sparseq_k=15, sparseq_block=3),
    )
    serve(runner, policy, max_new_tokens=1)
    model = runner.model
    ids = torch.tensor(prompt.ids)
    positions = torch.arange(len(ids))
    with torch.no_grad():
        q, keys, _ = model.qkv(0, model.embed(ids), positions)
    spans = [(s.start, s.end) for s in prompt.segments]
    _, probed, key, overflow, tail, recompute = brute_sparseq(
        q, keys, spans, 0, "GG", 1, 0, model.scale, 15, 3
    )
    got = policy.selection
    assert (
        got.probed.tolist()
        == probed
        == list(range(10)) + list(range(50, 56)) + list(range(106, 118))
    )
    assert got.key.tolist() == key
    assert (
        set(torch.nonzero(got.overflow).flatten().tolist())
        == overflow
        == {
            10,
            11,
            12,
            47,
            48,
            49,
            56,
            57,
            58,
            103,
            104,
            105,
        }
    )
    assert not tail
    assert set(torch.nonzero(policy.keep).flatten().tolist()) == recompute
    assert policy.record.layers[0].probe_pairs == 4 * sum(p + 1 for p in probed)
