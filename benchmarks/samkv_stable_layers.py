"""SamKV's stable layers ``N*`` for a model, by appendix A.2 (``redknot.recovery.samkv.calibrate``).

Runs the ``samkv`` policy's selection on calibration cases through the reference path (CPU or
GPU), sums each layer's votes (the layers where every document's best-on-average block is a
PauTa outlier) and names the window of ``--width`` consecutive layers with the most votes:
the ``samkv_stable_from`` to evaluate with (``python -m redknot.eval fidelity ...
--samkv-stable-from N``).

    python benchmarks/samkv_stable_layers.py --cases benchmarks/cases/long_v1.jsonl --limit 8 \
        --out benchmarks/results/samkv_stable_layers.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

from redknot.eval.cases import load_cases
from redknot.eval.reference_backend import ReferenceBackend
from redknot.headmap.provenance import git_commit
from redknot.recovery import RecoveryOptions, create_policy, serve
from redknot.recovery.samkv.calibrate import layer_votes, stable_window


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="benchmarks/cases/long_v1.jsonl")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--head-map", default="configs/heads/smollm2-135m-instruct.json")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--width", type=int, default=4, help="samkv_stable_layers")
    ap.add_argument("--block", type=int, default=16, help="samkv_block")
    ap.add_argument("--sigma", type=float, default=3.0, help="PauTa threshold")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    commit, dirty = git_commit()  # the code this run loads (REDKNOT_COMMIT on the GPU copy)
    backend = ReferenceBackend.load(args.model, args.head_map, device=args.device)
    options = RecoveryOptions(samkv_block=args.block, samkv_stable_layers=args.width)
    cases = load_cases(args.cases)[: args.limit]
    total = None
    per_case = []
    for case in cases:
        started = time.perf_counter()
        prompt = backend._prompt(backend.composed(case), None)
        policy = create_policy("samkv", prompt, shape=backend.runner.shape,
                               head_map=backend.head_map, options=options)  # fmt: skip
        serve(backend.runner, policy, max_new_tokens=1)
        votes = layer_votes(policy.report.block_scores, sigma=args.sigma)
        total = votes if total is None else total + votes
        per_case.append(
            {
                "case": case.id,
                "documents": len(policy.report.block_scores),
                "votes": votes.tolist(),
                "wall_s": time.perf_counter() - started,
            }
        )
        print(case.id, votes.tolist(), flush=True)
    start = stable_window(total, args.width)
    n = int(total.shape[0])
    result = {
        "device": args.device if args.device == "cpu" else torch.cuda.get_device_name(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "commit": (commit or "unknown")[:7],
        "git_dirty": dirty,
        "command": "python " + " ".join([sys.argv[0], *(argv or sys.argv[1:])]),
        "model": backend.model_name,
        "cases": args.cases,
        "settings": {"width": args.width, "samkv_block": args.block, "sigma": args.sigma},
        "votes": total.tolist(),
        "stable_from": start,
        "stable_layers": list(range(start, start + args.width)),
        "last_layers": list(range(n - args.width, n)),
        "per_case": per_case,
    }
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(json.dumps({k: result[k] for k in ("votes", "stable_layers", "last_layers")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
