"""A registration request's prefill fills its segment (write jobs, chunked extends, abort); a
marked request finds stored segments and reads them (hits, references, prefix-covered tokens)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from redknot.api.marks import SegmentMark, encode_marks
from redknot.headmap import ModelShape, synthetic_map
from redknot.pool.kv_pool import RedknotKVPool
from redknot.pool.layout import HeadLayout
from redknot.pool.segment_region import plan_segments
from redknot.segcache import registration, reuse
from redknot.segcache.entry import segment_id
from redknot.segcache.store import SegmentStore

SHAPE = ModelShape(
    "LlamaForCausalLM", num_layers=3, num_kv_heads=4, num_attention_heads=8, head_dim=8
)


def make_world():
    layout = HeadLayout.from_head_map(synthetic_map(SHAPE, 0.25, window=8, sink=2))
    plan = plan_segments([layout], torch.float32, 200_000, 0.5, "local", page_tokens=4)
    pool = RedknotKVPool(
        64, 1, torch.float32, layout, num_rings=4, num_snapshots=1, device="cpu", segment_plan=plan
    )
    pool.cache = SimpleNamespace(segments=SegmentStore.for_pool(pool), pool=pool)
    return layout, pool, pool.cache


def registration_req(ids, rpi, namespace="kb", pin=True, register=True):
    mark = SegmentMark(0, len(ids), namespace, segment_id(namespace, ids))
    params = encode_marks([mark], register=register, pin=pin)
    return SimpleNamespace(
        origin_input_ids=list(ids), sampling_params=SimpleNamespace(custom_params=params),
        req_pool_idx=rpi,
    )  # fmt: skip


def write_extend(pool, rpis, prefix, lens, k, v):
    """What the backend does for one extend: plan, then write every layer's K/V."""
    writes = registration.plan_writes(pool, rpis, prefix, lens, "cpu")
    if writes is not None:
        for layer in range(SHAPE.num_layers):
            pool.segments.write(layer, writes.rows_gpu, k[layer][writes.tokens_gpu],
                                v[layer][writes.tokens_gpu])  # fmt: skip
    return writes


def test_chunked_registration_fills_the_segment_then_makes_it_ready():
    layout, pool, cache = make_world()
    store = cache.segments
    ids = list(range(100, 113))  # 13 tokens: 4 pages of 4
    req = registration_req(ids, rpi=2)
    other = registration_req([7, 8, 9], rpi=1, register=False)  # an ordinary marked request
    registration.start(cache, req)
    registration.start(cache, other)
    assert set(pool.segment_jobs) == {2}
    assert store.lookup("kb", ids) is None  # not ready while being written
    k = [torch.randn(20, 4, 8) for _ in range(3)]
    v = [torch.randn(20, 4, 8) for _ in range(3)]
    # batch: request 1 (3 tokens) then request 2's first chunk (5 tokens)
    w = write_extend(pool, [1, 2], [0, 0], [3, 5], k, v)
    assert w.tokens_gpu.tolist() == [3, 4, 5, 6, 7]
    # second chunk: request 2's tokens 5..12 at batch offset 0
    k2 = [torch.randn(8, 4, 8) for _ in range(3)]
    v2 = [torch.randn(8, 4, 8) for _ in range(3)]
    write_extend(pool, [2], [5], [8], k2, v2)
    assert not pool.segment_jobs
    entry = store.lookup("kb", ids)
    assert entry is not None and entry.pinned and store.stats()["referenced"] == 0
    rows = entry.rows()
    for layer in range(3):
        local = layout.local_heads(layer)
        want_k = torch.cat([k[layer][3:8], k2[layer]])[:, local]
        want_v = torch.cat([v[layer][3:8], v2[layer]])[:, local]
        got_k, got_v = pool.segments.read(layer, rows)
        assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    store.check()


