"""Summarise ``REDKNOT_HOST_SAMPLE_LOG`` files (see sitecustomize.py): the host time of the
sampled batches per function, exclusive (innermost frame) and inclusive (anywhere on the stack),
and per line of redknot's code, in milliseconds (samples x period).

    python scripts/diag_site/host_sample_summary.py /tmp/host.*.json --top 40 --out summary.json
"""

import argparse
import json
from collections import Counter


def function(frame: str) -> str:
    return frame.rsplit(":", 1)[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--in-timeline", action="store_true",
                    help="only samples taken while a layer timeline was recording")
    ap.add_argument("--out")
    args = ap.parse_args()
    exclusive, inclusive, lines = Counter(), Counter(), Counter()
    total, period = 0, None
    for path in args.files:
        with open(path) as f:
            record = json.load(f)
        period = record["period_ms"]
        for stack in record["stacks"]:
            n, frames = stack["n"], stack["frames"]
            if args.in_timeline and not stack.get("in_timeline"):
                continue
            total += n
            exclusive[function(frames[0])] += n
            for fn in {function(fr) for fr in frames}:
                inclusive[fn] += n
            mine = next((fr for fr in frames if fr.startswith("redknot/")), None)
            if mine is not None:
                lines[mine] += n
    ms = lambda n: round(n * period, 1)  # noqa: E731
    summary = {
        "period_ms": period,
        "sampled_ms": ms(total),
        "exclusive_ms": {k: ms(v) for k, v in exclusive.most_common(args.top)},
        "inclusive_ms": {k: ms(v) for k, v in inclusive.most_common(args.top)},
        "innermost_redknot_line_ms": {k: ms(v) for k, v in lines.most_common(args.top)},
    }
    text = json.dumps(summary, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
