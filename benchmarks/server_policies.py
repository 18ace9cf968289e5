"""Every served policy against the reference path: one row per server run
(``benchmarks/gpu_run.py fidelity``: a ``python -m redknot.eval fidelity --backend server`` result)
beside the ``benchmarks/results/policies.json`` row of the same policy and knobs (CPU reference
path, same weights, same cases), with how many generations are identical case by case.

    python benchmarks/server_policies.py benchmarks/results/fidelity_server_*.json \\
        --gpu "NVIDIA H100 80GB HBM3" --out benchmarks/results/policies_server.json

The reference row is found from the knobs the server resolved (its ``redknot_config``): the
row of the same policy whose options equal them on every knob of that policy. The server
never restores local heads, so ``restore_thresh`` is matched as null; a server from before
``--redknot-local-kv`` reused cached local K/V.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from redknot.recovery import POLICIES

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script from anywhere
from fidelity_agreement import agreement, run_record
from policies import rows_of

METRICS = ("top1", "top10", "exact_match", "contains")


def served_label(result: dict) -> str:
    labels = [s["label"] for s in result["settings"] if s["label"] != "full"]
    if len(labels) != 1:
        raise SystemExit(f"expected one served policy besides full, got {labels}")
    return labels[0]


def reference_row(rows: list[dict], policy: str, config: dict, path: str) -> dict:
    """The reference row of ``policy`` whose knobs equal the server's."""
    # servers from before --redknot-local-kv reused cached local K/V, and those from before
    # --redknot-restore-thresh did not restore
    served = {"local_kv": "cached", "restore_thresh": None, **config}
    knobs = list(POLICIES[policy].knobs)
    if served.get("restore_thresh") is None:  # the edge has no effect while restore is off
        knobs = [k for k in knobs if k != "restore_edge"]
    matches = [
        r
        for r in rows
        if r["policy"] == policy
        and all((r.get("options") or {}).get(k) == served.get(k) for k in knobs)
    ]
    if len(matches) != 1:
        wanted = {k: served.get(k) for k in knobs}
        raise SystemExit(
            f"{path}: {len(matches)} reference rows of {policy} with knobs {wanted}; run "
            "benchmarks/policies.py with that setting first"
        )
    return matches[0]


def compare(path: str, reference: dict) -> dict:
    served = json.loads(Path(path).read_text())
    label = served_label(served)
    config = served["servers"]["redknot"]["redknot_config"]
    policy = config.get("policy", "redknot")
    rows = reference["rows"] if "rows" in reference else rows_of(reference)  # policies.py's, or
    ref = reference_row(rows, policy, config, path)  # an evaluation's own result
    pairs = [("full", "full"), (label, ref["setting"])]
    agree = agreement(served, reference, pairs)
    dense, recovered = (agree["pairs"][f"{a} | {b}"] for a, b in pairs)
    knobs = {k: config.get(k) for k in POLICIES[policy].knobs if k in config}
    if config.get("restore_heads"):  # the server's cap on promotions per layer (none in the
        knobs["restore_heads"] = config["restore_heads"]  # reference)
    return {
        "file": path,
        "policy": policy,
        "reference_setting": ref["setting"],
        "server_knobs": knobs,
        "server_commit": served.get("git_commit"),
        "date": served.get("date"),
        "cases": agree["cases"],
        "server": {k: served["summary"][label][k] for k in METRICS},
        "reference": {k: ref[k] for k in METRICS + ("flops_fraction",)},
        "identical_outputs": recovered["identical_outputs"],
        "same_top1_with_dense": recovered["same_top1_with_dense"],
        "dense_identical_outputs": dense["identical_outputs"],
        "differing_cases": [c["id"] for c in recovered["differing_cases"]],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("served", nargs="+", help="fidelity_server_*.json files")
    ap.add_argument(
        "--reference",
        default="benchmarks/results/policies.json",
        help="benchmarks/policies.py's result, or a `python -m redknot.eval fidelity` result",
    )
    ap.add_argument("--gpu", required=True, help="the GPU the servers ran on (for the record)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    reference = json.loads(Path(args.reference).read_text())
    rows = [compare(p, reference) for p in args.served]
    result = {
        "benchmark": "policies_server",
        "device": args.gpu,
        **run_record("server_policies.py", argv),
        "gpu": args.gpu,
        "reference": args.reference,
        "reference_commit": reference.get("git_commit"),
        "reference_device": reference.get("device_detail"),
        "model": reference.get("model"),
        "rows": rows,
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"{'server run':34} {'reference setting':36} top-1 server/ref  EM server/ref  same/cases")
    for r in rows:
        s, f = r["server"], r["reference"]
        name = Path(r["file"]).name
        print(
            f"{name:34} {r['reference_setting']:36} {s['top1']:.3f} / {f['top1']:.3f}"
            f"    {s['exact_match']:.3f} / {f['exact_match']:.3f}   "
            f"{r['identical_outputs']}/{r['cases']} (dense {r['dense_identical_outputs']})"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
