"""Can a GPU kernel read KV rows held in pinned host memory, and how fast (issue 28 item 3)?

LFPS over host-offloaded KV needs, per decode step, a few thousand selected key/value rows of
every (request, layer, KV head) out of a context that lives in host memory. Two ways to get
them to the GPU, measured side by side at the 8B shape (one row = one KV head's 128 bf16
values, 256 bytes):

- ``uva_gather``: a Triton kernel given the pinned tensor itself reads the selected rows over
  PCIe (CUDA's unified addressing maps pinned host memory into the device's address space);
- ``cpu_gather_copy``: the rows gathered by the CPU (``index_select`` into a pinned staging
  buffer) and copied with one asynchronous transfer;
- ``h2d_contiguous``: a contiguous copy of the same bytes, the link's ceiling.

Every gathered tensor is checked equal to the CPU's gather before it is timed.

    python benchmarks/host_kv_probe.py --out $OUT/host_kv_probe.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serving_common as common


@triton.jit
def _gather_rows(src, idx, dst, D: tl.constexpr, ROWS: tl.constexpr):
    pid = tl.program_id(0)
    r = pid * ROWS + tl.arange(0, ROWS)
    rows = tl.load(idx + r)
    d = tl.arange(0, D)
    vals = tl.load(src + rows[:, None].to(tl.int64) * D + d[None, :])
    tl.store(dst + r[:, None].to(tl.int64) * D + d[None, :], vals)


def uva_gather(src: torch.Tensor, idx: torch.Tensor, out: torch.Tensor) -> None:
    rows = 16
    _gather_rows[(idx.numel() // rows,)](src, idx, out, D=src.shape[1], ROWS=rows)


def timed(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps


def measure(host: torch.Tensor, idx_cpu: torch.Tensor, reps: int) -> dict:
    """The three ways of bringing the rows ``idx_cpu`` of ``host`` to the GPU, timed."""
    k, d = idx_cpu.numel(), host.shape[1]
    idx = idx_cpu.to(torch.int32).cuda()
    want = host.index_select(0, idx_cpu)
    point: dict = {"rows": k, "bytes": k * d * 2}
    dst = torch.empty(k, d, dtype=torch.bfloat16, device="cuda")
    try:
        uva_gather(host, idx, dst)
        torch.cuda.synchronize()
        point["uva_equal"] = bool(torch.equal(dst.cpu(), want))
        s = timed(lambda: uva_gather(host, idx, dst), reps)
        point["uva_gather_ms"] = round(s * 1e3, 4)
        point["uva_gather_gb_s"] = round(k * d * 2 / s / 1e9, 2)
    except Exception as e:  # noqa: BLE001 -- the question this probe asks
        point["uva_error"] = f"{type(e).__name__}: {e}"[:400]
    staging = torch.empty(k, d, dtype=torch.bfloat16).pin_memory()

    def cpu_path():
        torch.index_select(host, 0, idx_cpu, out=staging)
        dst.copy_(staging, non_blocking=True)

    cpu_path()
    torch.cuda.synchronize()
    point["cpu_equal"] = bool(torch.equal(dst.cpu(), want))
    s = timed(cpu_path, reps)
    point["cpu_gather_copy_ms"] = round(s * 1e3, 4)
    s = timed(lambda: dst.copy_(staging, non_blocking=True), reps)
    point["h2d_contiguous_ms"] = round(s * 1e3, 4)
    point["h2d_contiguous_gb_s"] = round(k * d * 2 / s / 1e9, 2)
    return point


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--selected", default="0.02,0.054,0.1", help="fractions of the context")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    n, h, d = a.context, a.kv_heads, a.head_dim
    # one layer's keys of one request: [context * kv_heads, D] rows in pinned host memory
    host = torch.randn(n * h, d, dtype=torch.bfloat16).pin_memory()
    rows_all = n * h
    out: dict = {"context": n, "kv_heads": h, "head_dim": d, "rows_per_layer": rows_all}
    gen = torch.Generator().manual_seed(0)
    points = []
    for frac in (float(x) for x in a.selected.split(",")):
        k = int(frac * rows_all) // 16 * 16
        idx_cpu = torch.randperm(rows_all, generator=gen)[:k].sort().values
        points.append({"fraction": frac, **measure(host, idx_cpu, a.reps)})
        print(points[-1], flush=True)
    out["points"] = points
    out["torch_threads"] = torch.get_num_threads()
    common.write_json(a.out, common.record(**out))


if __name__ == "__main__":
    main()
