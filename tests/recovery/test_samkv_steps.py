"""SamKV's steps against brute-force computation on small tensors."""

from __future__ import annotations

import math

import pytest
import torch

from redknot.recovery.samkv import (
    SparseLayout,
    block_keys,
    cosine_fusion,
    cut_document,
    personalized_queries,
    pooled,
    scores,
    select_blocks,
    sparse_forward,
    token_max_scores,
    top_p_ratio,
    visible_mask,
)
from redknot.reference import ReferenceRunner
from redknot.reference.rope import Rope

from .conftest import random_ids, tiny_llama


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("n", [1, 5, 12, 16, 17, 31, 40, 64, 67])
def test_cut_covers_every_token_once_with_whole_middle_blocks(n):
    d = cut_document(3, 100, 100 + n, block=4, init_blocks=1, local_blocks=2)
    assert d.length == n and d.init == min(n, 4)
    block = d.block_of()
    anchor = d.anchor_mask()
    assert torch.equal(anchor, block < 0)
    for b in range(d.num_blocks):  # whole blocks, in order
        assert torch.equal(torch.nonzero(block == b).flatten(), torch.arange(4) + 4 + 4 * b)
    assert d.local == n - d.init - 4 * d.num_blocks
    if d.num_blocks:
        assert 8 <= d.local < 12  # two local blocks plus the remainder
    else:
        assert bool(anchor.all())  # too short: all anchor
    assert d.sparsifiable == (n >= 16)


def test_personalized_queries_follow_eq1():
    generic = torch.randn(3, 4, 8, generator=_gen(0))
    local = torch.randn(5, 3, 4, 8, generator=_gen(1))
    got = personalized_queries(generic, local)
    for i in range(5):
        for n in range(3):
            for h in range(4):
                want = generic[n, h].clone()
                for j in range(5):
                    if j != i:
                        a, b = generic[n, h], local[j, n, h]
                        cos = float(a @ b) / (a.norm() * b.norm())
                        want += abs(cos) * b / 4
                torch.testing.assert_close(got[i, n, h], want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(personalized_queries(generic, local[:1])[0], generic)


def test_pooled_queries_are_position_free():
    rope = Rope(1.0 / (10000 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8)))
    raw = torch.randn(4, 6, 8, generator=_gen(2))
    positions = torch.tensor([3, 9, 10, 40, 41, 100])
    got = pooled(rope, rope.apply(raw, positions), positions)
    torch.testing.assert_close(got, raw.mean(dim=1), rtol=1e-5, atol=1e-5)


