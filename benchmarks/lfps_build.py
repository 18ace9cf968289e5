"""LFPS's table build per layer: the PyTorch build the server runs against the Triton kernels.

One request of each ``--lengths`` at the 8B shape (32 query / 8 KV heads, D 128, bf16), 64
queries, selections per KV head (``rows`` 4): ``redknot.lfps.serving.build_tables`` over the
request's gathered K/V (the gather included, as the server does it) and
``redknot.kernels.lfps_build.build_tables_kernels`` over the paged store, with the store in GPU
memory and, with ``--host``, in pinned host memory (``--redknot-lfps-offload-gb``). Every
kernel result is checked against the PyTorch one before it is timed; medians of ``--reps``
CUDA-event timings after a warm-up.

    python3 benchmarks/gpu_run.py bench lfps_build --host
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serving_common as common

HQ, HKV, D, ROWS = 32, 8, 128, 4


def measure(n: int, host: bool, reps: int) -> dict:
    from redknot.kernels.lfps_build import build_tables_kernels
    from redknot.lfps import LfpsParams
    from redknot.lfps.serving import build_tables
    from redknot.pool.host_memory import pinned_host_tensor

    gen = torch.Generator(device="cuda").manual_seed(n)
    shape = (n + 64, HKV, D)
    k = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn_like(k)
    if host:
        k_host = pinned_host_tensor(shape, torch.bfloat16, "cuda")
        v_host = pinned_host_tensor(shape, torch.bfloat16, "cuda")
        k_host.copy_(k)
        v_host.copy_(v)
        k, v = k_host, v_host
    slots = torch.randperm(n + 64, device="cuda", generator=gen)[:n]
    q = torch.randn(64, HQ, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    params, scale = LfpsParams(budget=0.02, history_steps=64), D**-0.5

    def pytorch():
        return build_tables(q, k[slots], v[slots], params, ROWS, scale)

    def kernels():
        return build_tables_kernels(q, k, v, slots, params, ROWS, scale)

    for a, b in zip(kernels(), pytorch()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=2e-3)
    out = {
        "pytorch_ms": common.event_ms(pytorch, reps),
        "kernels_ms": common.event_ms(kernels, reps),
    }
    out["speedup"] = out["pytorch_ms"] / out["kernels_ms"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--lengths", default="32768,131072")
    ap.add_argument("--host", action="store_true", help="also with the store in host memory")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=str(common.ROOT / "benchmarks/results/lfps_build.json"))
    args = ap.parse_args()
    stores = ["gpu_memory"] + (["host_memory"] if args.host else [])
    figures = {
        store: {n: measure(int(n), store == "host_memory", args.reps)
                for n in args.lengths.split(",")}
        for store in stores
    }  # fmt: skip
    settings = {"lengths": args.lengths, "reps": args.reps, "queries": 64, "rows": ROWS,
                "shape": {"q_heads": HQ, "kv_heads": HKV, "head_dim": D}}  # fmt: skip
    common.write_json(args.out, common.record(settings=settings, per_layer=figures))
    print(figures, flush=True)


if __name__ == "__main__":
    main()
