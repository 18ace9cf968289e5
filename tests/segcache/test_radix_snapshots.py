"""Prefix reuse with local-head snapshots, driven the way SGLang's scheduler drives it.

KV values are a deterministic function of (token prefix, position), so a request that reuses a
cached prefix must see exactly the values recomputation would produce, in both the global token
slots and its restored local-head ring.
"""

from __future__ import annotations

import random
from array import array
from types import SimpleNamespace

import pytest
import torch

from redknot.headmap import ModelShape, synthetic_map
from redknot.pool.kv_pool import RedknotKVPool, capture_rows
from redknot.pool.layout import HeadLayout

SHAPE = ModelShape(
    "LlamaForCausalLM", num_layers=2, num_kv_heads=2, num_attention_heads=2, head_dim=4
)
SINK, WINDOW = 2, 5


def kv_value(tokens, pos: int) -> float:
    """What a forward pass would store at ``pos`` after the prefix ``tokens[: pos + 1]``."""
    return float(hash(tuple(tokens[: pos + 1])) % 100003)


class Harness:
    """SGLang objects (req slots, allocator, our pool and cache) with a minimal scheduler."""

    def __init__(self, num_tokens=400, num_reqs=6, num_snapshots=3):
        from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
        from sglang.srt.plugins import load_plugins

        from redknot.segcache.radix import RedknotRadixCache

        load_plugins()  # the ReqToTokenPool.alloc hook queues ring restores
        hm = synthetic_map(SHAPE, 0.5, window=WINDOW, sink=SINK)
        self.layout = HeadLayout.from_head_map(hm)
        self.req_pool = ReqToTokenPool(num_reqs, 512, "cpu", False)
        self.pool = RedknotKVPool(
            num_tokens,
            1,
            torch.float32,
            self.layout,
            num_rings=num_reqs + 1,
            num_snapshots=num_snapshots,
            device="cpu",
        )
        self.alloc = TokenToKVPoolAllocator(num_tokens, torch.float32, "cpu", self.pool, False)
        params = CacheInitParams(
            disable=False,
            req_to_token_pool=self.req_pool,
            token_to_kv_pool_allocator=self.alloc,
            page_size=1,
        )
        self.cache = RedknotRadixCache(params, self.pool)
        self.req_pool.redknot_cache = self.cache

    def admit(self, tokens):
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        req = SimpleNamespace(
            origin_input_ids=array("q", tokens),
            output_ids=array("q"),
            extra_key=None,
            req_pool_idx=None,
            priority=0,
            cache_protected_len=0,
            inflight_middle_chunks=0,
            kv_committed_len=0,
        )
        req.get_fill_ids = lambda: req.origin_input_ids + req.output_ids
        m = self.cache.match_prefix(
            MatchPrefixParams(key=RadixKey(array("q", tokens[:-1])), req=req)
        )
        req.prefix_indices, req.last_node = m.device_indices, m.last_device_node
        req.cache_protected_len = len(req.prefix_indices)
        self.cache.inc_lock_ref(req.last_node)
        assert self.req_pool.alloc([req]) is not None
        return req

    def forward(self, req, upto: int):
        """Prefill positions [prefix, upto) of ``req`` as the backend does."""
        self.pool.pending.run(self.pool)  # the backend's plan runs queued copies first
        tokens = req.get_fill_ids()
        start = len(req.prefix_indices)
        slots = self.alloc.alloc(upto - start)
        assert slots is not None
        row = self.req_pool.req_to_token[req.req_pool_idx]
        row[:start] = req.prefix_indices.to(torch.int32)
        row[start:upto] = slots.to(torch.int32)
        self.check_visible(req, start)  # what this prefill attends from the cache
        job = self.pool.capture_jobs.get(req.req_pool_idx)
        capture = None
        if job is not None and start < job.position <= upto:
            capture = capture_rows(self.pool, job, req.req_pool_idx, start, 0)
            self.cache.capture_issued(req.req_pool_idx)
        if capture is not None:  # as the backend: from the ring before new tokens enter it
            dst_r, src_r, dst_n, src_n = (torch.tensor(x, dtype=torch.long) for x in capture)
            new = torch.stack(
                [
                    torch.full((SHAPE.num_kv_heads, 4), kv_value(tokens, start + i))
                    for i in range(upto - start)
                ]
            )
            for layer in range(self.layout.num_layers):
                self.pool.copy_local_rows(layer, dst_r, src_r)
                self.pool.write_local(layer, dst_n, new[src_n], new[src_n])
        for p in range(start, upto):
            val = torch.full((1, SHAPE.num_kv_heads, 4), kv_value(tokens, p))
            for layer in range(self.layout.num_layers):
                self.pool.write_global(layer, row[p : p + 1].long(), val, val)
                if p < SINK or p >= upto - WINDOW:
                    rows = self.pool.local_rows(torch.tensor([req.req_pool_idx]), torch.tensor([p]))
                    self.pool.write_local(layer, rows, val, val)
        req.prefix_indices = row[:upto].long().clone()

    def check_visible(self, req, prefix_len: int):
        tokens = req.get_fill_ids()
        row = self.req_pool.req_to_token[req.req_pool_idx]
        for layer in range(self.layout.num_layers):
            for p in range(prefix_len):
                want = kv_value(tokens, p)
                if self.layout.num_global(layer):
                    assert float(self.pool.k_global[layer][row[p]].mean()) == want
                if self.layout.num_local(layer) and (p < SINK or p >= prefix_len - WINDOW):
                    r = self.pool.local_rows(torch.tensor([req.req_pool_idx]), torch.tensor([p]))
                    assert float(self.pool.k_local[layer][r].mean()) == want, (p, prefix_len)

    def finish(self, req, length: int):
        self.cache.cache_finished_req(req, kv_len_to_handle=length)
        self.req_pool.free(req)