def test_a_capture_after_its_context_writes_only_its_segment_with_its_positions():
    """A capture's prompt: 6 context tokens, then its 13-token segment, in two chunks (the
    first ends 2 tokens into the segment): the store holds the segment's tokens; each write
    says the position its key was computed at and the segment position it goes to."""
    layout, pool, cache = make_world()
    store = cache.segments
    context, ids = [1, 2, 3, 4, 5, 6], list(range(100, 113))
    mark = SegmentMark(6, 19, "auto", segment_id("auto", ids))
    req = SimpleNamespace(
        origin_input_ids=context + ids,
        sampling_params=SimpleNamespace(
            custom_params=encode_marks([mark], register=True, capture=True)
        ),
        req_pool_idx=2,
    )
    registration.start(cache, req)
    ((part, at),) = pool.segment_jobs[2].parts
    assert at == 6 and part.num_tokens == 13
    k = [torch.randn(10, 4, 8) for _ in range(3)]
    w = write_extend(pool, [1, 2], [0, 0], [2, 8], k, k)  # another request, then 0..7
    assert w.tokens_gpu.tolist() == [8, 9] and w.pos_gpu.tolist() == [[6, 7], [0, 1]]
    k2 = [torch.randn(11, 4, 8) for _ in range(3)]
    w = write_extend(pool, [2], [8], [11], k2, k2)
    assert w.tokens_gpu.tolist() == list(range(11))
    assert w.pos_gpu.tolist() == [list(range(8, 19)), list(range(2, 13))]
    assert not pool.segment_jobs
    entry = store.lookup("auto", ids)
    assert entry is not None and entry.num_tokens == 13 and not entry.pinned
    assert store.lookup("auto", context + ids) is None
    got_k, _ = pool.segments.read(0, entry.rows())
    local = layout.local_heads(0)
    assert torch.equal(got_k, torch.cat([k[0][8:10], k2[0]])[:, local])  # rotated by the backend
    # a registration without a context says no positions
    registration.start(cache, registration_req([7, 8, 9], rpi=3))
    assert write_extend(pool, [3], [0], [3], k, k).pos_gpu is None
    store.check()


def test_a_capture_of_consecutive_segments_writes_each_one_a_stored_one_not():
    """A capture's prompt: 3 context tokens, then segments A (5), B (4, stored already) and C
    (6), in two extends: A and C are written, each with its own shift back to position 0, B is
    only computed (the context of C); A is ready as soon as its last token is computed."""
    _, pool, cache = make_world()
    store = cache.segments
    a, b, c = [40, 41, 42, 43, 44], [50, 51, 52, 53], [60, 61, 62, 63, 64, 65]
    registration.start(cache, registration_req(b, rpi=1))
    kb = [torch.randn(4, 4, 8) for _ in range(3)]
    write_extend(pool, [1], [0], [4], kb, kb)
    prompt = [1, 2, 3] + a + b + c
    marks = [SegmentMark(3, 8, "kb", segment_id("kb", a)), SegmentMark(8, 12, "kb", segment_id("kb", b)),
             SegmentMark(12, 18, "kb", segment_id("kb", c))]  # fmt: skip
    req = SimpleNamespace(
        origin_input_ids=prompt,
        sampling_params=SimpleNamespace(
            custom_params=encode_marks(marks, register=True, capture=True)
        ),
        req_pool_idx=2,
    )
    registration.start(cache, req)
    assert [(e.num_tokens, at) for e, at in pool.segment_jobs[2].parts] == [(5, 3), (6, 12)]
    k = [torch.randn(18, 4, 8) for _ in range(3)]
    w = write_extend(pool, [2], [0], [10], k, k)  # context, A, half of B
    assert w.tokens_gpu.tolist() == [3, 4, 5, 6, 7]
    assert w.pos_gpu.tolist() == [[3, 4, 5, 6, 7], [0, 1, 2, 3, 4]]
    assert store.lookup("kb", a) is not None and store.lookup("kb", c) is None
    k2 = [torch.randn(8, 4, 8) for _ in range(3)]
    w = write_extend(pool, [2], [10], [8], k2, k2)  # the rest of B, C
    assert w.tokens_gpu.tolist() == [2, 3, 4, 5, 6, 7]
    assert w.pos_gpu.tolist() == [list(range(12, 18)), list(range(6))]
    assert not pool.segment_jobs and store.lookup("kb", c) is not None
    assert store.stats()["referenced"] == 0
    store.check()


