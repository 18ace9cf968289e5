"""The backend's SegPaged path over the real pool: chunked prefill, prefix continuation and
decode (eager and graph-style planning) against a dense reference with head-class visibility.
Runs the Triton kernels under the interpreter on the CPU."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from redknot.attention.segpaged_runner import SegPagedRunner
from redknot.pool.kv_pool import RedknotKVPool
from redknot.pool.layout import HeadLayout

D = 64
SINK, WINDOW = 3, 6


def reference(q, keys, values, positions, layout, layer, scale):
    """q: [n, Hq, D] at absolute ``positions``; keys/values: [L, H, D] of the whole request."""
    grp = layout.group_size
    out = torch.empty_like(q, dtype=torch.float32)
    for i, pos in enumerate(positions):
        for hq in range(q.shape[1]):
            h = hq // grp
            j = torch.arange(pos + 1)
            if layout.classes[layer][h] == "L":
                j = j[(j < SINK) | (pos - j < WINDOW)]
            s = (keys[j, h].float() @ q[i, hq].float()) * scale
            out[i, hq] = torch.softmax(s, 0) @ values[j, h].float()
    return out


class World:
    def __init__(self, classes, grp, dtype, seed=0, segment_fraction=0.0, segment_heads="local",
                 restore=0):  # fmt: skip
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        self.FM = ForwardMode
        self.layout = HeadLayout(
            classes=classes, num_q_heads=len(classes[0]) * grp, head_dim=D, window=WINDOW,
            sink=SINK, restore=restore,
        )  # fmt: skip
        self.dtype = dtype
        plan = None
        if segment_fraction:
            from redknot.pool.segment_region import plan_segments

            plan = plan_segments([self.layout], dtype, 10**6, segment_fraction, segment_heads)
        self.pool = RedknotKVPool(
            600, 1, dtype, self.layout, num_rings=6, num_snapshots=1, device="cpu",
            segment_plan=plan,
        )  # fmt: skip
        self.req_to_token = torch.zeros((6, 200), dtype=torch.int32)
        self.runner = SegPagedRunner(
            self.layout,
            self.pool,
            self.req_to_token,
            max_batch_size=6,
            max_context_len=200,
            device=torch.device("cpu"),
        )
        self.runner.init_cuda_graph_state(max_bs=6, max_num_tokens=6)
        self.g = torch.Generator().manual_seed(seed)
        self.next_slot = 1
        self.hist = {}  # (rpi, layer) -> (keys [L,H,D], values)
        self.lens = {}

    def rand(self, *shape):
        return torch.randn(*shape, generator=self.g).to(self.dtype)

    def step(self, mode, reqs, new_lens, graph=None):
        """One forward over ``reqs`` (req_pool_idx) adding ``new_lens`` tokens each."""
        H, Hq = self.layout.num_kv_heads, self.layout.num_q_heads
        prefix = [self.lens.get(r, 0) for r in reqs]
        locs = []
        for r, p, e in zip(reqs, prefix, new_lens):
            slots = torch.arange(self.next_slot, self.next_slot + e, dtype=torch.int32)
            self.next_slot += e
            self.req_to_token[r, p : p + e] = slots
            locs.append(slots.long())
            self.lens[r] = p + e
        seq = torch.tensor([self.lens[r] for r in reqs])
        fb = SimpleNamespace(
            forward_mode=mode,
            batch_size=len(reqs),
            req_pool_indices=torch.tensor(reqs, dtype=torch.int64),
            seq_lens=seq,
            seq_lens_cpu=seq.clone(),
            extend_prefix_lens_cpu=prefix,
            extend_seq_lens_cpu=list(new_lens),
            out_cache_loc=torch.cat(locs),
        )
        if graph is None:
            self.runner.plan(fb)
        else:  # graph-style: static buffers refilled per replay, plan kept per batch size
            if graph == "capture":
                self.static = (fb.req_pool_indices.clone(), fb.seq_lens.clone())
            self.static[0].copy_(fb.req_pool_indices)
            self.static[1].copy_(fb.seq_lens)
            fb.req_pool_indices, fb.seq_lens = self.static
            self.runner.plan(fb, for_graph=True, in_capture=graph == "capture")
            self.runner.plan_in_graph(fb)
        T = sum(new_lens)
        for layer in range(self.layout.num_layers):
            q, k, v = self.rand(T, Hq, D), self.rand(T, H, D), self.rand(T, H, D)
            lay = SimpleNamespace(
                layer_id=layer,
                scaling=D**-0.5,
                logit_cap=0,
                is_cross_attention=False,
                qk_head_dim=D,
                v_head_dim=D,
            )
            run = self.runner.decode if mode.is_decode() else self.runner.extend
            out = run(q.view(T, -1), k.view(T, -1), v.view(T, -1), lay, fb, True).view(T, Hq, D)
            start = 0
            for r, p, e in zip(reqs, prefix, new_lens):
                old_k, old_v = self.hist.get((r, layer), (k[:0], v[:0]))
                keys = torch.cat([old_k, k[start : start + e]])
                vals = torch.cat([old_v, v[start : start + e]])
                self.hist[(r, layer)] = (keys, vals)
                want = reference(
                    q[start : start + e], keys, vals, range(p, p + e), self.layout, layer, D**-0.5
                )
                torch.testing.assert_close(
                    out[start : start + e].float(), want, atol=2e-2, rtol=2e-2
                )
                start += e


@pytest.mark.parametrize(
    "classes, grp",
    [(("GLLL", "LLGL"), 2), (("LLLL", "GGGG"), 1), (("GL", "LG"), 4)],
)
@pytest.mark.parametrize("graph", [False, True])
def test_prefill_chunks_and_decode_match_reference(classes, grp, graph):
    w = World(classes, grp, torch.bfloat16)
    E, D_ = w.FM.EXTEND, w.FM.DECODE
    w.step(E, [3, 1], [17, 5])  # prefill; request 3 longer than sink + window
    w.step(E, [3, 5], [11, 2])  # request 3 continues (chunked prefill); a new request 5
    for i in range(4):
        mode = None if not graph else ("capture" if i == 0 else "replay")
        w.step(D_, [1, 3, 5], [1, 1, 1], graph=mode)  # decode past the window
    assert w.lens == {3: 32, 1: 9, 5: 6}


def test_ring_holds_only_sink_and_window():
    w = World(("GLLL", "LLGL"), 2, torch.float16)
    w.step(w.FM.EXTEND, [2], [40])
    keys, _ = w.hist[(2, 0)]
    rows = w.pool.local_rows(torch.tensor([2] * 40), torch.arange(40))
    kept = [p for p in range(40) if p < SINK or p >= 40 - WINDOW]
    for p in kept:  # what the ring holds for local head 1 of layer 0 (column 0)
        torch.testing.assert_close(w.pool.k_local[0][rows[p], 0], keys[p, 1])
    assert w.pool.ring_len == SINK + WINDOW


def test_extend_captures_a_snapshot_at_the_branch_point():
    from redknot.pool.kv_pool import CaptureJob

    w = World(("GLLL", "LLGL"), 2, torch.bfloat16)
    w.step(w.FM.EXTEND, [2], [20])  # positions 0..19 of request 2
    slot = w.pool.snapshot_slot(0)
    w.pool.capture_jobs[2] = CaptureJob(position=25, slot=slot)
    w.step(w.FM.EXTEND, [2], [12])  # computes 20..31; the snapshot holds the state at 25
    assert not w.pool.capture_jobs
    for layer in range(2):
        keys, _ = w.hist[(2, layer)]
        local = w.layout.local_heads(layer)
        for p in [q for q in range(25) if q < SINK or q >= 25 - WINDOW]:
            row = w.pool.local_rows(torch.tensor(slot), torch.tensor(p))
            torch.testing.assert_close(w.pool.k_local[layer][row], keys[p, local])


def test_extend_fills_a_segment_being_registered():
    """A registration's prefill, in two chunks beside another request, writes the local heads'
    K/V of every segment token to the segment's rows."""
    from redknot.segcache.registration import WriteJob
    from redknot.segcache.store import SegmentStore

    w = World(("GLLL", "LLGL"), 2, torch.bfloat16, segment_fraction=0.1)
    store = SegmentStore.for_pool(w.pool)
    w.pool.cache = SimpleNamespace(segments=store)
    entry = store.register("kb", list(range(30)), pin=False)
    w.pool.segment_jobs[4] = WriteJob([(entry, 0)])
    w.step(w.FM.EXTEND, [1, 4], [7, 18])
    w.step(w.FM.EXTEND, [4], [12])
    assert not w.pool.segment_jobs and store.lookup("kb", list(range(30))) is not None
    for layer in range(2):
        keys, values = w.hist[(4, layer)]
        local = w.layout.local_heads(layer)
        got_k, got_v = w.pool.segments.read(layer, entry.rows())
        assert torch.equal(got_k, keys[:, local]) and torch.equal(got_v, values[:, local])


