"""The segment region in the pool and its budget, the options that size it, the store on the
radix cache, and the ``get_internal_state`` hook."""

from __future__ import annotations

import argparse
import json
from types import SimpleNamespace

import pytest
import torch

from redknot import envs
from redknot.config import RedknotConfig, RedknotConfigError
from redknot.headmap import ModelShape, synthetic_map
from redknot.pool import sizing
from redknot.pool.kv_pool import RedknotKVPool, bytes_per_ring
from redknot.pool.layout import HeadLayout
from redknot.pool.segment_region import bytes_per_segment_token, plan_segments
from redknot.segcache.store import SegmentStore

SHAPE = ModelShape(
    "LlamaForCausalLM", num_layers=3, num_kv_heads=4, num_attention_heads=8, head_dim=8
)
HF_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 512,
    "num_attention_heads": 8,
    "num_hidden_layers": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 4096,
}


def layout_of(fraction: float, **kw) -> HeadLayout:
    return HeadLayout.from_head_map(synthetic_map(SHAPE, fraction, window=8, sink=2), **kw)


def test_bytes_per_segment_token_counts_the_kept_heads():
    layout = layout_of(0.25)  # 3 of 12 heads global
    local = sum(layout.num_local(i) for i in range(3))
    assert local == 9
    assert bytes_per_segment_token(layout, torch.bfloat16, "local") == 2 * 9 * 8 * 2
    assert bytes_per_segment_token(layout, torch.bfloat16, "all") == 2 * 12 * 8 * 2
    assert bytes_per_segment_token(layout_of(1.0), torch.bfloat16, "local") == 0


def test_plan_takes_whole_pages_of_the_fraction():
    layout = layout_of(0.25)
    per_token = bytes_per_segment_token(layout, torch.float32, "local")
    plan = plan_segments([layout], torch.float32, 10**7, 0.1, "local", page_tokens=16)
    assert plan.num_pages == 10**6 // (16 * per_token)
    assert plan.reserved_bytes == plan.num_pages * 16 * per_token <= 10**6
    assert plan.capacity_tokens == plan.num_pages * 16
    assert plan_segments([layout], torch.float32, 10**7, 0.0, "local").num_pages == 0
    # every head global and only local heads kept: nothing to store, nothing reserved
    off = plan_segments([layout_of(1.0)], torch.float32, 10**7, 0.1, "local")
    assert off.num_pages == 0 and off.reserved_bytes == 0
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        plan_segments([layout], torch.float32, 10**7, 1.0, "local")


def test_tp_ranks_get_the_same_page_count():
    ranks = [layout_of(0.25, tp_size=2, tp_rank=r) for r in range(2)]
    costs = [bytes_per_segment_token(lay, torch.float16, "local") for lay in ranks]
    plan = plan_segments(ranks, torch.float16, 10**7, 0.1, "local")
    assert plan.reserved_bytes == plan.num_pages * plan.page_tokens * max(costs)
    assert plan == plan_segments(ranks[::-1], torch.float16, 10**7, 0.1, "local")


def make_pool(layout: HeadLayout, plan=None) -> RedknotKVPool:
    return RedknotKVPool(
        32, 1, torch.float32, layout, num_rings=3, num_snapshots=1, device="cpu", segment_plan=plan
    )


@pytest.mark.parametrize("which", ["local", "all"])
def test_pool_region_stores_the_chosen_heads_at_entry_rows(which):
    layout = layout_of(0.25)
    plan = plan_segments([layout], torch.float32, 200_000, 0.5, which, page_tokens=4)
    pool = make_pool(layout, plan)
    region = pool.segments
    assert region.num_pages == plan.num_pages > 4
    without = make_pool(layout)
    assert without.segments is None
    assert sum(pool.get_kv_size_bytes()) - sum(without.get_kv_size_bytes()) == region.nbytes
    assert region.nbytes == plan.reserved_bytes

    store = SegmentStore.for_pool(pool)
    assert store.capacity_tokens == plan.capacity_tokens
    assert store.bytes_per_token == bytes_per_segment_token(layout, torch.float32, which)
    store.register("ns", [1, 2, 3], pin=False)  # occupies page 0, so the next rows are not 0..
    e = store.register("ns", list(range(10)), pin=False)
    rows = e.rows()
    k = torch.randn(10, 4, 8)
    v = torch.randn(10, 4, 8)
    for layer in range(3):
        region.write(layer, rows, k, v)
    for layer in range(3):
        heads = list(region.heads[layer])
        assert heads == (layout.local_heads(layer) if which == "local" else [0, 1, 2, 3])
        got_k, got_v = region.read(layer, rows)
        assert torch.equal(got_k, k[:, heads]) and torch.equal(got_v, v[:, heads])


