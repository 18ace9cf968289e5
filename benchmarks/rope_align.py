"""RoPE alignment (fused copy + delta-RoPE) against plain copies of the same bytes, on one GPU.

    python benchmarks/rope_align.py --out benchmarks/results/rope_align.json

(On a machine whose checkout has no ``.git``, set ``REDKNOT_COMMIT`` to record the commit.)

Shape: Llama-3.1-8B keys of one layer (8 KV heads, D=128, bf16, llama3 RoPE table of 131072
positions), 32K rows moved from a snapshot store to random rows of a pool; half of them forward by
90000 positions, half back to the start. Rows are in random order on both sides.

Methods, each moving the same rows:

- ``rope_align_k`` / ``rope_align_kv``: ``redknot.kernels.rope_align`` (keys; keys and values).
- ``index_copy_k`` / ``index_copy_kv``: ``dst.index_copy_(0, dst_rows, gathered)`` of keys
  (and values) already gathered into a contiguous tensor: reads and writes the same bytes once.
- ``gather_scatter_k``: ``dst[dst_rows] = src[src_rows]`` (an extra temporary pass).
- ``unfused_torch_k``: gather, rotate with the fp32 reference, scatter (eager PyTorch).

``GB/s`` counts key (and value) bytes read plus written, ``2 * rows * heads * D * 2`` per tensor;
``table_MB`` is what ``rope_align`` also reads from the cos/sin table (4 rows of R/2 floats per
key row, before caching). Times are medians of ``triton.testing.do_bench`` (L2 flushed). The
``rope_align`` launch constants are swept (``sweep``; the default is ``RopeAlignConfig()``) and
``results`` use the fastest for keys and values.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch
import triton
import triton.testing

from redknot.kernels.rope_align import RopeAlignConfig, alignable_rope, rope_align
from redknot.kernels.rope_reference import (
    alignment_tolerance,
    delta_rotate,
    rope_align_reference,
    sglang_rope,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serving_common as common

ROWS, HEADS, D = 32768, 8, 128
DTYPE = torch.bfloat16
LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # fmt: skip
CONFIGS = [RopeAlignConfig(tile_elems=t, num_warps=w) for t in (2048, 4096, 8192) for w in (4, 8)]


def setup(dev: str) -> dict:
    rope = sglang_rope(D, D, 131072, 500000, True, LLAMA31_ROPE)
    spec = alignable_rope(rope)
    gen = torch.Generator().manual_seed(0)
    seg = torch.arange(ROWS // 2)
    store_rows = torch.randperm(ROWS + 1024, generator=gen)[:ROWS]
    pool_rows = torch.randperm(2 * ROWS, generator=gen)[:ROWS]
    t = {
        "cache": spec.cos_sin_cache.to(dev),
        "src_rows": store_rows.to(dev),
        "dst_rows": pool_rows.to(dev),
        "pos_off": torch.cat([seg, seg + 100000]).to(dev),
        "pos_on": torch.cat([seg + 90000, seg]).to(dev),
        "k_src": torch.randn(ROWS + 1024, HEADS, D, device=dev).to(DTYPE),
        "v_src": torch.randn(ROWS + 1024, HEADS, D, device=dev).to(DTYPE),
        "k_dst": torch.zeros(2 * ROWS, HEADS, D, device=dev, dtype=DTYPE),
        "v_dst": torch.zeros(2 * ROWS, HEADS, D, device=dev, dtype=DTYPE),
    }
    t["k_gathered"] = t["k_src"][t["src_rows"]].contiguous()
    t["v_gathered"] = t["v_src"][t["src_rows"]].contiguous()
    return t


def check(t: dict) -> None:
    """The kernel under measurement computes what the reference does (the tests' tolerance)."""
    args = (t["src_rows"], t["k_dst"], t["dst_rows"], t["pos_off"], t["pos_on"], t["cache"])
    expected, _ = rope_align_reference(t["k_src"], *args, is_neox=True)
    rope_align(t["k_src"], *args, is_neox=True)
    excess = (t["k_dst"].float() - expected.float()).abs() - alignment_tolerance(expected, D, True)
    assert (excess <= 0).all(), f"rope_align differs from its reference by {excess.max().item()}"


def methods(t: dict, config: RopeAlignConfig) -> dict:
    args = (t["src_rows"], t["k_dst"], t["dst_rows"], t["pos_off"], t["pos_on"], t["cache"])

    def unfused():
        src_k = t["k_src"][t["src_rows"]]
        rotated = delta_rotate(src_k, t["pos_off"], t["pos_on"], t["cache"], is_neox=True)
        t["k_dst"][t["dst_rows"]] = rotated.to(DTYPE)

    def rope_align_kv():
        rope_align(
            t["k_src"], *args, is_neox=True, v_src=t["v_src"], v_dst=t["v_dst"], config=config
        )

    def gather_scatter_k():
        t["k_dst"][t["dst_rows"]] = t["k_src"][t["src_rows"]]

    def index_copy_kv():
        t["k_dst"].index_copy_(0, t["dst_rows"], t["k_gathered"])
        t["v_dst"].index_copy_(0, t["dst_rows"], t["v_gathered"])

    return {  # name: (callable, tensors moved)
        "rope_align_k": (lambda: rope_align(t["k_src"], *args, is_neox=True, config=config), 1),
        "rope_align_kv": (rope_align_kv, 2),
        "index_copy_k": (lambda: t["k_dst"].index_copy_(0, t["dst_rows"], t["k_gathered"]), 1),
        "index_copy_kv": (index_copy_kv, 2),
        "gather_scatter_k": (gather_scatter_k, 1),
        "unfused_torch_k": (unfused, 1),
    }


def measure(fn, tensors: int) -> dict:
    ms = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
    moved = 2 * tensors * ROWS * HEADS * D * DTYPE.itemsize
    return {"ms": round(ms, 4), "GBps": round(moved / ms / 1e6, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/rope_align.json")
    args = ap.parse_args()
    dev = "cuda"
    t = setup(dev)
    check(t)
    sweep = []
    for config in CONFIGS:
        rows = {n: measure(fn, k) for n, (fn, k) in methods(t, config).items() if "rope" in n}
        sweep.append({"config": dataclasses.asdict(config), **rows})
        print(dataclasses.asdict(config), rows, flush=True)
    best = min(CONFIGS, key=lambda c: sweep[CONFIGS.index(c)]["rope_align_kv"]["ms"])
    results = {name: measure(fn, k) for name, (fn, k) in methods(t, best).items()}
    for name, row in results.items():
        print(f"{name:18s} {row['ms']:8.4f} ms {row['GBps']:8.1f} GB/s", flush=True)
    table_bytes = 4 * ROWS * (t["cache"].shape[1] // 2) * 4
    record = common.record(
        shape={
            "rows": ROWS,
            "kv_heads": HEADS,
            "head_dim": D,
            "dtype": str(DTYPE),
            "rope": LLAMA31_ROPE,
            "max_position": 131072,
        },
        torch=torch.__version__,
        triton=triton.__version__,
        best_config=dataclasses.asdict(best),
        table_MB=round(table_bytes / 1e6, 1),
        results=results,
        fraction_of_index_copy={
            "k": round(results["rope_align_k"]["GBps"] / results["index_copy_k"]["GBps"], 3),
            "kv": round(results["rope_align_kv"]["GBps"] / results["index_copy_kv"]["GBps"], 3),
        },
        sweep=sweep,
    )
    common.write_json(args.out, record)


if __name__ == "__main__":
    main()