def test_block_keys_and_scores_by_brute_force():
    d = cut_document(0, 0, 29, block=4, init_blocks=1, local_blocks=2)  # init 4, 4 blocks, local 9
    keys = torch.randn(2, 29, 8, generator=_gen(3))
    blocks, anchor = block_keys(keys, d)
    assert blocks.shape == (2, d.num_blocks, 8)
    for b in range(d.num_blocks):
        torch.testing.assert_close(blocks[:, b], keys[:, 4 + 4 * b : 8 + 4 * b].mean(dim=1))
    anchors = list(range(4)) + list(range(d.middle_end, 29))
    torch.testing.assert_close(anchor, keys[:, anchors].mean(dim=1))
    query = torch.randn(4, 8, generator=_gen(4))  # 4 query heads over 2 KV heads
    got = scores(query, blocks)
    for b in range(d.num_blocks):
        want = sum(float(query[h] @ blocks[h // 2, b]) for h in range(4))
        assert float(got[b]) == pytest.approx(want, rel=1e-5)


def test_token_max_scores_by_brute_force():
    """``samkv_block_score="token-max"``: a block's score is its best token's, the anchors'
    the best anchor token's."""
    d = cut_document(0, 0, 29, block=4, init_blocks=1, local_blocks=2)
    keys = torch.randn(2, 29, 8, generator=_gen(5))
    query = torch.randn(4, 8, generator=_gen(6))

    def token(t):
        return sum(float(query[h] @ keys[h // 2, t]) for h in range(4))

    blocks, anchor = token_max_scores(query, keys, d)
    for b in range(d.num_blocks):
        want = max(token(t) for t in range(4 + 4 * b, 8 + 4 * b))
        assert float(blocks[b]) == pytest.approx(want, rel=1e-5)
    anchors = list(range(4)) + list(range(d.middle_end, 29))
    assert anchor == pytest.approx(max(token(t) for t in anchors), rel=1e-5)


def test_top_p_ratio_is_eq2():
    s = torch.tensor([1.0, 4.0, 2.0, 0.0])
    assert top_p_ratio(s, 3.0) == pytest.approx((4 - 3) / (4 - 0))
    assert top_p_ratio(s, 4.0) == 0.0  # at the top: nothing above the anchor
    assert top_p_ratio(s, 0.0) == 0.0  # at or below the minimum: outside (s_min, s_max]
    assert top_p_ratio(s, 5.0) == 0.0
    assert top_p_ratio(s, -1.0) == 0.0
    assert top_p_ratio(torch.zeros(0), 1.0) == 0.0


def _brute_selection(block_scores, anchor_scores, stable, budget):
    """Eq. 2-3 and the retention, written out."""
    num_layers = anchor_scores.shape[0]
    sizes = [s.shape[1] for s in block_scores]
    if budget is None:
        ratios = []
        for i, s in enumerate(block_scores):
            per = []
            for n in stable:
                row = s[n].tolist()
                a = float(anchor_scores[n, i])
                ok = row and min(row) < a <= max(row)
                per.append((max(row) - a) / (max(row) - min(row)) if ok else 0.0)
            ratios.append(sum(per) / len(per))
        retrieved = [min(m, math.ceil(p * m - 1e-9)) for p, m in zip(ratios, sizes)]
        count = math.ceil(sum(retrieved) / sum(1 for m in sizes if m))
    else:
        retrieved, count = sizes, math.ceil(budget * sum(sizes) - 1e-9)
    kept = [torch.zeros(num_layers, m, dtype=torch.bool) for m in sizes]
    for n in range(num_layers):
        pool = []
        for i, s in enumerate(block_scores):
            row = s[n].tolist()
            order = sorted(range(len(row)), key=lambda b: (-row[b], b))[: retrieved[i]]
            lo, hi = (min(row), max(row)) if row else (0, 0)
            for b in order:
                norm = (row[b] - lo) / (hi - lo) if hi > lo else 1.0
                pool.append((-norm, -row[b], i, b))
        for _, _, i, b in sorted(pool)[:count]:
            kept[i][n, b] = True
    return retrieved, count, kept


@pytest.mark.parametrize("budget", [None, 0.0, 0.3, 1.0])
@pytest.mark.parametrize("seed", range(4))
def test_selection_by_brute_force(seed, budget):
    g = _gen(10 + seed)
    sizes = [5, 0, 7, 3]
    block_scores = [torch.randn(4, m, generator=g) for m in sizes]
    anchor_scores = torch.randn(4, len(sizes), generator=g) * 0.5
    got = select_blocks(block_scores, anchor_scores, stable_layers=[2, 3], budget=budget)
    retrieved, count, kept = _brute_selection(block_scores, anchor_scores, [2, 3], budget)
    assert got.retrieved == retrieved and got.per_layer == count
    for a, b in zip(got.kept, kept):
        assert torch.equal(a, b)
    for n in range(4):  # every layer keeps the same number of blocks
        assert sum(int(k[n].sum()) for k in got.kept) == min(count, sum(retrieved))
    if budget == 1.0:
        assert all(bool(k.all()) for k in got.kept)


@pytest.mark.parametrize("budget", [0.0, 0.3, 1.0])
def test_a_per_document_share_keeps_each_documents_own_best_blocks(budget):
    """The server's rule (``per_document``): each document keeps ``ceil(budget * M_i)`` of its
    own blocks in every layer, best first (ties: the earlier block), written out."""
    g = _gen(3)
    sizes = [5, 0, 7, 3]
    block_scores = [torch.randn(4, m, generator=g) for m in sizes]
    block_scores[0][1, :2] = 0.5  # a tie
    anchor_scores = torch.randn(4, len(sizes), generator=g)
    got = select_blocks(block_scores, anchor_scores, stable_layers=[3], budget=budget,
                        per_document=True)  # fmt: skip
    for s, k, m in zip(block_scores, got.kept, sizes):
        count = min(m, math.ceil(budget * m - 1e-9))
        for n in range(4):
            row = s[n].tolist()
            best = sorted(range(m), key=lambda b: (-row[b], b))[:count]
            assert k[n].tolist() == [b in best for b in range(m)]
    assert got.per_layer == sum(min(m, math.ceil(budget * m - 1e-9)) for m in sizes)


def test_a_single_document_keeps_what_its_top_p_retrieves():
    s = torch.tensor([[0.0, 1.0, 2.0, 3.0, 4.0]]).repeat(2, 1)
    got = select_blocks([s], torch.tensor([[1.5], [1.5]]), stable_layers=[0, 1])
    assert got.retrieved == [math.ceil((4 - 1.5) / 4 * 5)] and got.per_layer == 4
    assert got.kept[0][0].tolist() == [False, True, True, True, True]


def test_cosine_fusion_is_eq4():
    new = torch.randn(2, 5, 8, generator=_gen(20))
    old = new + 0.3 * torch.randn(2, 5, 8, generator=_gen(21))
    old[1, 4] = -new[1, 4]  # opposite: theta clamped to 0, the old value stays
    got = cosine_fusion(new, old)
    for h in range(2):
        for r in range(5):
            theta = float(new[h, r] @ old[h, r]) / (new[h, r].norm() * old[h, r].norm())
            theta = min(max(theta, 0.0), 1.0)
            torch.testing.assert_close(got[h, r], theta * new[h, r] + (1 - theta) * old[h, r])
    torch.testing.assert_close(cosine_fusion(new, new), new)


def test_visible_mask_and_rule_1_by_brute_force():
    keep = torch.tensor([True, False, True, True, False, True])
    rows = torch.tensor([1, 3, 5])
    got = visible_mask(keep, rows, past_len=2)
    for i, r in enumerate(rows.tolist()):
        want = [True, True] + [(keep[t] and t <= r) or t == r for t in range(6)]
        assert got[i].tolist() == want
    recompute = torch.tensor([[1, 0, 0, 1], [0, 0, 1, 1], [0, 1, 0, 1]], dtype=torch.bool)
    layout = SparseLayout(
        torch.zeros(4, dtype=torch.int64), torch.ones(3, 4, dtype=torch.bool), recompute,
        torch.ones(4, dtype=torch.bool), [torch.zeros(1, 4, 2)] * 3, [torch.zeros(1, 4, 2)] * 3,
    )  # fmt: skip
    compute = layout.compute()
    for n in range(3):
        for t in range(4):
            assert bool(compute[n, t]) == bool(recompute[n + 1 :, t].any()), (n, t)


def _brute_sparse_forward(m, layout, past):
    """The sparse forward row by row: explicit softmax over each row's visible keys."""
    p0 = past.length
    t = layout.num_rows
    pos = torch.arange(p0, p0 + t)
    compute = layout.compute()
    x = m.embed(layout.ids)
    group = m.group_size
    kept_kv = []
    for n in range(m.num_layers):
        q, k, v = m.qkv(n, x, pos)
        keys = layout.cached_keys[n].clone()
        values = layout.cached_values[n].clone()
        for r in range(t):
            if layout.recompute[n, r]:
                keys[:, r], values[:, r] = k[:, r], v[:, r]
        full_k = torch.cat((past.keys[n], keys), dim=1)
        full_v = torch.cat((past.values[n], values), dim=1)
        new_x = x.clone()
        for r in range(t):
            if not compute[n, r]:
                continue
            cols = list(range(p0)) + [
                p0 + c for c in range(t) if (layout.keep[n, c] and c <= r) or c == r
            ]
            o = torch.zeros(q.shape[0], q.shape[2])
            for h in range(q.shape[0]):
                kh, vh = full_k[h // group, cols], full_v[h // group, cols]
                w = torch.softmax((kh @ q[h, r]) * m.scale, dim=0)
                o[h] = w @ vh
            upd = m.attn_output(n, o[:, None])[0]
            new_x[r] = x[r] + upd
            new_x[r] = new_x[r] + m.ffn(n, new_x[r : r + 1])[0]
        x = new_x
        idx = torch.nonzero(layout.keep[n]).flatten()
        moved = m.rope.realign(keys[:, idx], pos[idx], torch.arange(p0, p0 + idx.numel()))
        kept_kv.append((moved, values[:, idx]))
    return kept_kv


def test_sparse_forward_by_brute_force():
    runner = ReferenceRunner(tiny_llama(layers=3, seed=5))
    m = runner.model
    ids = random_ids(18, 30)
    past = runner.forward(ids[:4], logits_rows="none").kv  # an exact prefix
    cached = runner.forward(ids, logits_rows="none").kv.rows(4, 18)  # "cached" rows 4..17
    noise = torch.Generator().manual_seed(31)
    t = 14
    keep = torch.ones(3, t, dtype=torch.bool)
    keep[0, [3, 4, 9]] = False  # padding in layer 0
    keep[1, [5, 6, 9]] = False
    keep[2, [3, 4, 5]] = False
    recompute = torch.zeros(3, t, dtype=torch.bool)
    recompute[:, 0] = True  # a row without cache: recomputed wherever kept
    recompute[2, 6] = True  # padding in layer 1, recomputed in layer 2 (Fig. 5, case 3)
    recompute[0, 7] = True  # recomputed in layer 0 only (case 1)
    recompute[1, 11] = recompute[2, 11] = True
    has_cache = torch.ones(t, dtype=torch.bool)
    has_cache[0] = False
    ck = [k + 0.05 * torch.randn(k.shape, generator=noise) for k in cached.keys]
    cv = [v + 0.05 * torch.randn(v.shape, generator=noise) for v in cached.values]
    layout = SparseLayout(torch.tensor(ids[4:]), keep, recompute, has_cache, ck, cv)
    got = sparse_forward(m, layout, past=past)
    want = _brute_sparse_forward(m, layout, past)
    for n in range(3):
        torch.testing.assert_close(got.kv.keys[n][:, :4], past.keys[n])
        torch.testing.assert_close(got.kv.keys[n][:, 4:], want[n][0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got.kv.values[n][:, 4:], want[n][1], rtol=1e-4, atol=1e-5)
        assert torch.equal(got.kept[n], torch.nonzero(keep[n]).flatten())
    # rule 1: rows 0, 6 and 11 are recomputed above layers 0 and 1; row 7 only in layer 0
    assert [c.attention_rows for c in got.counts] == [3, 3, 0]
    assert [c.kv_rows for c in got.counts] == [2, 2, 3]


def test_layer_votes_follow_the_pauta_criterion():
    """A document whose block 3 is the best in every layer and stands out in layers 4-6: those
    layers vote, the layers where it is best but no outlier do not; a document of one block
    votes nowhere."""
    from redknot.recovery.samkv.calibrate import layer_votes

    g = torch.Generator().manual_seed(0)
    s = torch.rand(8, 20, generator=g)
    s[:, 3] = 1.05  # the best of every layer, within 3 std of its layer's mean
    s[4:7, 3] = 10.0  # > mean + 3 std of its layer
    votes = layer_votes([s, torch.rand(8, 1, generator=g)])
    assert votes.tolist() == [0, 0, 0, 0, 1, 1, 1, 0]
    want = [
        int(s[n, 3] > s[n].mean() + 3 * s[n].std(unbiased=False)) for n in range(8)
    ]  # written out
    assert votes.tolist() == want
    assert layer_votes([s, s]).tolist() == [2 * v for v in want]


def test_stable_window_takes_the_most_votes_and_the_later_tie():
    from redknot.recovery.samkv.calibrate import stable_window

    votes = torch.tensor([0, 3, 3, 0, 0, 1, 2, 3])
    assert stable_window(votes, 2) == 1  # 6 beats 5 (6-7) and 3
    assert stable_window(votes, 3) == 5  # 6 (5-7) ties 6 (0-2, 1-3): the later window
    assert stable_window(votes, 8) == 0
    with pytest.raises(ValueError, match="does not fit"):
        stable_window(votes, 9)