def test_radix_cache_carries_the_store_sized_from_the_pool():
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    from redknot.segcache.factory import create_segment_store
    from redknot.segcache.radix import RedknotRadixCache

    layout = layout_of(0.25)
    plan = plan_segments([layout], torch.float32, 100_000, 0.5, "local", page_tokens=4)
    pool = make_pool(layout, plan)
    params = CacheInitParams(
        disable=False,
        req_to_token_pool=ReqToTokenPool(2, 64, "cpu", False),
        token_to_kv_pool_allocator=TokenToKVPoolAllocator(32, torch.float32, "cpu", pool, False),
        page_size=1,
    )
    cache = RedknotRadixCache(params, pool, segments=create_segment_store(params, pool))
    assert cache.segments.enabled and cache.segments.observer is None  # metrics off
    assert cache.segments.capacity_tokens == plan.capacity_tokens
    e = cache.segments.register("kb", [4, 5, 6], pin=True)
    cache.segments.mark_ready(e)
    cache.segments.release(e)
    cache.reset()  # a flush drops segments with the tree: their K/V may be stale
    assert cache.segments.list("kb") == []
    assert RedknotRadixCache(params, make_pool(layout)).segments.enabled is False


@pytest.fixture
def configurator(tmp_path, monkeypatch):
    from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator

    path = tmp_path / "map.json"
    synthetic_map(ModelShape.from_hf_config(HF_CONFIG), 0.25).save(path)

    def make(tp_size: int = 1, tp_rank: int = 0, **options):
        config = RedknotConfig(head_map=str(path), **options)
        monkeypatch.setenv(envs.REDKNOT_RESOLVED_CONFIG.name, config.to_json())
        kvc = object.__new__(KVCacheConfigurator)
        kvc.server_args = SimpleNamespace(attention_backend="redknot", max_running_requests=None)
        kvc.model_config = SimpleNamespace(hf_config=HF_CONFIG, context_len=4096)
        kvc.kv_cache_dtype = torch.bfloat16
        return kvc

    return make


@pytest.mark.parametrize("fraction, which", [(0.0, "local"), (0.05, "local"), (0.2, "all")])
def test_sizing_takes_segments_out_of_the_budget_first(configurator, fraction, which):
    from sglang.srt.runtime_context import get_parallel

    budget = 10**9
    with get_parallel().override(attn_tp_size=1, attn_tp_rank=0):
        kvc = configurator(segment_fraction=fraction, segment_heads=which)
        left = sizing.reserve_local_bytes(kvc, budget)
        layout = sizing.layout_of(kvc)
    seg = sizing.state_of(kvc)["segments"]
    slots = sizing.state_of(kvc)["slots"]
    per_token = bytes_per_segment_token(layout, torch.bfloat16, which)
    assert seg.reserved_bytes == int(budget * fraction) // (16 * per_token) * 16 * per_token
    assert left == budget - seg.reserved_bytes - slots.fixed_bytes
    assert slots.fixed_bytes == (slots.request_slots + 1 + slots.snapshots) * bytes_per_ring(
        layout, torch.bfloat16
    )
    assert (seg.num_pages > 0) == (fraction > 0)


