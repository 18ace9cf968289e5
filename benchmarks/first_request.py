"""The first reusing prompt after startup, before and after a change: joins two results of
``benchmarks/ttft.py --compile-log`` (one engine each, e.g. the two runs of
``benchmarks/gpu_run.py ab ... bench ttft ... --compile-log``) into one JSON: per point, the TTFT of the
engine's first prompt of its kind next to the later ones, and the Triton kernels compiled in it
and at startup. Both runs must come from the same device.

    python benchmarks/first_request.py --old ttft_ab_old.json --new ttft_ab_head.json \\
        --out benchmarks/results/first_request.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serving_common as common


def first_prompts(run: dict) -> dict:
    """Per variant: the launch_server warm-up's time, kernels compiled by startup, and per point
    the first prompt's TTFT, the later ones' and what compiled in the first."""
    out = {}
    for name, variant in run["variants"].items():
        out[name] = {
            "server_warmup_s": variant.get("server_warmup_s"),
            "triton_compiled_at_startup": variant.get("triton_compiled_at_startup"),
            "points": {
                key: {
                    "first_ttft_s": p["warmup_ttft_s"],
                    "later_ttft_s": p["ttft_samples_s"],
                    "triton_compiled_in_first": p.get("triton_compiled_in_warmup"),
                }
                for key, p in variant["points"].items()
            },
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", required=True)
    ap.add_argument("--new", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    runs = {k: json.loads(Path(p).read_text()) for k, p in (("old", args.old), ("new", args.new))}
    if runs["old"]["device"] != runs["new"]["device"]:
        raise SystemExit(
            f"runs of different devices: {runs['old']['device']} / {runs['new']['device']}"
        )
    result = {
        "benchmark": "first_request",
        "device": runs["new"]["device"],
        "date": runs["new"]["date"],
        "commit": runs["new"]["commit"],
        "old_commit": runs["old"]["commit"],
        "command": " ".join([Path(sys.executable).name] + sys.argv),
        "runs": {
            k: {"commit": r["commit"], "date": r["date"], "command": r["command"]}
            for k, r in runs.items()
        },
        "old": first_prompts(runs["old"]),
        "new": first_prompts(runs["new"]),
    }
    common.write_json(args.out, result)
    print(json.dumps({k: result[k] for k in ("old", "new")}, indent=1)[:3000])


if __name__ == "__main__":
    main()
