"""One layer's attention of a token policy's rows in recovery, every way the server can run it,
side by side on one GPU (Llama-3.1-8B attention: 32 query / 8 KV heads, D 128, bf16, every
head global; ``segpaged_kernels.py``'s timer).

A reusing prompt of ``L`` tokens in 8 cached segments and a 64-token question; the rows a deep
layer still computes, as each policy holds them:

- ``epic``: the first 16 rows of each segment and the question (EPIC 16: 9 runs);
- ``cacheblend``: 15% of the segment rows at random and the question (CacheBlend 0.15, whose
  rows are chosen one by one by their K/V deviation).

Methods (``redknot.kernels.held_rows``; every key already in the pool, as the server has it):

- ``runs_fa2`` / ``runs_fa3``: FlashInfer's paged prefill over runs of consecutive rows, with
  FlashInfer's FA2 kernels (what the server plans: SGLang's ``prefill_backend``) or FA3;
- ``blocks_fa2`` / ``blocks_fa3`` / ``blocks_fa3_fa2``: blocks of 32 rows, the keys before each
  block unmasked and its own span under a custom mask, merged (built, not served), on FA2, FA3
  (which may refuse the mask: noted), or FA3 with the masked part on FA2;
- ``triton``: redknot's SegPaged extend kernel over the rows gathered into tiles (what the
  server runs where runs do not pay), reading the layer's keys from ``k``/``v``;
- ``dense``: FlashInfer's causal prefill of every row of the prompt (FA2), for the FLOP scale;
- ``triton_MxNwWsS`` (``--extend-configs``): the Triton kernel again under other launch
  constants (``ExtendConfig``: ``M`` query rows a tile, ``N`` keys a block, ``W`` warps, ``S``
  stages), each checked against the default's output: the sweep for the rows in recovery.

Per method: ms per call (CUDA graphs, L2 flushed), the keys it reads per KV head and the rate
of those reads (K and V, TB/s), and its largest difference from the Triton kernel's output
(``max_abs_err_*``); per case: the held rows' attention FLOPs over the dense prefill's, and the
host time of planning (runs and blocks).

    python benchmarks/held_rows.py --out benchmarks/results/held_rows.json
    python benchmarks/held_rows.py --policies cacheblend --lengths 32768 \\
        --extend-configs 128x64w8s3,128x128w8s2,64x64w4s3 --out held_rows_sweep.json
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

HQ, HKV, D = 32, 8, 128
SEGMENTS, QUESTION, EPIC_K, BLEND_RATIO = 8, 64, 16, 0.15
# (decomposition, FlashInfer backend, the blocks' masked part's backend if another)
METHODS = [("runs", "fa2", None), ("runs", "fa3", None), ("blocks", "fa2", None),
           ("blocks", "fa3", None), ("blocks", "fa3", "fa2")]  # fmt: skip


def held_set(policy: str, L: int, seed: int = 0) -> torch.Tensor:
    """``[L + QUESTION]`` bool, the rows ``policy`` holds in a deep layer of a prompt of ``L``
    segment tokens in ``SEGMENTS`` equal segments followed by the question."""
    keep = torch.zeros(L + QUESTION, dtype=torch.bool)
    keep[L:] = True
    seg = L // SEGMENTS
    if policy == "epic":
        for s in range(SEGMENTS):
            keep[s * seg : s * seg + EPIC_K] = True
    elif policy == "cacheblend":
        g = torch.Generator().manual_seed(seed)
        keep[:L] = torch.rand(L, generator=g) < BLEND_RATIO
    else:
        raise ValueError(f"unknown policy {policy!r}: epic or cacheblend")
    return keep


def attention_flops(keep: torch.Tensor) -> int:
    """Attention FLOPs of the rows ``keep`` marks (row ``i`` over keys ``0..i``, QK and PV, every
    query head), as the TTFT benchmark counts them."""
    pos = torch.nonzero(keep)[:, 0].to(torch.int64)
    return int(4 * HQ * D * (pos + 1).sum())


def read_rate(keys: int, ms: float | None) -> float | None:
    """TB/s of reading ``keys`` keys and values of every KV head in ``ms``."""
    return None if not ms else keys * HKV * D * 2 * 2 / (ms * 1e-3) / 1e12


def extend_config(text: str):
    """``"128x64w8s3"`` -> ``ExtendConfig(block_m=128, block_n=64, num_warps=8, num_stages=3)``."""
    from redknot.kernels.extend import ExtendConfig

    m = re.fullmatch(r"(\d+)x(\d+)w(\d+)s(\d+)", text.strip())
    if not m:
        raise SystemExit(f"--extend-configs: {text!r} is not MxNwWsS, e.g. 128x64w8s3")
    block_m, block_n, warps, stages = map(int, m.groups())
    return ExtendConfig(block_m=block_m, block_n=block_n, num_warps=warps, num_stages=stages)


def held_case(
    policy: str, L: int, timer, extend_configs: tuple[str, ...] = (), triton_only: bool = False
) -> dict:
    from segpaged_kernels import (
        DEV,
        DTYPE,
        SCALE,
        attempt,
        flashinfer_workspace,
        layer_of,
        paged_prefill,
        rand,
    )

    from redknot.kernels.extend import gather_tiles, plan_extend, run_extend
    from redknot.kernels.held_rows import (
        HeldRowsAttention,
        row_blocks,
        row_runs,
    )

    T = L + QUESTION
    keep = held_set(policy, L)
    n = int(keep.sum())
    qo, prefix = torch.tensor([0, T], dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    r2t = torch.arange(T, dtype=torch.int32, device=DEV).view(1, T)
    rpi = torch.zeros(1, dtype=torch.int64, device=DEV)
    k, v, q = rand(T, HKV, D), rand(T, HKV, D), rand(n, HQ, D)
    row = {"policy": policy, "L": L, "tokens": T, "held_rows": n}
    dense_flops = attention_flops(torch.ones(T, dtype=torch.bool))
    row["flop_ratio"] = dense_flops / attention_flops(keep)
    runs, blocks = row_runs(keep, qo, prefix), row_blocks(keep, qo, prefix, 32)
    row.update(runs=runs.num_runs, keys_runs=runs.keys_read, blocks=blocks.num_blocks)
    row["keys_blocks"] = row["keys_triton"] = blocks.keys_read  # the kernel's tiles: 32 rows
    outputs = {}  # the Triton kernel's output: every other method is checked against it

    def triton(config: str | None = None):
        _, heads, geo = layer_of(1.0)
        rows = torch.nonzero(keep)[:, 0].to(DEV)
        cfg = {} if config is None else {"config": extend_config(config)}
        plan = gather_tiles(plan_extend(geo, rpi, [0], [T], **cfg), rows, [n])
        dummy = torch.zeros((1, 1, D), dtype=DTYPE, device=DEV)
        out = torch.empty_like(q)

        def call():
            return run_extend(plan, q, k, v, k, v, dummy, dummy, r2t, heads, SCALE, out=out)

        if config is None:
            outputs["triton"] = call().clone()
        elif "triton" in outputs:  # the same attention as the default's
            default = outputs["triton"]
            err = (call().float() - default.float()).abs().max()
            row[f"max_abs_err_triton_{config}"] = float(err)
        return call

    attempt(row, "triton", timer, triton)
    reference = outputs.get("triton")
    row["tb_s_triton"] = read_rate(row["keys_triton"], row["ms_triton"])
    for config in extend_configs:
        attempt(row, f"triton_{config}", timer, lambda config=config: triton(config))
    if triton_only:  # a launch-constant sweep: no FlashInfer plan to compile on a fresh machine
        return row

    workspace = flashinfer_workspace()
    for method, backend, within in METHODS:
        name = f"{method}_{backend}" + (f"_{within}" if within else "")

        def make(method=method, backend=backend, within=within, name=name):
            held = HeldRowsAttention.on_flashinfer(
                workspace, HQ, HKV, D, DTYPE, backend=backend, sm_scale=SCALE,
                within_backend=within,
            )  # fmt: skip
            held.force, held.blocks = method, True
            t0 = time.perf_counter()
            held.plan(keep, qo, prefix, rpi, r2t, 32)
            if q.is_cuda:
                torch.cuda.synchronize()
            row[f"plan_host_ms_{name}"] = (time.perf_counter() - t0) * 1e3

            def call():
                return held.run(q, k, v, SCALE)

            if reference is not None:  # the same attention as the Triton kernel's
                err = (call().float() - reference.float()).abs().max()
                row[f"max_abs_err_{name}"] = float(err)
            return call

        attempt(row, name, timer, make)
        row[f"tb_s_{name}"] = read_rate(row[f"keys_{method}"], row[f"ms_{name}"])

    def dense():
        return paged_prefill(rand(T, HQ, D), k.unsqueeze(1), v.unsqueeze(1), workspace, "fa2")

    attempt(row, "dense", timer, dense)
    if row.get("ms_dense"):
        # the held rows' share of the dense prefill's time, at its FLOP rate
        row["ms_flop_ideal"] = row["ms_dense"] / row["flop_ratio"]
        for name in [n for n in row if n.startswith("ms_")]:
            name = name[3:]
            if name in ("dense", "flop_ideal"):
                continue
            if row.get(f"ms_{name}"):
                row[f"fraction_of_flop_ideal_{name}"] = row["ms_flop_ideal"] / row[f"ms_{name}"]
    return row


def main() -> None:
    from segpaged_kernels import Timer, bench_arguments, result_header, save_row

    ap = bench_arguments(__doc__.splitlines()[0], "benchmarks/results/held_rows.json")
    ap.add_argument("--lengths", default="8192,32768,65536")
    ap.add_argument("--policies", default="epic,cacheblend")
    ap.add_argument(
        "--extend-configs",
        default="",
        help="the Triton kernel also under these launch constants, MxNwWsS,...",
    )
    ap.add_argument(
        "--triton-only",
        action="store_true",
        help="only the Triton kernel (with --extend-configs: its sweep), no FlashInfer method",
    )
    args = ap.parse_args()
    configs = tuple(c for c in args.extend_configs.split(",") if c)
    for c in configs:
        extend_config(c)  # refuse a malformed one before the GPU work
    import flashinfer

    timer = Timer()
    result = result_header(args.commit, flashinfer=flashinfer.__version__)
    for policy in args.policies.split(","):
        for L in map(int, args.lengths.split(",")):
            row = held_case(policy, L, timer, configs, args.triton_only)
            save_row(result, row, args.out)
            print(json.dumps({k: v for k, v in row.items() if k != "timing"}), flush=True)


if __name__ == "__main__":
    main()
