"""RoPE alignment (fused copy + delta-RoPE) against plain copies of the same bytes, on one GPU.

    python benchmarks/rope_align.py --out benchmarks/results/rope_align.json
    python benchmarks/rope_align.py --layers 32 --out rope_align_layers.json

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

With ``--layers N`` it also moves the same rows in every one of ``N`` such layers (K and V,
each layer allocated on its own as the server's region and pool are) in one
``rope_align_layers`` launch, two ways (``layered``): ``grid`` (a program per rows and layer,
as served) and ``loop`` (each program moves its rows in every layer in turn, the rows'
rotation computed once: ``RopeAlignConfig.layer_loop``), checked equal to each other.

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

from redknot.kernels.rope_align import (
    LayerStack,
    RopeAlignConfig,
    alignable_rope,
    rope_align,
    rope_align_layers,
)
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


def moved_rows(rows: int, seed: int, dev: str) -> tuple[torch.Tensor, ...]:
    """What is moved: ``rows`` random rows of a store of ``rows + 1024`` to random rows of a pool
    of ``2 * rows``, half of them forward by 90000 positions and half back to the start
    (``src_rows, dst_rows, pos_off, pos_on``)."""
    gen = torch.Generator().manual_seed(seed)
    seg = torch.arange(rows // 2)
    src_rows = torch.randperm(rows + 1024, generator=gen)[:rows]
    dst_rows = torch.randperm(2 * rows, generator=gen)[:rows]
    pos_off, pos_on = torch.cat([seg, seg + 100000]), torch.cat([seg + 90000, seg])
    return tuple(t.to(dev) for t in (src_rows, dst_rows, pos_off[:rows], pos_on[:rows]))


def setup(dev: str) -> dict:
    rope = sglang_rope(D, D, 131072, 500000, True, LLAMA31_ROPE)
    spec = alignable_rope(rope)
    src_rows, dst_rows, pos_off, pos_on = moved_rows(ROWS, 0, dev)
    t = {
        "cache": spec.cos_sin_cache.to(dev),
        "src_rows": src_rows,
        "dst_rows": dst_rows,
        "pos_off": pos_off,
        "pos_on": pos_on,
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


def layered_methods(dev: str, layers: int, rows: int = ROWS) -> dict:
    """``rope_align_layers`` of ``rows`` rows (K and V) in each of ``layers`` layers, as served
    (``grid``) and with each program looping over the layers (``loop``); each entry is
    ``(callable, the destination's K and V layers)``."""
    spec = alignable_rope(sglang_rope(D, D, 131072, 500000, True, LLAMA31_ROPE))
    src_rows, dst_rows, pos_off, pos_on = moved_rows(rows, 1, dev)
    gen = torch.Generator(device=dev).manual_seed(1)  # the layers' K/V drawn where they live
    cache = spec.cos_sin_cache.to(dev)
    src = [
        [torch.randn(rows + 1024, HEADS, D, generator=gen, device=dev).to(DTYPE)
         for _ in range(layers)]
        for _ in "kv"
    ]  # fmt: skip
    out = {}
    for name, loop in (("grid", False), ("loop", True)):
        dst = [[torch.zeros(2 * rows, HEADS, D, dtype=DTYPE, device=dev) for _ in range(layers)]
               for _ in "kv"]  # fmt: skip
        stacks = [LayerStack.of(t) for t in (src[0], dst[0], src[1], dst[1])]
        cfg = RopeAlignConfig(layer_loop=loop)

        def call(stacks=stacks, cfg=cfg):
            rope_align_layers(stacks[0], src_rows, stacks[1], dst_rows, pos_off, pos_on, cache,
                              is_neox=True, v_src=stacks[2], v_dst=stacks[3], config=cfg)  # fmt: skip

        out[name] = (call, dst)
    return out


def measure_layered(layers: int) -> dict:
    """The two ways of ``layered_methods`` at the 8B shape: ms, GB/s of K and V read and
    written over every layer, and whether their outputs are equal."""
    methods = layered_methods("cuda", layers)
    rows = {}
    for name, (call, _) in methods.items():
        call()
        ms = triton.testing.do_bench(call, warmup=5, rep=100, return_mode="median")
        moved = 2 * 2 * layers * ROWS * HEADS * D * DTYPE.itemsize
        rows[name] = {"ms": round(ms, 4), "GBps": round(moved / ms / 1e6, 1)}
    grid, loop = methods["grid"][1], methods["loop"][1]
    rows["outputs_equal"] = all(
        torch.equal(a, b) for kind in range(2) for a, b in zip(grid[kind], loop[kind])
    )
    rows["layers"] = layers
    return rows


def measure(fn, tensors: int) -> dict:
    ms = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
    moved = 2 * tensors * ROWS * HEADS * D * DTYPE.itemsize
    return {"ms": round(ms, 4), "GBps": round(moved / ms / 1e6, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/rope_align.json")
    ap.add_argument(
        "--layers",
        type=int,
        default=0,
        help="also move the rows in every one of this many layers in one launch",
    )
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
        **({"layered": measure_layered(args.layers)} if args.layers else {}),
    )
    common.write_json(args.out, record)


if __name__ == "__main__":
    main()
