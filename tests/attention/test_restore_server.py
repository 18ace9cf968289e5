"""Adaptive restore in the server path: a toy decoder stack (RoPE, head-class attention through the
SegPaged runner, residual MLP) reusing a stored segment, against a brute-force forward that
applies the rule directly: in every layer, the edge mass of each local head (the probed newest
rows' attention over sink + window, as the local heads compute it, on the oldest ``EDGE`` window
tokens; mean over the rows, max over the group), the heads above the threshold promoted (at most
``R``, largest first), a promoted head taking this prompt's K/V on the rows the layer computes
and attending every key; then one decode step, in which the promoted heads still attend every
key. Triton kernels under the interpreter on the CPU."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from redknot.attention.ffn_schedule import SCHEDULE

from .test_ffn_schedule import brute_mass, brute_skip
from .test_segpaged_runner import SINK, WINDOW, D
from .test_skipped_cached import (
    CLASSES,
    GRP,
    NEW,
    QUESTION,
    RECENT,
    SEG,
    _norm,
    layer_input,
    served,
    take_cached,
    world_with_stored_segment,
)

EDGE = 2
N = NEW + SEG + QUESTION


def _visible(classes, h, pos):
    j = torch.arange(pos + 1)
    if classes[h] == "L":
        j = j[(j < SINK) | (pos - j < WINDOW)]
    return j


def _attention(classes, q, k, v, rows):
    """The attention output ``[len(rows), Hq * D]`` (bf16-rounded) of queries ``q[i]`` at
    positions ``rows[i]``."""
    o = torch.zeros(len(rows), q.shape[1], D)
    for i, pos in enumerate(rows):
        for hq in range(q.shape[1]):
            j = _visible(classes, hq // GRP, pos)
            s = (k[j, hq // GRP].float() @ q[i, hq].float()) * D**-0.5
            o[i, hq] = torch.softmax(s, 0) @ v[j, hq // GRP].float()
    return o.to(torch.bfloat16).float().view(len(rows), -1)


def _edge_mass(classes, q, k, probe, h):
    """Edge mass of local KV head ``h``: per query head the mean over the probed rows of the
    probability on keys ``j >= SINK`` with ``WINDOW - EDGE <= pos - j < WINDOW``; max over the
    group."""
    best = 0.0
    for hq in range(h * GRP, (h + 1) * GRP):
        total = 0.0
        for pos in probe.tolist():
            j = _visible(classes, h, pos)
            p = torch.softmax((k[j, h].float() @ q[pos, hq].float()) * D**-0.5, 0)
            edge = (j >= SINK) & (pos - j >= WINDOW - EDGE) & (pos - j < WINDOW)
            total += float(p[edge].sum())
        best = max(best, total / len(probe))
    return best


def brute_force(world, layers, embed, seg_kv, thresh, cap, dense_layers, mass_thresh, local_kv):
    """Every row's forward with restore applied directly. Returns ``(hidden + residual,
    promoted heads per layer, every layer's K/V as attended, rows left per layer)``."""
    layout = world.layout
    n, seg = embed.shape[0], torch.arange(NEW, NEW + SEG)
    probe = torch.arange(min(NEW + SEG, n - RECENT), n)
    left = torch.zeros(n, dtype=torch.bool)
    hidden, residual = embed.clone(), None
    positions = torch.arange(n)
    promoted, kv, history = [], [], []
    for lid, layer in enumerate(layers):
        residual, x = layer_input(hidden, residual)
        q, k, v = layer.qkv(x, positions)
        fresh_k, fresh_v = k.clone(), v.clone()
        take_cached(world, seg_kv, lid, k, v, left, local_kv)
        classes = layout.classes[lid]
        mass = {h: _edge_mass(classes, q, k, probe, h) for h in layout.local_heads(lid)}
        over = sorted((h for h in mass if mass[h] > thresh), key=lambda h: -mass[h])[:cap]
        promoted.append(set(over))
        computed = seg[~left[seg]]
        for h in over:  # this prompt's K/V on the rows the layer computes
            k[computed, h], v[computed, h] = fresh_k[computed, h], fresh_v[computed, h]
        classes = "".join("G" if h in over else c for h, c in enumerate(classes))
        kv.append((k.clone(), v.clone()))
        new_residual = _attention(classes, q, k, v, range(n)) @ layer.wo + residual
        x = _norm(new_residual)
        ffn = ~left
        if lid >= dense_layers:
            glob = layout.global_heads(lid)  # the map's global heads vote, as in the server
            qh = [h * GRP + j for h in glob for j in range(GRP)]
            votes = brute_mass(
                q[probe][:, qh].float().view(len(probe), len(glob), GRP, D),
                k[:, glob].float(), probe, D**-0.5,
            )  # fmt: skip
            candidates = [int(t) for t in seg if not left[t] and t < probe[0]]
            ffn[brute_skip(votes, candidates, mass_thresh)] = False
        out = torch.where(ffn[:, None], layer.mlp.forward(x), torch.zeros_like(x))
        hidden = torch.where(left[:, None], hidden, out)
        residual = torch.where(left[:, None], residual, new_residual)
        left = ~ffn
        history.append(left.clone())
    return hidden + residual, promoted, kv, history