def test_a_capture_after_its_context_stores_its_keys_rotated_back_to_positions_from_0():
    """A capture whose prompt is 6 tokens of context then its 30-token segment, prefilled in
    three chunks (4 context tokens beside another request; 2 context and 16 segment tokens; 14
    segment tokens): the segment's rows hold its values as computed and its keys re-rotated
    from prompt positions 6..35 to 0..29; the context is not stored."""
    from redknot.kernels.rope_align import alignable_rope
    from redknot.kernels.rope_reference import alignment_tolerance, delta_rotate, sglang_rope
    from redknot.segcache.registration import WriteJob
    from redknot.segcache.store import SegmentStore

    w = World(("GLLL", "LLGL"), 2, torch.bfloat16, segment_fraction=0.1)
    store = SegmentStore.for_pool(w.pool)
    w.pool.cache = SimpleNamespace(segments=store)
    w.runner.rope = alignable_rope(sglang_rope(D, D, 512, 10000.0, True))
    entry = store.register("kb", list(range(30)), pin=False)
    w.pool.segment_jobs[4] = WriteJob([(entry, 6)])
    w.step(w.FM.EXTEND, [1, 4], [7, 4])
    assert w.pool.segment_jobs[4].written == 4
    w.step(w.FM.EXTEND, [4], [18])
    assert w.pool.segment_jobs[4].written == 22
    w.step(w.FM.EXTEND, [4], [14])
    assert not w.pool.segment_jobs and store.lookup("kb", list(range(30))) is not None
    cache = w.runner.rope.cos_sin_cache
    for layer in range(2):
        keys, values = (x[6:] for x in w.hist[(4, layer)])  # prompt rows 6..35
        local = w.layout.local_heads(layer)
        want = delta_rotate(
            keys[:, local], torch.arange(6, 36), torch.arange(30), cache, is_neox=True
        ).to(torch.bfloat16)
        got_k, got_v = w.pool.segments.read(layer, entry.rows())
        assert ((got_k.float() - want.float()).abs() <= alignment_tolerance(want, D, True)).all()
        assert not torch.equal(got_k, keys[:, local])  # rotated, not copied
        assert torch.equal(got_v, values[:, local])


