"""Plots of a TTFT sweep (``benchmarks/ttft.py --sweep``): time to first token against the
context length at a fixed segment count, and against the segment count at a fixed length, one
line per variant, with the speedup over flashinfer written beside every redknot point.

    python benchmarks/plot_ttft.py benchmarks/results/ttft_sweep_policies.json
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path


def series(summary: dict, vary: str, fixed: str) -> dict[int, dict[str, list[tuple]]]:
    """``{fixed value: {variant: [(varied value, ttft_s, speedup or None), ...]}}`` for the
    fixed values that have at least two points."""
    out: dict[int, dict[str, list[tuple]]] = collections.defaultdict(dict)
    for variant, points in summary.items():
        groups = collections.defaultdict(list)
        for entry in points.values():
            groups[entry[fixed]].append(
                (entry[vary], entry["ttft_s"], entry.get("speedup_vs_flashinfer"))
            )
        for value, rows in groups.items():
            if len(rows) >= 2:
                out[value][variant] = sorted(rows)
    return out


def plot(result: dict, path: str) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return f"matplotlib is not installed: no plot written ({path} skipped)"
    summary = result["summary"]
    panels = [
        ("length", "segments", "context length (tokens)", "{} segments"),
        ("segments", "length", "segments in the prompt", "{} tokens"),
    ]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for ax, (vary, fixed, xlabel, label) in zip(axes, panels):
        groups = series(summary, vary, fixed)
        if not groups:
            ax.set_visible(False)
            continue
        value = max(groups, key=lambda v: sum(len(r) for r in groups[v].values()))
        for variant, rows in groups[value].items():
            xs, ys = [r[0] for r in rows], [r[1] for r in rows]
            ax.plot(xs, ys, "o-", label=variant)
            if variant != "flashinfer":
                for x, y, speedup in rows:
                    if speedup:
                        ax.annotate(f"{speedup:.2f}x", (x, y), textcoords="offset points",
                                    xytext=(4, -10), fontsize=7)  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({r[0] for rows in groups[value].values() for r in rows}))
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.set_xlabel(xlabel)
        ax.set_ylabel("time to first token (s)")
        ax.set_title(label.format(value), fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(
        f"TTFT, 8B shape, dummy weights, {result['device']}, commit {result['commit']}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return f"wrote {path}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("result", help="JSON written by benchmarks/ttft.py")
    ap.add_argument("--plot", default=None, help="PNG path (default: the JSON's, .png)")
    args = ap.parse_args(argv)
    result = json.loads(Path(args.result).read_text())
    print(plot(result, args.plot or str(Path(args.result).with_suffix(".png"))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
