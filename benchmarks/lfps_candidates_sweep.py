"""Launch settings of LFPS's candidate kernels (``lfps_candidates``: moments, mark, write) and
the Top-k that follows them, one layer at the 8B shape (8 selection heads, one per KV head), on
one GPU: which ``chunk`` / ``block`` / ``num_warps`` the defaults should be, and which of the
mark kernel's two ways of reading Eq. 9's shifts (``--marks``).

    python3 benchmarks/gpu_run.py bench lfps_candidates_sweep --lengths 32768,131072 --batch 8
    TRITON_INTERPRET=1 python benchmarks/lfps_candidates_sweep.py --device cpu --small  # smoke

Every setting's list is checked equal to the default's before it is timed (a setting that
changes the answer is reported, not ranked). Times: ``segpaged_kernels.Timer`` (CUDA graphs,
L2 flushed before each call). ``ms_topk`` is ``torch.topk`` of the candidates' rank at the
step's ``K``, for scale; ``topk_settings`` times the step's own Top-k (``lfps_topk``, a radix
select) at each ``--topk-blocks`` x ``--topk-warps`` x ``--topk-radix-bits`` (``0``: the
default) x ``--topk-early-exit`` (its passes stopped once the bin found holds exactly the keys
still wanted, or not), each checked equal to the PyTorch reference ``rank_topk_in_list_order``.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lfps_decode import FULL_SHAPE, SMALL_SHAPE, parse_ints, synthetic_state
from segpaged_kernels import Timer
from serving_common import record, write_json

MARKS = {"loads": False, "gather": True}  # --marks: lfps_candidates(mark_gather=...)


def trial(entry: dict, call, same, key: str, timer: Timer) -> dict:
    """``entry`` with ``key``: whether ``same(call())`` holds, and ``ms``: ``call`` timed;
    a setting that fails (does not compile, say) gets ``error`` instead: a finding, not an end."""
    try:
        entry[key] = bool(same(call()))
        entry["ms"], _ = timer(call)
    except Exception as e:  # noqa: BLE001
        entry["error"] = f"{type(e).__name__}: {str(e)[:200]}"
    return entry


def sweep_case(L: int, B: int, args, shape: dict, timer: Timer) -> dict:
    from redknot.kernels import lfps_index, lfps_step
    from redknot.lfps import LfpsParams
    from redknot.lfps.batched import rank_topk_in_list_order, row_budgets

    params = LfpsParams(budget=args.budget)
    dev, sink = args.device, params.num_sink
    k = params.budget_for(L - sink)
    capacity = min(L, args.candidate_factor * k)
    rows = shape["num_q_heads"] // shape["num_kv_heads"]
    state = synthetic_state(B, L, rows, shape, sink, args.table_sigma, dev)
    seq = torch.full((B,), L, device=dev, dtype=torch.int64)
    tables = (state.vertical, state.slash, state.scale, seq, params, capacity)
    default = (lfps_index.CANDIDATE_CHUNK, lfps_index.CANDIDATE_BLOCK, lfps_index.CANDIDATE_WARPS,
               lfps_index.MARK_GATHER)  # fmt: skip
    ref, ref_count = lfps_index.lfps_candidates(*tables)
    row = {"L": L, "B": B, "topk": k, "capacity": capacity, "default": list(default),
           "candidate_share": float(ref_count.float().mean()) / (L - sink), "settings": []}  # fmt: skip
    heads = shape["num_q_heads" if args.topk_rows == "query" else "num_kv_heads"]
    rank = torch.rand(B, heads, capacity, device=dev)
    row["ms_topk"], _ = timer(lambda: torch.topk(rank, k, dim=-1))
    want = rank_topk_in_list_order(rank, row_budgets(seq, params), k)
    row["topk_settings"] = []
    for block, warps, bits, early in itertools.product(
        args.topk_blocks, args.topk_warps, args.topk_bits, args.topk_early_exit
    ):
        kw = {"block": block or None, "num_warps": warps or None, "early_exit": bool(early)}
        kw |= {"radix_bits": bits} if bits else {}
        entry = trial(
            {"block": block, "num_warps": warps, "radix_bits": bits, "early_exit": bool(early)},
            lambda kw=kw: lfps_step.lfps_topk(rank, seq, params, k, **kw),
            lambda got: all(torch.equal(a, b) for a, b in zip(got, want)),
            "same_as_reference", timer,
        )  # fmt: skip
        row["topk_settings"].append(entry)
        print(f"L={L} B={B} lfps_topk", entry, flush=True)
    marks = [MARKS[m] for m in args.marks.split(",")]
    for chunk, block, warps, gather in itertools.product(
        args.chunks, args.blocks, args.warps, marks
    ):
        if block > chunk:
            continue
        kw = {"chunk": chunk, "block": block, "num_warps": warps, "mark_gather": gather}
        entry = trial(
            dict(kw),
            lambda kw=kw: lfps_index.lfps_candidates(*tables, **kw),
            lambda got: torch.equal(got[0], ref) and torch.equal(got[1], ref_count),
            "same_as_default", timer,
        )  # fmt: skip
        row["settings"].append(entry)
        print(f"L={L} B={B}", entry, flush=True)
    ok = [s for s in row["settings"] if s.get("same_as_default") and s.get("ms")]
    best = min(ok, key=lambda s: s["ms"], default=None)
    at_default = next(
        (s for s in ok if (s["chunk"], s["block"], s["num_warps"], s["mark_gather"]) == default),
        None,
    )
    row["best"] = best
    row["ms_default"] = at_default["ms"] if at_default else None
    return row


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="32768,131072")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--chunks", default="1024,2048,4096,8192")
    ap.add_argument("--blocks", default="256,512,1024,2048")
    ap.add_argument("--warps", default="2,4,8")
    ap.add_argument("--marks", default="loads,gather", help="the mark kernel's Eq. 9 shifts: "
                    "read again at every offset (loads) or gathered from the entries read "
                    "(gather), comma-separated")  # fmt: skip
    ap.add_argument("--topk-blocks", default="0,1024,4096")
    ap.add_argument("--topk-warps", default="0,8,16")
    ap.add_argument("--topk-radix-bits", default="0,5,8")
    ap.add_argument("--topk-early-exit", default="0,1",
                    help="the Top-k's passes run to the last (0) or stop once the bin found "
                    "holds exactly the keys still wanted (1), comma-separated")  # fmt: skip
    ap.add_argument("--topk-rows", choices=("kv", "query"), default="kv",
                    help="rows of the Top-k: one per KV head (the shared list) or per query head "
                    "(the union selection's first Top-k)")  # fmt: skip
    ap.add_argument("--budget", type=float, default=0.02)
    ap.add_argument("--candidate-factor", type=int, default=4)
    ap.add_argument("--table-sigma", type=float, default=4.0)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--small", action="store_true", help="a tiny shape (CPU smoke run)")
    ap.add_argument("--out", default="benchmarks/results/lfps_candidates_sweep.json")
    args = ap.parse_args(argv)
    unknown = set(args.marks.split(",")) - set(MARKS)
    if unknown:
        ap.error(f"--marks: {', '.join(sorted(unknown))} not among {', '.join(MARKS)}")
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    shape = dict(SMALL_SHAPE if args.small else FULL_SHAPE)
    lengths = parse_ints(args.lengths)
    if args.small:
        lengths, args.batch = [700], 2
        args.chunks, args.blocks, args.warps = "128,256", "64,128", "4"
        args.topk_blocks, args.topk_warps, args.topk_radix_bits = "0,16", "0", "0,8"
    args.chunks, args.blocks = parse_ints(args.chunks), parse_ints(args.blocks)
    args.warps = parse_ints(args.warps)
    args.topk_blocks, args.topk_warps = parse_ints(args.topk_blocks), parse_ints(args.topk_warps)
    args.topk_bits = parse_ints(args.topk_radix_bits)
    args.topk_early_exit = parse_ints(args.topk_early_exit)
    if not set(args.topk_early_exit) <= {0, 1}:
        ap.error(f"--topk-early-exit: {args.topk_early_exit} are not 0 or 1")
    timer = Timer(1 if args.small else 20, 1 if args.small else 5, device=args.device)
    result = record(
        shape=shape,
        batch=args.batch,
        table_sigma=args.table_sigma,
        topk_rows=args.topk_rows,
        candidate_factor=args.candidate_factor,
        rows=[],
    )
    for L in lengths:
        result["rows"].append(sweep_case(L, args.batch, args, shape, timer))
        write_json(args.out, result)


if __name__ == "__main__":
    main()
