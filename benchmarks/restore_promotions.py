"""Promotions of adaptive restore per request: a redknot server's log (one ``redknot restore:``
line per prefill that completes a reusing prompt) next to the reference path's count per case
(``restored_heads`` of a ``python -m redknot.eval fidelity`` result), in case order.

    python benchmarks/restore_promotions.py server_restore.log \
        --reference benchmarks/results/fidelity_restore.json --gpu H100 \
        --out benchmarks/results/restore_promotions.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script from anywhere
from fidelity_agreement import run_record

LINE = re.compile(r"redknot restore: (\d+) local heads promoted .*? in (\d+) request\(s\); (\d+)")


def promotions(log_text: str) -> list[dict]:
    """Each restore line of a server log: heads promoted, requests restored and not."""
    return [
        {"promoted": int(m[1]), "restored_requests": int(m[2]), "not_restored": int(m[3])}
        for m in map(LINE.search, log_text.splitlines())
        if m
    ]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("log", help="the redknot server's log")
    ap.add_argument("--reference", required=True, help="a reference-path fidelity result")
    ap.add_argument("--gpu", required=True, help="the GPU the server ran on (for the record)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    served = promotions(Path(args.log).read_text())
    reference = json.loads(Path(args.reference).read_text())
    label = next(k for k in reference["summary"] if k != "full")
    ref = [c["settings"][label]["restored_heads"] for c in reference["per_case"]]
    counts = [p["promoted"] for p in served]
    result = {
        "benchmark": "restore_promotions",
        "device": args.gpu,
        **run_record("restore_promotions.py", argv),
        "gpu": args.gpu,
        "reference": args.reference,
        "reference_setting": label,
        "server_per_request": served,
        "server_mean": sum(counts) / max(len(counts), 1),
        "reference_per_case": ref,
        "reference_mean": sum(ref) / max(len(ref), 1),
        "same_count_cases": sum(a == b for a, b in zip(counts, ref)),
        "cases": min(len(counts), len(ref)),
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"server {counts} mean {result['server_mean']:.3f}")
    print(f"reference {ref} mean {result['reference_mean']:.3f}")
    print(f"same count in {result['same_count_cases']} of {result['cases']} cases")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
