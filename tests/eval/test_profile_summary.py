"""``benchmarks/profile_summary.py``: what a trace's summary says about the host and the GPU."""

from __future__ import annotations

from benchmarks.profile_summary import layer_host, python_functions, summarize


def _ev(cat, name, ts, dur, tid=1):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid}


def test_layer_host_counts_the_calls_inside_decoder_layer_ranges_of_their_thread():
    events = [
        _ev("user_annotation", "redknot.decoder_layer.every_row", 0, 100),
        _ev("user_annotation", "redknot.decoder_layer.every_row", 200, 300),
        _ev("python_function", "kv_pool.py(179): set_kv_buffer", 10, 20),
        _ev("python_function", "kv_pool.py(179): set_kv_buffer", 210, 40),
        _ev("cpu_op", "aten::index_select", 220, 10),
        _ev("cpu_op", "aten::index_select", 230, 10, tid=2),  # another thread
        _ev("cpu_op", "aten::copy_", 150, 10),  # between layers
        _ev("cpu_op", "aten::view", 90, 20),  # runs past its layer's end
    ]
    out = layer_host(events, top=5)
    assert out["layers"] == 2
    assert out["host_p50_ms"] == 0.3 and out["host_mean_ms"] == 0.2
    calls = {c["name"]: c for c in out["calls"]}
    assert set(calls) == {"kv_pool.py(179): set_kv_buffer", "aten::index_select"}
    assert calls["kv_pool.py(179): set_kv_buffer"]["per_layer"] == 1.0
    assert calls["kv_pool.py(179): set_kv_buffer"]["ms_per_layer"] == 0.03  # 60 us over 2
    assert calls["aten::index_select"]["per_layer"] == 0.5
    assert layer_host([_ev("cpu_op", "aten::view", 0, 1)], top=5) == {"layers": 0}


def test_summary_splits_the_span_into_busy_and_idle_gpu_time():
    events = [
        _ev("kernel", "a", 0, 10, tid=7),
        _ev("kernel", "b", 5, 10, tid=7),  # overlaps a: the union is 0-15
        _ev("kernel", "c", 30, 10, tid=7),
    ]
    out = summarize(events, top=5)
    assert out["span_ms"] == 0.04 and out["gpu_busy_ms"] == 0.025 and out["gpu_idle_ms"] == 0.015
    assert [k["name"] for k in out["kernels"]] == ["a", "b", "c"]


def test_python_functions_rank_by_inclusive_time_over_all_threads():
    events = [
        _ev("python_function", "scheduler.py(10): get_next_batch_to_run", 0, 400),
        _ev("python_function", "reuse.py(117): start", 50, 150),
        _ev("python_function", "reuse.py(117): start", 500, 50, tid=2),
        _ev("cpu_op", "aten::copy_", 60, 300),  # an operator, not a Python function
        _ev("kernel", "k", 0, 10, tid=7),
    ]
    out = python_functions(events, top=5)
    assert out == [
        {"name": "scheduler.py(10): get_next_batch_to_run", "count": 1, "ms": 0.4},
        {"name": "reuse.py(117): start", "count": 2, "ms": 0.2},
    ]
    assert python_functions(events, top=1) == out[:1]
    assert summarize(events, top=5)["python"] == out
    assert python_functions([_ev("cpu_op", "aten::view", 0, 1)], top=5) == []