def brute_decode(world, layers, token, kv, promoted, pos):
    """The decode step of embedding ``token`` at ``pos`` after the brute-force prefill."""
    hidden, residual = token.clone(), None
    for lid, layer in enumerate(layers):
        residual, x = layer_input(hidden, residual)
        q, k, v = layer.qkv(x, torch.tensor([pos]))
        keys, values = torch.cat([kv[lid][0], k]), torch.cat([kv[lid][1], v])
        classes = "".join(
            "G" if h in promoted[lid] else c for h, c in enumerate(world.layout.classes[lid])
        )
        residual = _attention(classes, q, keys, values, [pos]) @ layer.wo + residual
        hidden = layer.mlp.forward(_norm(residual))
    return hidden + residual


def served_decode(world, layers, rpi, token, pos):
    """One decode step of the toy model through the runner (no hooks: decode has no schedule)."""
    slot = world.next_slot
    world.next_slot += 1
    world.req_to_token[rpi, pos] = slot
    seq = torch.tensor([pos + 1])
    fb = SimpleNamespace(
        forward_mode=world.FM.DECODE, batch_size=1, req_pool_indices=torch.tensor([rpi]),
        seq_lens=seq, seq_lens_cpu=seq.clone(), out_cache_loc=torch.tensor([slot]),
    )  # fmt: skip
    world.runner.plan(fb)
    hidden, residual = token.clone(), None
    for layer in layers:
        residual, x = layer_input(hidden, residual)
        q, k, v = layer.qkv(x, torch.tensor([pos]))
        o = world.runner.decode(q.view(1, -1), k.view(1, -1), v.view(1, -1), layer.attn, fb, True)
        residual = o.float() @ layer.wo + residual
        hidden = layer.mlp.forward(_norm(residual))
    return hidden + residual


@pytest.mark.parametrize(
    "thresh, cap, dense_layers, local_kv",
    [(0.2, 2, 3, "cached"), (0.2, 1, 3, "cached"), (0.2, 2, 1, "cached"), (0.2, 2, 3, "fresh")],
)
def test_promoted_heads_attend_every_key_in_prefill_and_decode(thresh, cap, dense_layers,
                                                               local_kv):  # fmt: skip
    from redknot.segcache.reuse import SegmentUse

    w, _, layers, tokens, entry, seg_kv = world_with_stored_segment(CLASSES, 3, N + 1, restore=cap)
    w.runner.dense_layers, w.runner.mass_thresh, w.runner.recent_n = dense_layers, 0.5, RECENT
    w.runner.skipped, w.runner.local_kv = "cached", local_kv
    w.runner.restore_thresh, w.runner.restore_edge = thresh, EDGE
    w.pool.promoted_resets.append(2)
    w.pool.cache.segments.acquire(entry)
    w.pool.segment_reads[2] = [SegmentUse(NEW, entry, prompt_len=N)]
    got = served(w, layers, 2, tokens[:N], hooked=True)
    want, promoted, kv, history = brute_force(
        w, layers, tokens[:N], seg_kv, thresh, cap, dense_layers, 0.5, local_kv
    )

    got_promoted = [{int(h) for h in w.pool.promoted[2, lid] if h >= 0} for lid in range(3)]
    assert got_promoted == promoted
    local_pairs = sum(len(w.layout.local_heads(lid)) for lid in range(3))
    assert 0 < sum(map(len, promoted)) < local_pairs, "the test needs some heads promoted, not all"
    if dense_layers < 2:
        assert history[-2].any(), "the test needs rows that leave before the last layer"
    assert SCHEDULE.held is None
    torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)
    # the restore columns hold the promoted heads' K/V as attended, at every token slot
    for lid, heads in enumerate(promoted):
        slots = w.req_to_token[2, :N].long()
        g = w.layout.num_global(lid)
        for r, h in enumerate(int(x) for x in w.pool.promoted[2, lid] if x >= 0):
            torch.testing.assert_close(w.pool.k_global[lid][slots, g + r].float(),
                                       kv[lid][0][:, h].float(), atol=2e-2, rtol=2e-2)  # fmt: skip

    step = served_decode(w, layers, 2, tokens[N:], N)
    torch.testing.assert_close(
        step, brute_decode(w, layers, tokens[N:], kv, promoted, N), atol=3e-2, rtol=3e-2
    )
    unrestored = brute_decode(w, layers, tokens[N:], kv, [set()] * 3, N)
    assert not torch.allclose(step, unrestored, atol=3e-2), "decode must see the promoted heads"


