"""Fidelity against FLOPs of every recovery policy, side by side on the ``rag_v1`` case set.

Runs the fidelity evaluation (``python -m redknot.eval fidelity``, reused in-process) on the
reference path with SmolLM2-135M-Instruct and its profiled head map, for ``full``,
``headclass`` (prefill under the head map, no reuse: the head map's own error), ``naive``,
``redknot`` (defaults) and a small knob sweep of the token-level baselines and SparseX:

| policy            | settings                                 |
| ----------------- | ---------------------------------------- |
| ``cacheblend``    | ``blend_ratio`` 0.15, 0.3 (check layer 1) |
| ``epic``          | ``epic_k`` 16, 64                        |
| ``sparsex``       | ``sparseq_boundary`` 0 (without, SparseX's "hybrid attention"), 1 (the least the server takes), 5 (with) and 8, ``sparseq_k`` 512 |
| ``redknot+sparseq`` | the same four boundaries (reference path only: not kept in the server) |

then writes one row per (policy, setting) to ``benchmarks/results/policies.json`` and a plot
of first-token top-1 agreement against the FLOPs fraction (when matplotlib is installed).

``--ttft FILE`` (a ``benchmarks/ttft.py`` result, e.g. of ``benchmarks/gpu_run.py bench ttft``) adds, to
each row whose setting the file holds (its label, e.g. ``epic[epic_k=64]``, or the policy's
default knobs), the TTFT the server measured for that policy at
``--ttft-point`` (8B shape, dummy weights: a different model than the fidelity's, the same
schedule) and its speedup over flashinfer, and a panel of top-1 against that speedup. The
server's ``redknot`` is the full layer schedule without adaptive restore (the reference row
follows the map's recorded knobs, restore off for the shipped map); ``redknot+sparseq`` has
TTFT only from results of when the server still served it (a 1/8 map)::

    python benchmarks/policies.py --limit 6
    python benchmarks/policies.py --replot     # redraw the plot from the result file
    python benchmarks/policies.py --replot --ttft benchmarks/results/ttft_policies.json

Finished (case, setting) pairs are kept in ``--work-dir``: a rerun (or a larger ``--limit``)
runs only what is missing.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shlex
import sys
import time
from pathlib import Path

from redknot.eval.cli import main as eval_main

CASES = "benchmarks/cases/rag_v1.jsonl"
HEAD_MAP = "configs/heads/smollm2-135m-instruct.json"
POLICIES = "full,headclass,naive,redknot,cacheblend,epic,sparsex,redknot+sparseq"
SWEEP = {
    "blend-ratio": "0.15,0.3",
    "epic-k": "16,64",
    "sparseq-boundary": "0,1,5,8",
}
COLUMNS = (
    "top1",
    "top10",
    "cosine",
    "contains",
    "exact_match",
    "f1",
    "flops_fraction",
    "attention_fraction",
    "ffn_fraction",
    "kv_head_fraction",
)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--limit", type=int, default=6, help="first N cases of the case set")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--max-new-tokens", type=int, default=12)
    p.add_argument("--work-dir", default="benchmarks/policies.work")
    p.add_argument("--out", default="benchmarks/results/policies.json")
    p.add_argument("--plot", default="benchmarks/results/policies.png")
    p.add_argument("--replot", action="store_true", help="only redraw the plot from --out")
    p.add_argument("--ttft", default=None, help="a benchmarks/ttft.py result to attach")
    p.add_argument("--ttft-point", default="32768x8", help="its point (LENGTHxSEGMENTS)")
    return p.parse_args(argv)


TTFT_VARIANTS = {  # policy -> the benchmarks/ttft.py variant serving it at its default knobs
    "full": "flashinfer",
    "redknot": "redknot-g0.125-reuse-sparse-cached",
    "redknot+sparseq": "redknot-g0.125-reuse-sparseq",  # in older results only
    "naive": "naive",
    "epic": "epic",
    "cacheblend": "cacheblend",
    "sparsex": "sparsex",
}


def attach_ttft(rows: list[dict], ttft: dict, point: str, defaults: dict) -> int:
    """Give every row the TTFT its server variant measured at ``point`` and the speedup over
    flashinfer there: the variant of the row's label (``benchmarks/ttft.py`` takes knobs in the
    same format), else, for a row at its policy's default knobs (``defaults``: the evaluation's
    default options), the variant serving those. Returns how many rows got one."""
    from redknot.recovery import POLICIES as POLICY_CLASSES

    summary, matched = ttft["summary"], 0
    for row in rows:
        variant = row["setting"]  # a TTFT variant with the same knobs, e.g. epic[epic_k=64]
        knobbed = TTFT_VARIANTS.get(row["policy"], "") + variant[len(row["policy"]) :]
        if variant not in summary and knobbed in summary:  # e.g. the hybrid's 1/8-map variant
            variant = knobbed
        if variant not in summary:
            variant = TTFT_VARIANTS.get(row["policy"])
            knobs = POLICY_CLASSES[row["policy"]].knobs if row["policy"] in POLICY_CLASSES else ()
            options = row.get("options") or {}
            if any(options.get(k) != defaults.get(k) for k in knobs):
                continue  # not the default knobs that variant ran
        entry = summary.get(variant, {}).get(point)
        if entry is None:
            continue
        row["ttft_s"] = entry["ttft_s"]
        row["ttft_speedup"] = entry.get("speedup_vs_flashinfer")
        row["ttft_source"] = {"variant": variant, "point": point, "device": ttft.get("device"),
                              "commit": ttft.get("commit")}  # fmt: skip
        matched += 1
    return matched


def eval_argv(args: argparse.Namespace, raw: Path) -> list[str]:
    argv = ["fidelity", "--cases", CASES, "--model", args.model, "--head-map", HEAD_MAP]
    argv += ["--policies", POLICIES, "--max-new-tokens", str(args.max_new_tokens)]
    for flag, values in SWEEP.items():
        argv += [f"--{flag}", values]
    argv += ["--limit", str(args.limit), "--work-dir", args.work_dir, "--out", str(raw)]
    return argv


def rows_of(result: dict) -> list[dict]:
    """One row per setting: its policy, the knobs it changed, the mean metrics."""
    out = []
    for setting in result["settings"]:
        label = setting["label"]
        summary = result["summary"][label]
        row = {"policy": setting["policy"], "setting": label}
        row.update({k: summary[k] for k in COLUMNS})
        row["on_dense_correct"] = summary["on_dense_correct"]
        row["options"] = setting["options"]
        out.append(row)
    return out


def plot(rows: list[dict], path: str, title: str) -> str:
    """First-token top-1 agreement and top-10 overlap against the FLOPs fraction, one line
    per policy through its settings."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return f"matplotlib is not installed: no plot written ({path} skipped)"
    timed = [r for r in rows if r.get("ttft_speedup")]
    colour = {p: f"C{i}" for i, p in enumerate(dict.fromkeys(r["policy"] for r in rows))}
    fig, axes = plt.subplots(1, 3 if timed else 2, figsize=(16 if timed else 11, 4.5))
    if timed:  # top-1 against the measured TTFT speedup, one point per policy
        ax = axes[2]
        for i, r in enumerate(timed):  # labelled with the setting, nearby labels staggered
            ax.plot(r["ttft_speedup"], r["top1"], "o", color=colour[r["policy"]])
            ax.annotate(r["setting"], (r["ttft_speedup"], r["top1"]), fontsize=6,
                        xytext=(4, 8 * (i % 3) - 8), textcoords="offset points")  # fmt: skip
        source = timed[0]["ttft_source"]
        ax.set_xlabel(f"TTFT speedup over flashinfer ({source['point']}, 8B shape)")
        ax.set_ylabel("first token: top-1 agreement with dense")
        ax.grid(alpha=0.3)
    for ax, metric, name in zip(axes, ("top1", "top10"), ("top-1 agreement", "top-10 overlap")):
        for policy in dict.fromkeys(r["policy"] for r in rows):
            points = sorted((r["flops_fraction"], r[metric]) for r in rows if r["policy"] == policy)
            ax.plot([p[0] for p in points], [p[1] for p in points], "o-", label=policy,
                    color=colour[policy])  # fmt: skip
        ax.set_xlabel("prefill FLOPs / dense prefill FLOPs")
        ax.set_ylabel(f"first token: {name} with dense")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return f"wrote {path}"