def test_sizing_gives_every_tp_rank_the_same_segment_region(configurator):
    from sglang.srt.runtime_context import get_parallel

    plans = []
    for rank in range(2):
        with get_parallel().override(attn_tp_size=2, attn_tp_rank=rank):
            kvc = configurator()
            sizing.reserve_local_bytes(kvc, 10**9)
            plans.append(sizing.state_of(kvc)["segments"])
    assert plans[0] == plans[1] and plans[0].num_pages > 0


def test_segment_options_parse_and_validate():
    from redknot.integration.server_args import add_cli_flags

    parser = argparse.ArgumentParser()
    add_cli_flags(parser)
    args = parser.parse_args(
        ["--redknot-segment-fraction", "0.125", "--redknot-segment-heads", "all"]
    )
    assert args.redknot_segment_fraction == 0.125 and args.redknot_segment_heads == "all"
    assert RedknotConfig(all_global=True).segment_fraction == 0.05  # the documented default
    assert RedknotConfig(all_global=True).segment_heads == "local"
    cfg = RedknotConfig.from_mapping({"all_global": True, "segment_fraction": 0}, source="t")
    assert cfg.segment_fraction == 0
    with pytest.raises(RedknotConfigError, match="segment-fraction must be a number in"):
        RedknotConfig(all_global=True, segment_fraction=0.95)
    with pytest.raises(RedknotConfigError, match="segment_fraction must be a number"):
        RedknotConfig.from_mapping({"all_global": True, "segment_fraction": "lots"}, source="t")
    with pytest.raises(RedknotConfigError, match="segment-heads 'global' is not one of"):
        RedknotConfig(all_global=True, segment_heads="global")


def test_rows_leaving_recovery_keep_every_head_of_a_segment_by_default():
    """``--redknot-dense-layers`` with ``skipped=cached`` (the default) reads every head of a
    cached segment, so the region keeps them all unless told otherwise."""
    assert RedknotConfig(all_global=True).skipped == "cached"
    assert RedknotConfig(all_global=True, dense_layers=8).segment_heads == "all"
    sparse_residual = RedknotConfig(all_global=True, dense_layers=8, skipped="residual")
    assert sparse_residual.segment_heads == "local"
    explicit = RedknotConfig(all_global=True, dense_layers=8, segment_heads="local")
    assert explicit.segment_heads == "local"  # refused by the backend at startup
    again = RedknotConfig.from_mapping(
        {"all_global": True, "dense_layers": 8}, source="t"
    )  # resolved values round-trip
    assert (
        RedknotConfig.from_mapping(
            {f: getattr(again, f) for f in RedknotConfig.field_names()}, source="t"
        )
        == again
    )
    with pytest.raises(RedknotConfigError, match="skipped 'drop' is not one of cached, residual"):
        RedknotConfig(all_global=True, skipped="drop")


def test_token_policies_serve_every_head_global_and_keep_every_segment_head():
    from redknot.recovery.options import RecoveryOptions

    blend = RedknotConfig(policy="cacheblend")  # no head map needed
    assert blend.all_global and blend.segment_heads == "all"
    defaults = RecoveryOptions()  # the reference path's knobs, the same defaults
    assert (blend.epic_k, blend.blend_check_layer, blend.blend_ratio) == (
        defaults.epic_k, defaults.blend_check_layer, defaults.blend_ratio,
    )  # fmt: skip
    assert RedknotConfig.from_json(blend.to_json()) == blend
    assert RedknotConfig(all_global=True).policy == "redknot"
    refused = [
        ({"head_map": "m.json"}, "cannot be combined with --redknot-head-map"),
        ({"dense_layers": 8}, "cannot be combined with --redknot-dense-layers"),
        ({"segment_heads": "local"}, "cannot be combined with --redknot-segment-heads local"),
        ({"segment_fraction": 0}, "cannot be combined with --redknot-segment-fraction 0"),
        ({"blend_ratio": 1.5}, "blend-ratio must be a number in"),
        ({"epic_k": -1}, "epic-k must be an integer >= 0"),
        ({"sparseq_boundary": 0}, "sparseq-boundary must be an integer >= 1"),
    ]
    for extra, message in refused:
        with pytest.raises(RedknotConfigError, match=message):
            RedknotConfig(policy="epic", **extra)
    assert (blend.sparseq_boundary, blend.sparseq_k, blend.sparseq_block) == (
        defaults.sparseq_boundary, defaults.sparseq_k, defaults.sparseq_block,
    )  # fmt: skip
    # the reference path's hybrid was measured and not kept in the server: refused with why
    with pytest.raises(RedknotConfigError, match=r"redknot\+sparseq is not served: .*front"):
        RedknotConfig(head_map="m.json", policy="redknot+sparseq")
    with pytest.raises(RedknotConfigError, match="policy 'sparse' is not one of redknot, "):
        RedknotConfig(all_global=True, policy="sparse")


