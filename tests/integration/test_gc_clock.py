"""The scheduler's garbage-collection clock (``redknot.integration.gc_clock``): it counts each
generation's collections and their pauses once installed, and the server reports them."""

from __future__ import annotations

import gc
from types import SimpleNamespace

from redknot.integration import gc_clock, segments


def test_collections_are_counted_once_installed_and_the_hook_is_added_once():
    gc_clock.install()
    gc_clock.install()
    assert gc.callbacks.count(gc_clock._on_collection) == 1 and gc_clock.installed()
    before = gc_clock.snapshot().get("2", {"collections": 0, "pause_ms": 0.0})
    garbage = []
    for _ in range(2000):  # cycles that only the collector frees, as a marked request's Req
        node = {}
        node["self"] = node
        garbage.append(node)
    del garbage, node
    gc.collect()
    gc.collect()
    after = gc_clock.snapshot()["2"]
    # the two asked for (the allocations above may have set off one more of their own)
    assert after["collections"] >= before["collections"] + 2
    assert after["pause_ms"] > before["pause_ms"]


def test_the_server_reports_them_with_or_without_a_segment_store():
    from sglang.srt.managers.io_struct import GetInternalStateReqOutput

    gc_clock.install()
    gc.collect()
    for scheduler in (SimpleNamespace(tree_cache=None), SimpleNamespace()):
        result = GetInternalStateReqOutput(internal_state={"max_total_num_tokens": 10})
        out = segments._after_get_internal_state(result, scheduler, None)
        state = out.internal_state
        assert state["max_total_num_tokens"] == 10  # SGLang's own keys kept
        gcs = state[segments.PROCESS_KEY]["gc"]
        assert gcs["2"]["collections"] >= 1 and set(gcs["2"]) == {"collections", "pause_ms"}