def test_second_turn_reuses_first_turn_exactly():
    h = Harness()
    t1 = list(range(1, 30))
    r1 = h.admit(t1)
    assert len(r1.prefix_indices) == 0
    h.forward(r1, len(t1))
    h.finish(r1, len(t1))
    assert h.cache.snapshots_in_use == 1
    t2 = t1 + [77, 78, 79]
    r2 = h.admit(t2)
    assert len(r2.prefix_indices) == len(t1)  # hit at the first turn's end
    h.forward(r2, len(t2))  # check_visible asserts the reused global + restored local KV
    h.finish(r2, len(t2))


def test_shared_prefix_is_captured_at_the_branch_and_then_reused():
    h = Harness()
    system = list(range(500, 560))  # a shared prefix no request ends at
    r = h.admit(system + [1, 2, 3])
    h.forward(r, 63)
    h.finish(r, 63)
    r = h.admit(system + [4, 5, 6, 7])  # matches 60 tokens, no snapshot there: captures it
    assert len(r.prefix_indices) == 0
    assert h.pool.capture_jobs[r.req_pool_idx].position == 60
    h.forward(r, 64)
    h.finish(r, 64)
    assert not h.pool.capture_jobs
    r = h.admit(system + [8, 9])  # reuses the captured branch point exactly
    assert len(r.prefix_indices) == 60
    h.forward(r, 62)
    h.finish(r, 62)


def test_match_inside_a_sequence_falls_back_to_the_last_snapshot():
    h = Harness()
    base = list(range(100, 140))
    r = h.admit(base[:20])
    h.forward(r, 20)
    h.finish(r, 20)  # snapshot at 20
    r = h.admit(base)
    assert len(r.prefix_indices) == 20
    h.forward(r, 40)
    h.finish(r, 40)  # snapshot at 40
    # shares 33 tokens with the cached 40-token sequence: reuse stops at the snapshot at 20
    r = h.admit(base[:33] + [1, 2, 3])
    assert len(r.prefix_indices) == 20
    h.forward(r, 36)
    h.finish(r, 36)


def test_random_workload_keeps_accounting_exact():
    rng = random.Random(0)
    h = Harness(num_tokens=600, num_reqs=4, num_snapshots=2)
    prefixes = [[rng.randrange(1, 50) for _ in range(rng.randrange(40, 60))] for _ in range(4)]
    hits = 0
    for step in range(60):
        toks = rng.choice(prefixes) + [rng.randrange(1, 50) for _ in range(rng.randrange(2, 20))]
        if rng.random() < 0.3:
            prefixes.append(toks)
        if h.alloc.available_size() < len(toks) + 10:  # the scheduler evicts before admitting
            from sglang.srt.mem_cache.base_prefix_cache import EvictParams

            h.cache.evict(EvictParams(num_tokens=len(toks) + 10))
        req = h.admit(toks)
        hits += len(req.prefix_indices) > 0
        h.forward(req, len(toks))
        h.finish(req, len(toks))
        assert h.cache.snapshots_in_use <= 2
        assert h.cache.protected_size() == 0  # every lock was released
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    h.cache.evict(EvictParams(num_tokens=10**6))
    assert h.alloc.available_size() == 600  # no token slot leaked or double-freed
    assert h.cache.snapshots_in_use == 0 and len(h.cache._free_snapshots) == 2
    assert h.req_pool.available_size() == 4
    assert hits >= 10, hits  # the workload did exercise reuse


