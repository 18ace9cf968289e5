"""Joins the two runs of ``benchmarks/gpu_run.py ab`` (the same ``benchmarks/ttft.py`` point at two
commits, one machine, minutes apart) into one JSON: per variant and point, the median TTFT and
samples of each commit and the old-over-new ratio; both runs are kept whole under ``runs``.

    python benchmarks/ab_join.py --old ttft_ab_old.json --new ttft_ab_head.json \\
        --note "what changed" --out benchmarks/results/ttft_ab_NAME.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", required=True)
    ap.add_argument("--new", required=True)
    ap.add_argument("--note", default="")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    old, new = (json.loads(Path(p).read_text()) for p in (args.old, args.new))
    if old["device"] != new["device"]:
        raise SystemExit(f"runs from two devices: {old['device']} / {new['device']}")
    compared = {}
    for name, variant in new["variants"].items():
        for key, point in variant["points"].items():
            before = old["variants"].get(name, {}).get("points", {}).get(key)
            if before is None:
                continue
            compared.setdefault(name, {})[key] = {
                "old_ttft_s": before["ttft_s"], "old_samples_s": before["ttft_samples_s"],
                "new_ttft_s": point["ttft_s"], "new_samples_s": point["ttft_samples_s"],
                "old_over_new": before["ttft_s"] / point["ttft_s"],
            }  # fmt: skip
    joined = {
        "benchmark": "ttft_ab",
        "device": new["device"],
        "date": new["date"],
        "commit": f"{new['commit']} against {old['commit']}",
        "commits": {"new": new["commit"], "old": old["commit"]},
        "command": f"python {' '.join(sys.argv)} (runs: {old['command']} / {new['command']})",
        "note": args.note,
        "compared": compared,
        "runs": {"old": old, "new": new},
    }
    Path(args.out).write_text(json.dumps(joined, indent=1) + "\n")
    print(json.dumps(compared, indent=1))


if __name__ == "__main__":
    main()
