"""Case-by-case agreement of two fidelity results on the same cases (``python -m redknot.eval
fidelity`` JSON), e.g. a redknot server on a GPU against the reference path on the CPU run with
the server's options: how many generations are identical, per setting pair.

    python benchmarks/fidelity_agreement.py benchmarks/results/fidelity_server_redknot.json \\
        benchmarks/results/fidelity_reference_bf16.json \\
        --pair full=full --pair redknot=redknot --out /tmp/agree_redknot.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shlex
import sys
from pathlib import Path

from redknot.headmap.provenance import git_commit


def agreement(a: dict, b: dict, pairs: list[tuple[str, str]]) -> dict:
    """For each (setting of ``a``, setting of ``b``): identical generations, equal first-token
    agreement with dense, and the cases that differ."""
    cases_b = {c["id"]: c for c in b["per_case"]}
    common = [c for c in a["per_case"] if c["id"] in cases_b]
    if not common:
        raise SystemExit("the two results share no case id")
    out = {"cases": len(common), "pairs": {}}
    for left, right in pairs:
        same_output, same_top1, differ = 0, 0, []
        for case in common:
            x, y = case["settings"][left], cases_b[case["id"]]["settings"][right]
            same_output += x["output"] == y["output"]
            same_top1 += x["top1"] == y["top1"]
            if x["output"] != y["output"]:
                differ.append({"id": case["id"], "a": x["output"], "b": y["output"]})
        out["pairs"][f"{left} | {right}"] = {
            "identical_outputs": same_output,
            "same_top1_with_dense": same_top1,
            "differing_cases": differ,
        }
    return out


def run_record(script: str, argv: list[str] | None) -> dict:
    """Date, commit and command of a run of ``benchmarks/<script>`` (for its result JSON)."""
    commit, dirty = git_commit()
    return {
        "date": dt.datetime.now(dt.UTC).replace(microsecond=0).isoformat(),
        "commit": commit,
        "git_dirty": dirty,
        "command": f"python benchmarks/{script} "
        + " ".join(shlex.quote(x) for x in (argv if argv is not None else sys.argv[1:])),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--pair", action="append", required=True, help="SETTING_A=SETTING_B")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    a, b = (json.loads(Path(p).read_text()) for p in (args.a, args.b))
    pairs = [tuple(p.split("=", 1)) for p in args.pair]
    result = {
        "device": f"{a.get('device')} ({a.get('device_detail')}) / "
        f"{b.get('device')} ({b.get('device_detail')})",
        **run_record("fidelity_agreement.py", argv),
        "a": args.a,
        "a_commit": a.get("git_commit"),
        "b": args.b,
        "b_commit": b.get("git_commit"),
        **agreement(a, b, pairs),
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    for name, row in result["pairs"].items():
        print(f"{name}: {row['identical_outputs']} / {result['cases']} identical generations")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
