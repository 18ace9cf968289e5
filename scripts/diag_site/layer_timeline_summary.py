"""Summarise ``REDKNOT_LAYER_TIMELINE`` lines (see sitecustomize.py), one forward each.

Per decoder layer: its host span (host clock from its start to the next layer's) and its GPU
span (CUDA events, same marks), and the GPU's lag behind the host at the layer's start: the
event's GPU time minus its host time, less the smallest such difference of the forward (a mark
the GPU ran as soon as the host issued it). A lag near 0 means the GPU was waiting for the host
(host-bound); a growing lag means work queued up (GPU-bound). Per phase: host and GPU time
summed over the layers, median over the forwards, and per layer for the last forward.

    python scripts/diag_site/layer_timeline_summary.py /tmp/timeline.jsonl --out summary.json
"""

import argparse
import itertools
import json
import statistics
from collections import defaultdict


def one_forward(marks: list) -> dict:
    offset = min(g - h for _, _, h, g in marks)
    starts = [(n, h, g) for n, k, h, g in marks if k in ("start", "end")]
    layers = []
    for (name, h, g), (_, h2, g2) in itertools.pairwise(starts):
        layers.append(
            {
                "layer": name,
                "host_ms": round(h2 - h, 3),
                "gpu_ms": round(g2 - g, 3),
                "lag_ms": round(g - h - offset, 3),
            }
        )
    open_at: dict[str, tuple] = {}
    phases: dict[str, list] = defaultdict(lambda: [0.0, 0.0, 0])
    i = -1  # the layer the marks belong to
    for name, kind, h, g in marks:
        if kind == "start":
            i += 1
        elif kind == "enter":
            open_at[name] = (h, g)
        elif kind == "exit" and name in open_at:
            h0, g0 = open_at.pop(name)
            acc = phases[name]
            acc[0] += h - h0
            acc[1] += g - g0
            acc[2] += 1
            mine = layers[i].setdefault("phases", {}).setdefault(name, [0.0, 0.0])
            mine[0] = round(mine[0] + h - h0, 3)
            mine[1] = round(mine[1] + g - g0, 3)
    return {
        "total_host_ms": starts[-1][1] - starts[0][1],
        "total_gpu_ms": starts[-1][2] - starts[0][2],
        "layers": layers,
        "phases": {k: {"host_ms": v[0], "gpu_ms": v[1], "count": v[2]} for k, v in phases.items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("log")
    ap.add_argument("--min-rows", type=int, default=0)
    ap.add_argument("--out")
    ap.add_argument(
        "--meta",
        default="{}",
        help="JSON object of fields recorded first (device, date, commit, command)",
    )
    args = ap.parse_args()
    with open(args.log) as f:
        forwards = [json.loads(line) for line in f]
    forwards = [r for r in forwards if r["rows"] >= args.min_rows]
    runs = [one_forward(r["marks"]) for r in forwards]
    med = lambda xs: round(statistics.median(xs), 3)
    summary = {
        **json.loads(args.meta),
        "forwards": len(runs),
        "rows": [r["rows"] for r in forwards],
        "total_host_ms": [round(r["total_host_ms"], 3) for r in runs],
        "total_gpu_ms": [round(r["total_gpu_ms"], 3) for r in runs],
        "per_layer_median": (
            [
                {
                    key: (
                        layer["layer"]
                        if key == "layer"
                        else med([r["layers"][i][key] for r in runs if len(r["layers"]) > i])
                    )
                    for key in ("layer", "host_ms", "gpu_ms", "lag_ms")
                }
                for i, layer in enumerate(runs[0]["layers"])
            ]
            if runs
            else []
        ),
        "last_forward_phases_per_layer": {  # [host ms, GPU ms] of each phase
            layer["layer"]: layer.get("phases", {})
            for layer in (runs[-1]["layers"] if runs else [])
        },
        "phases_median": {
            name: {
                key: med([r["phases"][name][key] for r in runs if name in r["phases"]])
                for key in ("host_ms", "gpu_ms", "count")
            }
            for name in (runs[0]["phases"] if runs else {})
        },
    }
    text = json.dumps(summary, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