def test_registering_a_stored_segment_writes_nothing():
    _, pool, cache = make_world()
    ids = [5, 6, 7, 8, 9]
    registration.start(cache, registration_req(ids, rpi=1))
    k = [torch.randn(5, 4, 8) for _ in range(3)]
    write_extend(pool, [1], [0], [5], k, k)
    registration.start(cache, registration_req(ids, rpi=3, pin=False))
    assert not pool.segment_jobs
    assert cache.segments.stats()["referenced"] == 0
    assert cache.segments.lookup("kb", ids).pinned is False  # the latest registration's pin


@pytest.mark.parametrize("how", ["aborted", "prefix reused"])
def test_an_unfinished_registration_leaves_nothing_behind(how):
    _, pool, cache = make_world()
    store = cache.segments
    ids = list(range(30, 40))
    registration.start(cache, registration_req(ids, rpi=2))
    assert store.stats()["bytes_used"] > 0
    k = [torch.randn(10, 4, 8) for _ in range(3)]
    write_extend(pool, [2], [0], [4], k, k)
    if how == "aborted":
        registration.finish(pool, 2)
    else:  # an extend that does not continue where the writes stopped cannot fill it
        assert write_extend(pool, [2], [6], [4], k, k) is None
    assert not pool.segment_jobs
    assert store.lookup("kb", ids) is None and store.list("kb") == []
    assert store.stats()["bytes_used"] == 0 and store.stats()["referenced"] == 0
    store.check()


def test_malformed_marks_are_not_a_registration():
    req = registration_req([1, 2, 3], rpi=0)
    req.origin_input_ids = [1, 2]  # the mark no longer fits the prompt
    assert registration.is_registration(req) is False
    assert registration.is_registration(None) is False


def test_a_marked_request_reads_stored_segments_where_its_extends_compute_them():
    _, pool, cache = make_world()
    store = cache.segments
    doc_a, doc_b = list(range(200, 209)), list(range(300, 306))
    for rpi, ids in ((1, doc_a), (3, doc_b)):
        registration.start(cache, registration_req(ids, rpi))
        k = [torch.randn(len(ids), 4, 8) for _ in range(3)]
        write_extend(pool, [rpi], [0], [len(ids)], k, k)
    # prompt: 4 new tokens, doc_a at 4..12, 2 new, doc_b at 15..20, an unknown segment at 21..23
    prompt = [1, 2, 3, 4] + doc_a + [5, 6] + doc_b + [7, 8, 9]
    marks = [(4, 13, doc_a), (15, 21, doc_b), (21, 24, [7, 8, 9])]
    params = encode_marks([SegmentMark(s, e, "kb", segment_id("kb", ids)) for s, e, ids in marks])
    req = SimpleNamespace(origin_input_ids=prompt, rid="r",
                          sampling_params=SimpleNamespace(custom_params=params), req_pool_idx=2)  # fmt: skip
    reuse.start(cache, req)
    assert store.stats()["hits"] == 2 and store.stats()["misses"] == 1
    assert store.stats()["referenced"] == 2
    # an exact-prefix hit covered tokens 0..5; this extend computes 6..23 (batch offset 3)
    reads = reuse.plan_reads(pool, [0, 2], [0, 6], [3, 18], "cpu")
    want_on = list(range(6, 13)) + list(range(15, 21))
    assert reads.pos_on_gpu.tolist() == want_on
    assert reads.pos_off_gpu.tolist() == list(range(2, 9)) + list(range(6))
    assert reads.tokens_gpu.tolist() == [3 + p - 6 for p in want_on]
    a, b = store.lookup("kb", doc_a), store.lookup("kb", doc_b)
    assert reads.rows_gpu.tolist() == a.rows()[2:].tolist() + b.rows().tolist()
    columns = (reads.tokens_gpu, reads.rows_gpu, reads.pos_off_gpu, reads.pos_on_gpu)
    assert all(x.dtype == torch.int64 for x in columns + (reads.tokens_cpu, reads.pos_off_cpu))
    assert reuse.plan_reads(pool, [2], [24], [1], "cpu") is None  # decode-like step: nothing
    reuse.finish(cache, 2)
    assert store.stats()["referenced"] == 0 and not pool.segment_reads
    store.check()