def title_of(result: dict) -> str:
    count = result["cases"]["count"]
    return f"{result['model']}, first {count} cases of {Path(CASES).name}, {result['device']}"


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.replot:
        out = json.loads(Path(args.out).read_text())
        if args.ttft:
            ttft = json.loads(Path(args.ttft).read_text())
            count = attach_ttft(out["rows"], ttft, args.ttft_point, out["default_options"])
            Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
            print(f"attached TTFT to {count} rows of {args.out}")
        print(plot(out["rows"], args.plot, title_of(out)))
        return 0
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    raw = work / "fidelity.json"
    command = "python benchmarks/policies.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    started = time.perf_counter()
    eval_main(eval_argv(args, raw))
    seconds = round(time.perf_counter() - started, 1)
    result = json.loads(raw.read_text())
    rows = rows_of(result)
    if args.ttft:
        ttft = json.loads(Path(args.ttft).read_text())
        attach_ttft(rows, ttft, args.ttft_point, result["default_options"])
    out = {
        "benchmark": "policies",
        "date": dt.datetime.now(dt.UTC).replace(microsecond=0).isoformat(),
        "device": result["device"],
        "device_detail": result["device_detail"],
        "commit": result["git_commit"],
        "git_commit": result["git_commit"],
        "git_dirty": result["git_dirty"],
        "command": command,
        "eval_command": result["command"],
        "limit": args.limit,
        "seconds": seconds,
        "eval_seconds": result["seconds"],
        "model": result["model"],
        "head_map": result["head_map"],
        "max_new_tokens": result["max_new_tokens"],
        "cases_file": result["cases_file"],
        "cases": result["cases"],
        "default_options": result["default_options"],
        "rows": rows,
        "pareto": result["pareto"],
        "per_case": [
            {
                "id": c["id"],
                "prompt_tokens": c["prompt_tokens"],
                "segment_tokens": c["segment_tokens"],
                "settings": {
                    label: {k: s.get(k) for k in ("top1", "contains", "flops_fraction", "output")}
                    for label, s in c["settings"].items()
                },
            }
            for c in result["per_case"]
        ],
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out} ({len(rows)} settings, {out['cases']['count']} cases, {seconds} s)")
    print(plot(rows, args.plot, title_of(out)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