def test_extend_reuses_a_stored_segment_at_a_new_position():
    """A request holding a stored segment at tokens 5..14, prefilled in two chunks: local heads
    of those tokens attend the cached K/V re-rotated from positions 0..9 to 5..14; global heads
    and the other tokens keep their fresh K/V (the attention check in ``World.step`` runs on
    the K/V as served)."""
    from redknot.kernels.rope_align import alignable_rope
    from redknot.kernels.rope_reference import alignment_tolerance, delta_rotate, sglang_rope
    from redknot.segcache.registration import WriteJob
    from redknot.segcache.reuse import SegmentUse
    from redknot.segcache.store import SegmentStore

    w = World(("GLLL", "LLGL"), 2, torch.bfloat16, segment_fraction=0.1)
    store = SegmentStore.for_pool(w.pool)
    w.pool.cache = SimpleNamespace(segments=store)
    w.runner.rope = alignable_rope(sglang_rope(D, D, 512, 10000.0, True))
    ids = list(range(50, 60))
    entry = store.register("kb", ids, pin=False)
    w.pool.segment_jobs[4] = WriteJob([(entry, 0)])
    w.step(w.FM.EXTEND, [4], [10])  # the segment alone, positions 0..9
    cached = [w.hist[(4, layer)] for layer in range(2)]
    store.acquire(entry)
    w.pool.segment_reads[2] = [SegmentUse(5, entry)]
    w.step(w.FM.EXTEND, [2], [8])  # tokens 0..7: segment tokens 5..7
    w.step(w.FM.EXTEND, [2], [10])  # tokens 8..17: segment tokens 8..14
    cache = w.runner.rope.cos_sin_cache
    for layer in range(2):
        keys, values = w.hist[(2, layer)]
        local, glob = w.layout.local_heads(layer), w.layout.global_heads(layer)
        want = delta_rotate(
            cached[layer][0][:, local], torch.arange(10), torch.arange(5, 15), cache, is_neox=True
        ).to(torch.bfloat16)
        diff = (keys[5:15, local].float() - want.float()).abs()
        assert (diff <= alignment_tolerance(want, D, True)).all()
        assert torch.equal(values[5:15, local], cached[layer][1][:, local])
        assert not torch.equal(keys[5:15, glob], cached[layer][0][:, glob])  # fresh


