"""Prometheus export of the segment store.

The multiprocess test runs a scheduler-like process with ``PROMETHEUS_MULTIPROC_DIR`` set before
``prometheus_client`` is imported (as SGLang does), builds the store through the cache factory
with metrics enabled, and reads the directory back the way SGLang's ``/metrics`` does
(``MultiProcessCollector``). The in-process test checks that the gauges, kept by deltas, always
agree with ``stats()`` over random operations.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap

from redknot.segcache.entry import SegmentStoreFull
from redknot.segcache.metrics import OTHER_NAMESPACE, SegmentMetrics
from redknot.segcache.store import SegmentStore

CHILD = textwrap.dedent("""
    import json
    from types import SimpleNamespace

    import torch
    import sglang.srt.runtime_context as rc
    from sglang.srt.runtime_context import get_parallel

    from redknot.headmap import ModelShape, synthetic_map
    from redknot.pool.kv_pool import RedknotKVPool
    from redknot.pool.layout import HeadLayout
    from redknot.pool.segment_region import plan_segments
    from redknot.segcache import metrics
    from redknot.segcache.factory import create_segment_store

    metrics.MAX_NAMESPACE_LABELS = 2  # n1 and n2 get labels, n3 and others report as _other
    rc.get_server_args = lambda: SimpleNamespace(
        served_model_name="m", enable_metrics_for_all_schedulers=False,
        extra_metric_labels={"site": "x"},
    )
    shape = ModelShape("LlamaForCausalLM", num_layers=2, num_kv_heads=2, num_attention_heads=2,
                       head_dim=4)
    layout = HeadLayout.from_head_map(synthetic_map(shape, 0.5, window=4, sink=1))
    plan = plan_segments([layout], torch.float32, 4096, 0.5, "local", page_tokens=4)
    assert plan.num_pages == 8, plan  # 2 local heads x 4 dims x K,V x 4 bytes = 64 B per token
    pool = RedknotKVPool(64, 1, torch.float32, layout, num_rings=2, num_snapshots=1,
                         device="cpu", segment_plan=plan)
    with get_parallel().override(attn_tp_size=1, attn_tp_rank=0):
        store = create_segment_store(SimpleNamespace(enable_metrics=True), pool)

    def cached(ns, toks, pin=False):
        e = store.register(ns, toks, pin=pin)
        store.mark_ready(e)
        store.release(e)
        return e

    a = cached("n1", [1] * 8, pin=True)
    cached("n2", [2] * 4)
    captured = store.register("n2", [7] * 4, pin=False, capture=True)  # a capture on miss
    store.mark_ready(captured)
    store.release(captured)
    c = cached("n3", [3] * 4)
    store.lookup("n1", [1] * 8)
    store.lookup("n1", [1] * 8)
    store.lookup("n2", [9])
    store.lookup("n3", [3] * 4)
    store.lookup("nobody", [3] * 4)
    for i in range(4):  # 4 pages left over 2 segments of 2: evicts
        cached("n2", [10 + i] * 8)
    store.delete("n3", c.id) if store.list("n3") else None
    held = store.register("n1", [5] * 4, pin=False)  # still referenced at the end
    print(json.dumps({
        "stats": {ns: store.stats(ns) for ns in ("n1", "n2", "n3", "nobody")},
        "total": store.stats(),
    }))
    """)


def test_metrics_reach_the_multiprocess_directory(tmp_path):
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "-c", CHILD],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,  # the assert below shows the child's error
    )
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    stats, total = report["stats"], report["total"]
    assert total["evictions"] > 0 and total["hits"] == 3 and total["misses"] == 2
    assert stats["n2"]["captures"] == 1 and total["captures"] == 1

    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(tmp_path))
    samples: dict[tuple, float] = {}
    for metric in registry.collect():
        for s in metric.samples:
            labels = dict(s.labels)
            assert labels.pop("model_name") == "m" and labels.pop("tp_rank") == "0"
            assert labels.pop("site") == "x"
            samples[(s.name, labels.get("namespace"))] = s.value
    assert {ns for _, ns in samples if ns is not None} == {"n1", "n2", OTHER_NAMESPACE}

    def value(name: str, label: str) -> float:
        return samples.get((name, label), 0.0)

    groups = {"n1": ["n1"], "n2": ["n2"], OTHER_NAMESPACE: ["n3", "nobody"]}
    for label, spaces in groups.items():
        want = {k: sum(stats[ns][k] for ns in spaces) for k in stats["n1"] if k != "enabled"}
        assert value("redknot_segment_hits_total", label) == want["hits"], label
        assert value("redknot_segment_misses_total", label) == want["misses"], label
        assert value("redknot_segment_hit_tokens_total", label) == want["hit_tokens"], label
        assert value("redknot_segment_bytes_saved_total", label) == want["bytes_saved"], label
        assert value("redknot_segment_evictions_total", label) == want["evictions"], label
        assert value("redknot_segment_captures_total", label) == want["captures"], label
        assert value("redknot_segment_count", label) == want["segments"], label
        assert value("redknot_segment_pinned", label) == want["pinned"], label
        assert value("redknot_segment_bytes_used", label) == want["bytes_used"], label
    assert samples[("redknot_segment_capacity_bytes", None)] == total["capacity_bytes"] == 8 * 256
    assert stats["n1"]["bytes_saved"] == 2 * 8 * 64  # two hits of 8 tokens at 64 B per token


def test_gauges_follow_stats_over_random_operations():
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    metrics = SegmentMetrics({"model_name": "m"}, capacity_bytes=0, registry=registry)
    store = SegmentStore(16, 4, 10, observer=metrics)
    rng = random.Random(3)
    held = []
    spaces = [f"ns{i}" for i in range(20)]  # more than MAX_NAMESPACE_LABELS
    for _ in range(500):
        ns = rng.choice(spaces[:3] if rng.random() < 0.8 else spaces)
        toks = [rng.randrange(3)] * rng.choice((1, 5, 9))
        op = rng.random()
        if op < 0.4:
            try:
                e = store.register(ns, toks, pin=rng.random() < 0.2)
            except SegmentStoreFull:
                continue
            store.mark_ready(e)
            held.append(e)
        elif op < 0.7 and held:
            store.release(held.pop(rng.randrange(len(held))))
        elif op < 0.85:
            e = store.lookup(ns, toks)
            if e is not None:
                store.acquire(e)
                held.append(e)
        elif store.list(ns):
            store.delete(ns, rng.choice(store.list(ns)).id)
        elif rng.random() < 0.1:
            store.clear()
        sums: dict[str, float] = {}
        for metric in registry.collect():
            for s in metric.samples:
                sums[s.name] = sums.get(s.name, 0.0) + s.value
        total = store.stats()
        assert sums.get("redknot_segment_count", 0) == total["segments"]
        assert sums.get("redknot_segment_pinned", 0) == total["pinned"]
        assert sums.get("redknot_segment_bytes_used", 0) == total["bytes_used"]
        assert sums.get("redknot_segment_evictions_total", 0) == total["evictions"]
        assert sums.get("redknot_segment_hits_total", 0) == total["hits"]
    assert total["evictions"] > 0 and total["hits"] > 0