def test_a_new_request_in_the_slot_promotes_nothing_it_did_not_choose():
    """The slot's promoted heads are reset when a request takes it: a plain prompt after a
    restored one is computed as without restore (exactly: no promoted head)."""
    from redknot.segcache.reuse import SegmentUse

    w, _, layers, tokens, entry, _ = world_with_stored_segment(CLASSES, 3, N, restore=2)
    w.runner.restore_thresh, w.runner.restore_edge, w.runner.recent_n = 0.2, EDGE, RECENT
    w.pool.cache.segments.acquire(entry)
    w.pool.segment_reads[2] = [SegmentUse(NEW, entry, prompt_len=N)]
    served(w, layers, 2, tokens, hooked=True)
    assert (w.pool.promoted[2] >= 0).any()
    w.pool.segment_reads.pop(2)
    plain = torch.randn(9, tokens.shape[1], generator=torch.Generator().manual_seed(4))
    alone = served(w, layers, 5, plain, hooked=True)
    w.pool.promoted_resets.append(2)
    again = served(w, layers, 2, plain, hooked=True)
    assert not (w.pool.promoted[2] >= 0).any()
    assert torch.equal(again, alone)


def test_every_local_head_restored_is_the_all_global_forward():
    """The exact limit: threshold 0 with a restore column for every local head promotes them
    all, so a reusing prompt (no layer schedule) is computed bit for bit as the same prompt under a map
    with every head global and no reuse, and so is the decode step after it."""
    from redknot.segcache.reuse import SegmentUse

    w, _, layers, tokens, entry, _ = world_with_stored_segment(CLASSES, 3, N + 1, restore=3)
    w.runner.restore_thresh, w.runner.restore_edge, w.runner.recent_n = 0.0, EDGE, RECENT
    w.pool.cache.segments.acquire(entry)
    w.pool.segment_reads[2] = [SegmentUse(NEW, entry, prompt_len=N)]
    got = served(w, layers, 2, tokens[:N], hooked=True)
    assert all(
        {int(h) for h in w.pool.promoted[2, lid] if h >= 0} == set(w.layout.local_heads(lid))
        for lid in range(len(CLASSES))
    )
    dense, _, dense_layers, _, _, _ = world_with_stored_segment(("GGGG",) * 3, 3, N + 1)
    want = served(dense, dense_layers, 2, tokens[:N], hooked=True)
    assert torch.equal(got, want)
    step = served_decode(w, layers, 2, tokens[N:], N)
    assert torch.equal(step, served_decode(dense, dense_layers, 2, tokens[N:], N))


def test_only_requests_computed_whole_in_one_extend_are_probed():
    """A completing extend after a cached prefix (or an earlier chunk) is refused: its earlier
    tokens' local-head K/V is gone and their token slots may be shared. The probe of a whole
    prompt sees sink + window of each probed row, and marks the window's oldest edge."""
    from redknot.attention.ffn_schedule import SparseFfn
    from redknot.attention.restore import plan_restore
    from redknot.segcache.reuse import SegmentReads

    whole = SparseFfn(4, 0, 0, 20, 16, torch.arange(3, 15), index=0)
    after_prefix = SparseFfn(7, 20, 9, 11, 16, torch.arange(9, 15), index=1)
    tokens = torch.cat([torch.arange(3, 15), torch.arange(20, 26)])
    reads = SegmentReads(tokens, tokens, tokens, tokens, sparse=(whole, after_prefix),
                         tokens_cpu=tokens)  # fmt: skip
    qo = torch.tensor([0, 20, 31])
    plan = plan_restore(reads, [4, 7], qo, SINK, WINDOW, EDGE, "cpu")
    assert plan.refused == (7,) and [p.spec for p in plan.probes] == [whole]
    assert plan.token_req.tolist() == [4] * 12 + [7] * 6
    probe = plan.probes[0]
    keys = probe.key_rows.tolist()  # the sink, then every window position of a probed row
    assert keys == [0, 1, 2] + list(range(16 - WINDOW + 1, 20))
    for i, pos in enumerate(range(16, 20)):
        seen = [k for k, v in zip(keys, probe.visible[i].tolist()) if v]
        assert seen == [j for j in range(pos + 1) if j < SINK or pos - j < WINDOW]
        edge = [k for k, v in zip(keys, probe.at_edge[i].tolist()) if v]
        assert edge == [j for j in seen if j >= SINK and WINDOW - EDGE <= pos - j]
    assert plan_restore(SegmentReads(tokens, tokens, tokens, tokens, tokens_cpu=tokens), [4, 7],
                        qo, SINK, WINDOW, EDGE, "cpu") is None  # fmt: skip
