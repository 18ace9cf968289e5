"""The extend kernel with global rows' keys split over programs, against the same launch
unsplit, on one GPU (Llama-3.1-8B attention, a 1/8-global layer, sink 64 + window 256, local
heads in a ring store; ``segpaged_kernels.py``'s timer and layer).

Two shapes where few query tiles attend long rows, so that an unsplit launch leaves most SMs
idle:

- ``question``: ``E`` new tokens over a cached prefix of ``P`` tokens (a follow-up turn of a long
  chat or agent session); also dense FlashInfer (paged prefill, every head) for scale;
- ``held_rows``: the rows segment reuse keeps in a deep layer of a ``L``-token prompt (the last
  ``recent`` rows and ``scattered`` others), gathered into tiles, with the LSE (the layer
  schedule's importance reads it), as ``SegPagedRunner.extend`` runs them.

    python benchmarks/extend_split.py --out benchmarks/results/extend_split.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from segpaged_kernels import (
    DEV,
    HKV,
    HQ,
    RING_LEN,
    SCALE,
    D,
    Timer,
    attempt,
    bench_arguments,
    layer_of,
    paged_prefill,
    rand,
    result_header,
    save_row,
)

from redknot.kernels.extend import (
    choose_extend_splits,
    gather_tiles,
    plan_extend,
    run_extend,
)
from redknot.kernels.geometry import num_sms


def stores(keys: int, num_global: int):
    """Global store of ``keys`` slots (request 0's table maps position i to slot i) and one
    request's ring."""
    r2t = torch.arange(keys, dtype=torch.int32, device=DEV).view(1, keys)
    kg, vg = rand(keys, num_global, D), rand(keys, num_global, D)
    kl, vl = rand(RING_LEN, HKV - num_global, D), rand(RING_LEN, HKV - num_global, D)
    return kg, vg, kl, vl, r2t


def timed_pair(row: dict, timer: Timer, plan, q, k, v, st, heads, lse) -> None:
    """``ms_unsplit`` and ``ms_split`` (the splits ``run_extend`` chooses) of one launch, and
    ``ms_split_<n>_runs`` for other run counts (what ``ExtendConfig.max_splits`` was set from)."""
    out = torch.empty_like(q)
    splits = choose_extend_splits(plan, heads.num_global, num_sms(q.device))
    row["num_splits"] = splits
    runs = [("unsplit", 1), ("split", splits)]
    runs += [(f"split_{n}_runs", n) for n in (4, 8, 16, 32, 64) if n != splits]  # the cap's choice
    for name, n in runs:
        attempt(row, name, timer, lambda n=n: lambda: run_extend(
            plan, q, k, v, *st, heads, SCALE, out=out, lse=lse, num_splits=n))  # fmt: skip
    if row.get("ms_unsplit") and row.get("ms_split"):
        row["speedup_split"] = row["ms_unsplit"] / row["ms_split"]


def question_case(P: int, E: int, timer: Timer) -> dict:
    _, heads, geo = layer_of(1 / 8)
    G = heads.num_global
    row = {"shape": "question", "P": P, "E": E, "num_global_heads": G}
    q, k, v = rand(E, HQ, D), rand(E, HKV, D), rand(E, HKV, D)
    st = stores(P + E, G)
    plan = plan_extend(geo, torch.zeros(1, dtype=torch.int64, device=DEV), [P], [E])
    timed_pair(row, timer, plan, q, k, v, st, heads, None)

    kd, vd = rand(P + E, 1, HKV, D), rand(P + E, 1, HKV, D)
    attempt(row, "dense_flashinfer", timer, lambda: paged_prefill(q, kd, vd))
    if row.get("ms_dense_flashinfer") and row.get("ms_split"):
        row["speedup_split_vs_dense_flashinfer"] = row["ms_dense_flashinfer"] / row["ms_split"]
    return row


def held_rows_case(L: int, recent: int, scattered: int, timer: Timer) -> dict:
    _, heads, geo = layer_of(1 / 8)
    G = heads.num_global
    row = {"shape": "held_rows", "L": L, "rows": recent + scattered, "num_global_heads": G}
    g = torch.Generator().manual_seed(0)
    others = torch.randperm(L - recent, generator=g)[:scattered]
    rows = torch.cat([others.sort().values, torch.arange(L - recent, L)]).to(DEV)
    k, v = rand(L, HKV, D), rand(L, HKV, D)
    q = rand(rows.numel(), HQ, D)
    st = stores(1, G)  # no prefix: the keys are this extend's
    plan = plan_extend(geo, torch.zeros(1, dtype=torch.int64, device=DEV), [0], [L])
    plan = gather_tiles(plan, rows, [rows.numel()])
    lse = torch.empty(rows.numel(), HQ, dtype=torch.float32, device=DEV)
    timed_pair(row, timer, plan, q, k, v, st, heads, lse)
    return row


def main() -> None:
    args = bench_arguments(
        __doc__.splitlines()[0], "benchmarks/results/extend_split.json"
    ).parse_args()
    timer = Timer()
    result = result_header(args.commit, num_sms=num_sms(DEV))
    cases = [(question_case, (P, E)) for P in (8192, 32768, 131072) for E in (64, 512)]
    cases += [(held_rows_case, (L, 128, n)) for L in (32768, 65536) for n in (64, 1024)]
    for fn, case in cases:
        row = fn(*case, timer)
        save_row(result, row, args.out)
        print(json.dumps({k: v for k, v in row.items() if k != "timing"}), flush=True)


if __name__ == "__main__":
    main()
