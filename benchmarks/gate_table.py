"""What the reuse gate decides on a device record: predicted TTFT with reuse / recomputed, and the
decision, for prompts of 8 cached segments plus a 64-token question, per policy (CPU, no GPU).

    python benchmarks/gate_table.py --record redknot/costmodel/records/nvidia-h100-80gb-hbm3.json

Each row is a ``benchmarks/ttft.py`` variant modelled as ``reuse_cost.py`` models it for the fit
(its head layout as the server runs it: every head global under EPIC, CacheBlend and SparseX,
the synthetic 1/8 map with 8 dense layers for redknot). ``--model`` takes any model directory
with a ``config.json`` (default: the 8B shape); ``--host-probe-ms`` scales the record's host
constants as a server on a machine of that probe does. Prints one markdown table (``R``: served with
reuse, ``P``: recomputed)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serving_common as common
from reuse_cost import variant_model

from redknot.costmodel.gate import ReuseGate
from redknot.costmodel.host_probe import host_scale
from redknot.costmodel.model import PromptWork, ReuseCostModel
from redknot.costmodel.record import CostRecord

ROWS = (("redknot (1/8 map, dense layers 8)", "redknot-g0.125-reuse-sparse-cached"),
        ("EPIC", "epic"), ("CacheBlend", "cacheblend"), ("SparseX", "sparsex"))  # fmt: skip


def gate_of(cfg: dict, record: CostRecord, variant: str) -> ReuseGate:
    """The gate a server of ``variant`` builds on ``record`` (scaled as the caller chose)."""
    costs, recovery, _, _ = variant_model(variant, cfg, None)
    return ReuseGate(ReuseCostModel(costs, recovery, record))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--record", required=True)
    ap.add_argument("--model", default=common.DEFAULT_MODEL, help="model dir with config.json")
    ap.add_argument("--sizes", default="1024,2048,4096,8192,16384,32768,65536")
    ap.add_argument("--question", type=int, default=64)
    ap.add_argument(
        "--host-probe-ms",
        type=float,
        default=None,
        help="a machine's host probe (a ttft.py result's host_probe_ms): the record's host "
        "constants scaled as a server on that machine scales them; default: as recorded",
    )
    args = ap.parse_args()
    cfg = json.loads(Path(args.model, "config.json").read_text())
    record = CostRecord.read(args.record)
    if args.host_probe_ms is not None:
        factor, said = host_scale(args.host_probe_ms, record.host_probe_ms)
        record = record.scaled(factor)
        print(said)
    sizes = [int(s) for s in args.sizes.split(",")]
    print(f"| {Path(args.model).name} | " + " | ".join(f"{s / 1024:g}K" for s in sizes) + " |")
    print("| --- " * (len(sizes) + 1) + "|")
    for label, variant in ROWS:
        gate = gate_of(cfg, record, variant)
        cells = []
        for size in sizes:
            per = size // 8
            work = PromptWork(size + args.question, 0, tuple((i * per, per) for i in range(8)))
            d = gate.decide(work)
            cells.append(f"{'R' if d.reuse else 'P'} {d.reuse_ms:.0f}/{d.plain_ms:.0f}")
        print(f"| {label} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