@pytest.fixture
def sglang_plugins():
    """SGLang's plugin loader, run as the scheduler process runs it."""
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from redknot.integration import plugin

    plugin.verify()
    return plugin


def test_get_internal_state_hook_adds_the_store_stats(sglang_plugins):
    import msgspec
    from sglang.srt.managers.io_struct import GetInternalStateReqOutput

    from redknot.integration import segments

    target = "sglang.srt.managers.scheduler.Scheduler.get_internal_state"
    assert sglang_plugins._hook_applied(target, segments._after_get_internal_state)
    store = SegmentStore(4, 4, 10)
    e = store.register("ns", [1, 2], pin=True)
    store.mark_ready(e)
    store.lookup("ns", [1, 2])
    scheduler = SimpleNamespace(tree_cache=SimpleNamespace(segments=store))
    result = GetInternalStateReqOutput(internal_state={"max_total_num_tokens": 10})
    out = segments._after_get_internal_state(result, scheduler, None)
    state = out.internal_state
    assert state["max_total_num_tokens"] == 10
    assert state["redknot_segments"] == store.stats()
    assert state["redknot_segments"]["hits"] == 1 and state["redknot_segments"]["pinned"] == 1
    msgspec.msgpack.encode(state)  # SGLang ships it over its IPC
    json.dumps(store.get("ns", e.id).to_dict())  # and entries are plain values for the API
    # with a reuse gate: what it decided, inert requests (marks not looked up) included
    gate = SimpleNamespace(served_with_reuse=2, served_without_reuse=3, served_inert=4,
                           host_scale=1.5)  # fmt: skip
    cache = SimpleNamespace(segments=store, pool=SimpleNamespace(reuse_gate=gate))
    out = segments._after_get_internal_state(result, SimpleNamespace(tree_cache=cache), None)
    assert out.internal_state["redknot_reuse_gate"] == {
        "served_with_reuse": 2, "served_without_reuse": 3, "served_inert": 4, "host_scale": 1.5,
    }  # fmt: skip
    # its correction by measured forwards: the forwards so far and the factors they give
    from redknot.costmodel.measured import ForwardTimer, MeasuredCorrection

    fix = MeasuredCorrection()
    for _ in range(4):  # the first of a size class is not kept
        fix.add("reuse", 2000, 30.0, 10.0)
    gate.timer = ForwardTimer(fix, lambda forward: 10.0, clock=None)
    out = segments._after_get_internal_state(result, SimpleNamespace(tree_cache=cache), None)
    measured = out.internal_state["redknot_reuse_gate"]["measured"]
    assert measured["forwards"] == {"reuse": 3, "recompute": 0} and measured["dropped"] == 1
    assert measured["ratios"]["2048"] == (3.0, 1.0) and measured["ratios"]["8192"] == (1.0, 1.0)
    msgspec.msgpack.encode(out.internal_state)
    # a tree cache without a store (SGLang's chunk cache) adds nothing of the store (only the
    # process's collections, once the scheduler counts them: test_gc_clock.py)
    chunk = SimpleNamespace(tree_cache=SimpleNamespace())
    fresh = GetInternalStateReqOutput(internal_state={"max_total_num_tokens": 10})
    out = segments._after_get_internal_state(fresh, chunk, None) or fresh
    assert set(out.internal_state) <= {"max_total_num_tokens", segments.PROCESS_KEY}
