"""The startup check of the Triton path on the GPU at two served shapes, run twice in one
process: the first run includes compiling every kernel variant it launches (among them the
extend as segment reuse runs it: rows packed into tiles, with the log-sum-exp), the second
finds them compiled. Writes ``--out`` (JSON) with both durations and the cases checked.

    python scripts/startup_check_gpu.py --out /tmp/startup_check_gpu.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import time

import torch

from redknot.attention.segpaged_runner import SegPagedRunner
from redknot.attention.startup_check import (
    ServedAttention,
    check_reuse_kernels,
    reuse_launches,
    run_startup_check,
)
from redknot.kernels.rope_align import alignable_rope
from redknot.kernels.rope_reference import sglang_rope
from redknot.pool.kv_pool import RedknotKVPool
from redknot.pool.layout import HeadLayout
from redknot.pool.segment_region import plan_segments

SHAPES = {  # name -> (query heads, head_dim, head-class rows)
    "llama-3.1-8b, 1/8 map": (32, 128, ("GLLLLLLL", "LLLGLLLL", "LLLLLLLL", "GGGGGGGG")),
    "smollm2-135m, group of 3": (9, 64, ("LLL", "GLL", "LGG", "GGG")),
}


def reuse_runner(layout: HeadLayout) -> SegPagedRunner:
    """A runner over a small pool with a segment region of every head, a plain RoPE table of
    32K positions, the layer schedule from layer 1 on."""
    plan = plan_segments([layout], torch.bfloat16, 10**7, 0.1, "all")
    pool = RedknotKVPool(4096, 1, torch.bfloat16, layout, num_rings=6, num_snapshots=0,
                         device="cuda", segment_plan=plan)  # fmt: skip
    table = torch.zeros((6, 32772), dtype=torch.int32, device="cuda")
    runner = SegPagedRunner(layout, pool, table, 6, 32768, torch.device("cuda"))
    d = layout.head_dim
    runner.rope = alignable_rope(sglang_rope(d, d, 32768, 500000.0, True).to("cuda"))
    runner.dense_layers = 1
    return runner


def timed(fn, *args) -> tuple[float, object]:
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn(*args)
    torch.cuda.synchronize()
    return round(time.perf_counter() - start, 3), out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    runs = {}
    for name, (hq, d, classes) in SHAPES.items():
        layout = HeadLayout(classes=classes, num_q_heads=hq, head_dim=d, window=256, sink=64)
        served = ServedAttention(
            layout=layout, dtype=torch.bfloat16, kv_dtype=torch.bfloat16,
            device=torch.device("cuda"), max_context_len=32768, table_width=32772, model=name,
        )  # fmt: skip
        seconds = []
        for _ in range(2):
            took, results = timed(run_startup_check, served, "segpaged")
            seconds.append(took)
        runner = reuse_runner(layout)
        reuse = [timed(check_reuse_kernels, runner, served) for _ in range(2)]
        runs[name] = {
            "reuse_kernels": {
                "launches": [f"{n} of layer {lid}" for n, lid in reuse_launches(runner)],
                "seconds_first": reuse[0][0],
                "seconds_second": reuse[1][0],
            },
            "seconds_first": seconds[0],
            "seconds_second": seconds[1],
            "cases": sorted({r.case for r in results}),
            "results": len(results),
            "all_within_tolerance": all(r.bad == 0 for r in results),
            "worst_ratio_to_tolerance": max(r.ratio for r in results),
        }
        print(name, runs[name])
    out = {
        "benchmark": "startup_check_gpu",
        "device": torch.cuda.get_device_name(),
        "date": dt.datetime.now(dt.UTC).replace(microsecond=0).isoformat(),
        "commit": os.environ.get("REDKNOT_COMMIT", "unknown"),
        "command": "python scripts/startup_check_gpu.py --out " + args.out,
        "runs": runs,
    }
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
