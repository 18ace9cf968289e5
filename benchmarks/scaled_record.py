"""A cost record with its host constants scaled, written for ``--redknot-cost-record``: a record
that is wrong on purpose, to see what a reuse gate does with it (standard library only, so that
it runs on the GPU machine before any environment is set up).

    python3 benchmarks/scaled_record.py --host-factor 0.3 --out /tmp/optimistic.json

The fields scaled are those ``redknot.costmodel.record.CostRecord.scaled`` scales (host per
layer, choices, planning, the fixed cost); the host probe is dropped, so that a server uses the
constants as written. ``ttft.py`` takes the file as a variant's knob
(``epic[reuse_gate=record,cost_record=/tmp/optimistic.json]``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

SHIPPED = Path(__file__).resolve().parents[1] / "redknot/costmodel/records"


def scaled(record: dict, factor: float) -> dict:
    out = dict(record)
    out["host_ms"] = {k: v * factor for k, v in record["host_ms"].items()}
    out["choose_ms"] = {k: v * factor for k, v in record.get("choose_ms", {}).items()}
    for key in ("plan_ms", "plan_ms_per_ktok", "fixed_ms"):
        out[key] = record[key] * factor
    out.pop("host_probe_ms", None)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--record", type=Path, default=SHIPPED / "nvidia-h100-80gb-hbm3.json")
    ap.add_argument("--host-factor", type=float, required=True)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    record = json.loads(args.record.read_text())
    out = scaled(record, args.host_factor)
    out["provenance"] = {
        "scaled_from": str(args.record),
        "scaled_from_commit": record.get("provenance", {}).get("commit"),
        "host_factor": args.host_factor,
        "note": "host constants scaled on purpose (benchmarks/scaled_record.py), not fitted",
    }
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
