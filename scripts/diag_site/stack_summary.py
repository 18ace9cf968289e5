"""Summarise ``REDKNOT_STACK_SAMPLE_LOG`` samples (see sitecustomize.py) taken in a time window:
per process, the most frequent stacks (innermost ``--depth`` frames), with their sample counts
(each sample is 0.5 s).

    python scripts/diag_site/stack_summary.py /tmp/stacks.jsonl --start T0 --seconds 12
"""

import argparse
import json
from collections import Counter, defaultdict


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("log")
    ap.add_argument("--start", type=float, required=True, help="wall-clock start (time.time())")
    ap.add_argument("--seconds", type=float, required=True)
    ap.add_argument("--depth", type=int, default=10)
    ap.add_argument("--top", type=int, default=4)
    args = ap.parse_args()
    per_pid: dict[tuple, Counter] = defaultdict(Counter)
    with open(args.log) as f:
        for line in f:
            r = json.loads(line)
            if args.start <= r["t"] <= args.start + args.seconds:
                per_pid[(r["pid"], r["argv0"])][tuple(r["frames"][: args.depth])] += 1
    for (pid, argv0), stacks in per_pid.items():
        print(f"pid {pid} ({argv0}): {sum(stacks.values())} samples")
        for frames, n in stacks.most_common(args.top):
            print(f"  {n} x")
            for fr in frames:
                print("     ", fr[-150:])


if __name__ == "__main__":
    main()
