"""Where the time of one profiled forward goes: a torch-profiler trace summarised as JSON.

Reads a Chrome trace written by SGLang's profiler (``benchmarks/ttft.py --profile-dir``) and
reports, over the traced span:

- ``span_ms``: first GPU kernel start to last kernel end; ``gpu_busy_ms``: the union of kernel
  intervals in it (the difference is the GPU waiting for the host);
- ``ranges``: per named range of the redknot forward (``redknot.attention.trace.phase``), its
  count, host time, GPU span and the kernel time inside that span;
- ``kernels``: the GPU kernels with the most total time;
- ``runtime``: CUDA runtime calls (launches, copies, synchronisations) by count and host time;
- ``per_layer``: the span from one ``segpaged_extend_kernel`` launch (one per decoder layer of
  an extend) to the next, the kernel time in it and its kernel count (the last one runs to the
  end of the traced span: it includes what follows the last layer);
- ``longest_host``: the longest single host events (ranges, operators, runtime calls), where a
  first prompt's one-off costs (compiles, first launches) show;
- ``layer_host``: inside the decoder-layer ranges (``redknot.decoder_layer.*``), the host
  operators (and Python functions, in a trace taken with stacks; ``trace_replay.py``'s are
  not) by count and inclusive time, and the ranges' median host time: two servers' summaries
  side by side show which calls one of them adds per layer;
- ``python`` (a trace taken with stacks, e.g. ``ttft_side_by_side.py --profile-stack``): every
  Python function of the traced span by inclusive host time and call count, over all threads
  (a function that recurses counts its inner calls too): two rows' summaries side by side show
  which functions one of them adds, and where a request's host time goes outside the layers.

    python benchmarks/profile_summary.py TRACE.json.gz [...] --out benchmarks/results/x.json
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serving_common as common


def load_events(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]


def merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Disjoint, sorted union of ``(start, end)`` intervals."""
    out: list[list[float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def busy_within(union: list[tuple[float, float]], starts: list[float], lo: float, hi: float):
    """Length of ``union`` (disjoint, sorted; ``starts`` its starts) inside ``[lo, hi]``."""
    total = 0.0
    i = max(bisect.bisect_right(starts, lo) - 1, 0)
    while i < len(union) and union[i][0] < hi:
        s, e = union[i]
        total += max(0.0, min(e, hi) - max(s, lo))
        i += 1
    return total


def summarize(events: list[dict], top: int = 25) -> dict:
    kernels = [e for e in events if e.get("cat") == "kernel"]
    if not kernels:
        raise SystemExit("the trace has no GPU kernels: was the profiler given GPU activity?")
    union = merged([(e["ts"], e["ts"] + e["dur"]) for e in kernels])
    starts = [s for s, _ in union]
    span = union[-1][1] - union[0][0]
    ms = lambda us: round(us / 1000.0, 3)

    by_kernel: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in kernels:
        by_kernel[e["name"]][0] += 1
        by_kernel[e["name"]][1] += e["dur"]
    ranges: dict[str, dict] = defaultdict(
        lambda: {"count": 0, "host_ms": 0.0, "gpu_span_ms": 0.0, "gpu_kernel_ms": 0.0}
    )
    for e in events:
        cat, name = e.get("cat"), e.get("name", "")
        if not name.startswith("redknot."):
            continue
        r = ranges[name]
        if cat == "user_annotation":
            r["count"] += 1
            r["host_ms"] += e["dur"] / 1000.0
        elif cat == "gpu_user_annotation":
            r["gpu_span_ms"] += e["dur"] / 1000.0
            r["gpu_kernel_ms"] += busy_within(union, starts, e["ts"], e["ts"] + e["dur"]) / 1e3
    runtime: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in events:
        if e.get("cat") == "cuda_runtime":
            runtime[e["name"]][0] += 1
            runtime[e["name"]][1] += e["dur"]
    busy = sum(e - s for s, e in union)
    layer_starts = sorted(e["ts"] for e in kernels if e["name"] == "segpaged_extend_kernel")
    bounds = list(zip(layer_starts, [*layer_starts[1:], union[-1][1]]))
    kernel_starts = sorted(e["ts"] for e in kernels)
    per_layer = [
        {
            "span_ms": ms(hi - lo),
            "kernel_ms": ms(busy_within(union, starts, lo, hi)),
            "kernels": bisect.bisect_left(kernel_starts, hi)
            - bisect.bisect_left(kernel_starts, lo),
        }
        for lo, hi in bounds
    ]
    return {
        "layer_host": layer_host(events, top),
        "span_ms": ms(span),
        "gpu_busy_ms": ms(busy),
        "gpu_idle_ms": ms(span - busy),
        "ranges": {k: {f: round(x, 3) for f, x in v.items()} for k, v in sorted(ranges.items())},
        "kernels": [
            {"name": n[:160], "count": c, "total_ms": ms(t)}
            for n, (c, t) in sorted(by_kernel.items(), key=lambda kv: -kv[1][1])[:top]
        ],
        "runtime": [
            {"name": n, "count": c, "host_ms": ms(t)}
            for n, (c, t) in sorted(runtime.items(), key=lambda kv: -kv[1][1])[:top]
        ],
        "per_layer": per_layer,
        "python": python_functions(events, 8 * top),
        "longest_host": [
            {"name": e.get("name", "")[:160], "cat": e.get("cat"), "ms": ms(e["dur"])}
            for e in sorted(
                (e for e in events if e.get("cat") not in ("kernel", "gpu_user_annotation")),
                key=lambda e: -e["dur"],
            )[:top]
        ],
    }


def layer_host(events: list[dict], top: int) -> dict:
    """Host operators and Python functions inside the decoder-layer ranges (see the module)."""
    layers = sorted(
        (e["ts"], e["ts"] + e["dur"], e.get("tid"))
        for e in events
        if e.get("cat") == "user_annotation" and e.get("name", "").startswith("redknot.decoder_")
    )
    if not layers:
        return {"layers": 0}
    starts = [lo for lo, _, _ in layers]
    calls: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0.0])
    for e in events:
        cat = e.get("cat")
        if cat not in ("cpu_op", "python_function"):
            continue
        i = bisect.bisect_right(starts, e["ts"]) - 1
        if i < 0 or e["ts"] + e["dur"] > layers[i][1] or e.get("tid") != layers[i][2]:
            continue
        c = calls[(cat, e.get("name", "")[:160])]
        c[0] += 1
        c[1] += e["dur"]
    durations = sorted(hi - lo for lo, hi, _ in layers)
    n = len(layers)
    return {
        "layers": n,
        "host_p50_ms": round(durations[n // 2] / 1e3, 4),
        "host_mean_ms": round(sum(durations) / n / 1e3, 4),
        "calls": [
            {
                "cat": cat,
                "name": name,
                "per_layer": round(c / n, 2),
                "ms_per_layer": round(t / n / 1e3, 4),
            }
            for (cat, name), (c, t) in sorted(calls.items(), key=lambda kv: -kv[1][1])[: 4 * top]
        ],
    }


def python_functions(events: list[dict], top: int) -> list[dict]:
    """The ``top`` Python functions by inclusive host time (empty: no stacks in the trace)."""
    calls: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in events:
        if e.get("cat") == "python_function":
            c = calls[e.get("name", "")[:160]]
            c[0] += 1
            c[1] += e.get("dur", 0.0)
    ranked = sorted(calls.items(), key=lambda kv: -kv[1][1])[:top]
    return [{"name": n, "count": c, "ms": round(t / 1e3, 4)} for n, (c, t) in ranked]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("traces", nargs="+", help="trace files (.json or .json.gz)")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    traces = {Path(p).parent.name + "/" + Path(p).name: summarize(load_events(p), args.top)
              for p in args.traces}  # fmt: skip
    common.write_json(args.out, common.record(traces=traces))
    for name, t in traces.items():
        print(name, "span", t["span_ms"], "busy", t["gpu_busy_ms"], flush=True)


if __name__ == "__main__":
    main()