@pytest.mark.parametrize("dense_layers, thresh", [(1, 0.5), (1, 1.0), (2, 0.5), (0, 0.3)])
def test_extend_completing_a_reusing_prompt_schedules_the_deep_layers_ffn(dense_layers, thresh):
    """Prompt = 3 new tokens, a stored 10-token segment, a 5-token question; layers from
    ``dense_layers`` run the FFN on the segment tokens the question attends to most (global
    heads' mass, brute force here); mass_thresh 1 or dense_layers = layers skip nothing."""
    from redknot.attention.ffn_schedule import SCHEDULE
    from redknot.kernels.rope_align import alignable_rope
    from redknot.kernels.rope_reference import sglang_rope
    from redknot.segcache.registration import WriteJob
    from redknot.segcache.reuse import SegmentUse
    from redknot.segcache.store import SegmentStore

    from .test_ffn_schedule import brute_mass, brute_skip

    w = World(("GLLL", "LLGL"), 2, torch.bfloat16, segment_fraction=0.1)
    store = SegmentStore.for_pool(w.pool)
    w.pool.cache = SimpleNamespace(segments=store)
    w.runner.rope = alignable_rope(sglang_rope(D, D, 512, 10000.0, True))
    w.runner.dense_layers, w.runner.mass_thresh, w.runner.recent_n = dense_layers, thresh, 4
    w.runner.skipped = "residual"  # rows are chosen per layer; none leaves (no decoder hook)
    entry = store.register("kb", list(range(10)), pin=False)
    w.pool.segment_jobs[4] = WriteJob([(entry, 0)])
    w.step(w.FM.EXTEND, [4], [10])
    store.acquire(entry)
    w.pool.segment_reads[2] = [SegmentUse(3, entry, prompt_len=18)]
    probes = {}
    schedule = w.runner._schedule_ffn

    def spy(lid, q, lse, scale, reads):
        probes[lid] = (q.clone(), scale)
        schedule(lid, q, lse, scale, reads)

    w.runner._schedule_ffn = spy
    w.step(w.FM.EXTEND, [2], [18])
    assert sorted(probes) == list(range(dense_layers, 2))
    for layer in range(2):
        rows = SCHEDULE.rows.get(layer)
        if layer < dense_layers or thresh == 1.0:
            assert rows is None
            continue
        q, scale = probes[layer]
        keys, _ = w.hist[(2, layer)]
        glob = w.layout.global_heads(layer)
        qh = [h * 2 + j for h in glob for j in range(2)]
        pos = torch.arange(13, 18)
        mass = brute_mass(
            q[13:18][:, qh].float().view(5, len(glob), 2, D), keys[:, glob].float(), pos, scale
        )
        skip = brute_skip(mass, list(range(3, 13)), thresh)
        assert skip, "the test needs a case that skips some rows"
        assert rows.tolist() == [r for r in range(18) if r not in skip]


def test_segment_reuse_refuses_a_cache_dtype_other_than_the_models():
    SegPagedRunner.check_segment_dtype(torch.bfloat16, torch.bfloat16)
    with pytest.raises(ValueError, match="--kv-cache-dtype auto"):
        SegPagedRunner.check_segment_dtype(torch.float16, torch.bfloat16)
