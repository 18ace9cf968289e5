"""How often, and for how long, Python's garbage collector paused this (scheduler) process.

A prompt of one or two thousand tokens spends most of its TTFT in the scheduler's host code, so
a collection that runs during it adds its whole pause to that prompt. Some requests leave more
for the collector than others: SGLang's ``Req`` keeps a reference to itself in its
``custom_params`` (``{"__req__": req}``), the channel redknot's segment marks travel in, so a
marked request is a reference cycle that only the collector frees. ``install`` adds a
``gc.callbacks`` hook that counts each generation's collections and sums their pauses;
``snapshot`` reads the totals. The server reports them under ``redknot_process`` in
``/server_info`` (``redknot.integration.segments``), so a benchmark can tell what the collector
took from each prompt (``benchmarks/ttft.py --gc-prompts``). The hook costs two clock reads per
collection.
"""

from __future__ import annotations

import gc
import time

_START: dict[int, float] = {}  # generation -> perf_counter at its collection's start
_TOTALS: dict[int, list[float]] = {}  # generation -> [collections, pause seconds]


def _on_collection(phase: str, info: dict) -> None:
    gen = info.get("generation", -1)
    if phase == "start":
        _START[gen] = time.perf_counter()
    elif phase == "stop" and gen in _START:
        totals = _TOTALS.setdefault(gen, [0, 0.0])
        totals[0] += 1
        totals[1] += time.perf_counter() - _START.pop(gen)


def install() -> None:
    """Start counting this process's collections (once; later calls do nothing)."""
    if _on_collection not in gc.callbacks:
        gc.callbacks.append(_on_collection)


def installed() -> bool:
    return _on_collection in gc.callbacks


def snapshot() -> dict[str, dict[str, float]]:
    """Per generation (``"0"``, ``"1"``, ``"2"``), the collections since :func:`install` and their
    summed pause in ms; generations that never ran are absent."""
    return {
        str(gen): {"collections": int(n), "pause_ms": round(1e3 * seconds, 4)}
        for gen, (n, seconds) in sorted(_TOTALS.items())
    }