@pytest.mark.parametrize("locked", [False, True])
def test_snapshot_eviction_skips_locked_nodes(locked):
    h = Harness(num_snapshots=1)
    a = list(range(1, 15))
    r = h.admit(a)
    h.forward(r, len(a))
    h.finish(r, len(a))
    holder = h.admit(a + [99])  # locks the node that carries the only snapshot
    assert len(holder.prefix_indices) == len(a)
    if not locked:
        h.forward(holder, len(a) + 1)
        h.finish(holder, len(a) + 1)  # takes the snapshot over (LRU, unlocked now)
    b = list(range(200, 215))
    r = h.admit(b)
    h.forward(r, len(b))
    h.finish(r, len(b))
    rb = h.admit(b + [5])
    assert (len(rb.prefix_indices) == len(b)) == (not locked)


def _idle_scheduler(h: Harness, num_tokens: int) -> SimpleNamespace:
    """What ``redknot.integration.segments.pool_state`` reads of SGLang's scheduler."""
    return SimpleNamespace(
        tree_cache=h.cache, token_to_kv_pool_allocator=h.alloc, req_to_token_pool=h.req_pool,
        max_total_num_tokens=num_tokens, running_batch=SimpleNamespace(reqs=[]), waiting_queue=[],
    )  # fmt: skip


def test_pool_state_reports_held_slots_and_returns_to_idle(monkeypatch):
    """The ``redknot_pool`` server state counts what requests and the tree hold, and shows an
    empty pool once they are done and the tree is evicted (what the load test reads)."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    from redknot.integration.segments import pool_state

    h = Harness(num_tokens=600, num_reqs=4, num_snapshots=2)
    sched = _idle_scheduler(h, 600)
    toks = list(range(1, 41))
    req = h.admit(toks)
    h.forward(req, len(toks))
    busy = pool_state(sched)
    assert busy["token_slots_free"] == 560 and busy["request_slots_free"] == 3
    h.finish(req, len(toks))
    done = pool_state(sched)
    assert done["request_slots_free"] == 4
    assert done["tree_evictable_tokens"] == 40 and done["snapshots_in_use"] == 1
    assert done["pending_ring_copies"] == 1  # the save into the snapshot runs at the next forward
    h.cache.evict(EvictParams(num_tokens=10**6))
    idle = pool_state(sched)
    assert idle == {
        "token_slots_total": 600, "token_slots_free": 600, "request_slots_total": 4,
        "request_slots_free": 4, "running_requests": 0, "waiting_requests": 0,
        "snapshots_total": 2, "snapshots_in_use": 0, "snapshots_free": 2, "capture_jobs": 0,
        "segment_writes": 0, "segment_reads": 0, "pending_ring_copies": 0,
        "tree_evictable_tokens": 0, "tree_protected_tokens": 0,
    }  # fmt: skip
    # and the server state carries it next to the store's stats, encodable for SGLang's IPC
    import msgspec
    from sglang.srt.managers.io_struct import GetInternalStateReqOutput

    from redknot.config import RedknotConfig
    from redknot.integration.segments import _after_get_internal_state

    config = RedknotConfig.from_mapping({"all_global": True, "window": 32}, source="test")
    monkeypatch.setenv("REDKNOT_RESOLVED_CONFIG", config.to_json())
    out = _after_get_internal_state(GetInternalStateReqOutput(internal_state={}), sched, None)
    assert out.internal_state["redknot_pool"] == idle
    assert out.internal_state["redknot_segments"] == h.cache.segments.stats()
    assert out.internal_state["redknot_config"]["window"] == 32  # the server's own options
    msgspec.msgpack.encode(out.internal_state)


def test_reset_drops_queued_copies_of_the_snapshots_it_frees():
    """A flush while a finished request's ring save is still queued leaves nothing queued: the
    save would write a snapshot slot that the reset has freed for reuse."""
    from redknot.integration.segments import pool_state

    h = Harness(num_tokens=600, num_reqs=4, num_snapshots=2)
    sched = _idle_scheduler(h, 600)
    toks = list(range(1, 41))
    req = h.admit(toks)
    h.forward(req, len(toks))
    h.finish(req, len(toks))
    assert len(h.pool.pending) == 1
    h.cache.reset()  # as SGLang's Scheduler.flush_cache: the tree, then the slot pools
    h.req_pool.clear()
    h.alloc.clear()
    state = pool_state(sched)
    assert state["pending_ring_copies"] == 0 and state["capture_jobs"] == 0
    assert state["snapshots_free"] == 2 and state["token_slots_free"] == 600
    # and the cache serves again from scratch: the same prompt is a miss, then a hit
    req = h.admit(toks)
    assert len(req.prefix_indices) == 0
    h.forward(req, len(toks))
    h.finish(req, len(toks))
    again = h.admit(toks + [7])
    assert len(again.prefix_indices) == 40
    h.forward(again, 41)  # checks every cached position against what recomputation gives
