"""The fidelity-FLOPs front of every recovery policy on the case sets, redknot's ablation, and
the default a server serves for the model (``benchmarks/results/fidelity_frontier.json``).

Every setting is served on the reference path (``python -m redknot.eval fidelity``'s engine,
in-process) against dense prefill, on each case set, and scored by its answers (``kept``: the
share of dense-correct answers it keeps, contains; EM; F1), then its first token (top-10
overlap, KL to dense, top-1). The settings come in groups (``--groups``):

| group       | settings                                                                    |
| ----------- | --------------------------------------------------------------------------- |
| ``baselines`` | ``headclass`` (the map's own error, windows 256 / 1024), ``naive``        |
| ``ablation``  | redknot at the knobs the map records, then one component changed at a time: the layer schedule (``dense_layers``, ``mass_thresh``, ``recent_n``), ``skipped``, ``local_kv``, restore, sink repair (``repair_k``), the window (1024; 8192 = every token in sight) |
| ``token``     | the token-level policies' fronts: EPIC, CacheBlend, SparseX at a few knobs |
| ``wide``      | the same policies at costlier knobs (EPIC 128 / 256, CacheBlend 0.5, SparseX 8): where each front reaches dense |
| ``variant``   | the head-aware variant kept after the diagnosis (``docs/fidelity.md``)    |
| ``calibration`` | the candidates of ``python -m redknot.calibrate`` (``redknot.calibrate.candidates``) |

Finished (case, setting) pairs are kept in ``--work-dir`` (one sub-directory per case set): a
rerun, a larger ``--limit`` or more groups run only what is missing::

    python benchmarks/fidelity_frontier.py --groups baselines,ablation,token --limit 24
    python benchmarks/fidelity_frontier.py --device cuda --work-dir /tmp/frontier.work

``--default FILE`` attaches the served default: the ``served`` record of a calibrated profile
(``python -m redknot.calibrate``) with its summary on every case set.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from redknot.calibrate import candidates
from redknot.eval.base import REFERENCE_LABEL, PolicySetting
from redknot.eval.cases import load_cases
from redknot.eval.fidelity import evaluate, pareto
from redknot.recovery import RecoveryOptions

CASE_SETS = "rag_v1=benchmarks/cases/rag_v1.jsonl,long_v1=benchmarks/cases/long_v1.jsonl"
HEAD_MAP = "configs/heads/smollm2-135m-instruct.json"

Knobs = dict[str, Any]
GROUPS: dict[str, list[tuple[str, Knobs]]] = {
    "baselines": [("headclass", {}), ("headclass", {"window": 1024}), ("naive", {})],
    "ablation": [
        ("redknot", {}),
        ("redknot", {"dense_layers": 30}),
        ("redknot", {"mass_thresh": 0.9}),
        ("redknot", {"recent_n": 512}),
        ("redknot", {"skipped": "residual"}),
        ("redknot", {"local_kv": "fresh"}),
        ("redknot", {"restore_thresh": 0.1}),
        ("redknot", {"repair_k": 16}),
        ("redknot", {"dense_layers": 30, "repair_k": 16}),
        ("redknot", {"window": 1024}),
        ("redknot", {"window": 1024, "dense_layers": 30}),
        ("redknot", {"window": 8192}),
        ("redknot", {"window": 8192, "dense_layers": 30}),
    ],
    "token": [
        ("epic", {"epic_k": 16}),
        ("epic", {"epic_k": 64}),
        ("cacheblend", {"blend_ratio": 0.15}),
        ("cacheblend", {"blend_ratio": 0.3}),
        ("sparsex", {"sparseq_boundary": 5}),
    ],
    "wide": [
        ("epic", {"epic_k": 128}),
        ("epic", {"epic_k": 256}),
        ("cacheblend", {"blend_ratio": 0.5}),
        ("sparsex", {"sparseq_boundary": 8}),
    ],
    "variant": [],
    "calibration": candidates(),
}
COLUMNS = ("kept", "contains", "exact_match", "f1", "top10", "kl", "top1", "flops_fraction")


def label_of(policy: str, knobs: Knobs) -> str:
    """``policy[k=v,...]``, the evaluation CLI's labels."""
    return policy + ("[" + ",".join(f"{k}={v}" for k, v in knobs.items()) + "]" if knobs else "")


def settings_of(groups: list[str], base: RecoveryOptions) -> list[PolicySetting]:
    """``full`` and every setting of ``groups``, once each, on the knobs of ``base``."""
    out = [PolicySetting(REFERENCE_LABEL)]
    seen = {REFERENCE_LABEL}
    for group in groups:
        for policy, knobs in GROUPS[group]:
            label = label_of(policy, knobs)
            if label not in seen:
                seen.add(label)
                out.append(PolicySetting(policy, base.replace(**knobs), label))
    return out


def recorded_options(head_map: str) -> RecoveryOptions:
    """The recovery knobs the head map records for its model, on ``RecoveryOptions``'s."""
    from redknot.headmap import HeadMap
    from redknot.recovery import KNOBS

    recorded = HeadMap.load(head_map).recorded_recovery()
    return RecoveryOptions().replace(**{k: v for k, v in recorded.items() if k in KNOBS})


def compact(result: dict) -> dict:
    """What the result file keeps of one case set's evaluation."""
    summary = result["summary"]
    return {
        "cases": result["cases"],
        "summary": summary,
        "summary_by_kind": result["summary_by_kind"],
        "pareto": {
            "kept_vs_flops": pareto(summary, gain="kept"),
            "top10_vs_flops": pareto(summary, gain="top10"),
        },
        "per_case": [
            {
                "id": c["id"],
                "kind": c["kind"],
                "prompt_tokens": c["prompt_tokens"],
                "segments": c["segments"],
                "settings": {
                    label: {k: s.get(k) for k in ("contains", "top1", "kl", "output")}
                    for label, s in c["settings"].items()
                },
            }
            for c in result["per_case"]
        ],
        "seconds": result["seconds"],
    }


def table(summary: dict[str, dict]) -> str:
    def fmt(v: float | None) -> str:
        return "-" if v is None else f"{v:.3f}"

    lines = [f"{'setting':58s} " + " ".join(f"{c[:7]:>7s}" for c in COLUMNS)]
    for label, s in summary.items():
        lines.append(f"{label:58s} " + " ".join(f"{fmt(s.get(c)):>7s}" for c in COLUMNS))
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default=CASE_SETS, help="NAME=FILE,... case sets")
    p.add_argument("--groups", default="baselines,ablation,token,variant")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--head-map", default=HEAD_MAP)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--max-new-tokens", type=int, default=12)
    p.add_argument("--limit", type=int, default=None, help="first N cases of each set")
    p.add_argument("--work-dir", default="benchmarks/frontier.work")
    p.add_argument("--default", default=None, help="a calibrated profile: attach its record")
    p.add_argument("--out", default="benchmarks/results/fidelity_frontier.json")
    p.add_argument("--combine", nargs="+", default=None, metavar="FILE",
                   help="join the case sets of finished runs (e.g. one per GPU call) into --out")  # fmt: skip
    p.add_argument("--plot", default=None, metavar="PNG",
                   help="with --combine: also plot kept against FLOPs per case set (matplotlib)")  # fmt: skip
    return p.parse_args(argv)


def combine(files: list[str], out: str, default: str | None) -> int:
    """One result of several runs' case sets (each run's provenance kept under ``runs``)."""
    runs = [json.loads(Path(f).read_text()) for f in files]
    first = runs[0]
    joined: dict[str, Any] = {k: v for k, v in first.items() if k not in ("sets", "seconds")}
    joined["sets"] = {name: r for run in runs for name, r in run["sets"].items()}
    joined["command"] = " ; ".join(run["command"] for run in runs)
    joined["commit"] = first.get("commit") or first.get("git_commit")
    joined["runs"] = [
        {k: run.get(k) for k in ("command", "commit", "date", "device", "seconds")} | {"file": f}
        for f, run in zip(files, runs)
    ]
    joined["combine_command"] = "python benchmarks/fidelity_frontier.py " + " ".join(
        shlex.quote(a) for a in sys.argv[1:]
    )
    if default:
        joined["default"] = default_block(default, joined["sets"])
    Path(out).write_text(json.dumps(joined, indent=1) + "\n")
    for name, r in joined["sets"].items():
        print(f"== {name}: {r['cases']['count']} cases")
        print(table(r["summary"]))
    print(f"wrote {out}")
    return 0


def main(argv=None) -> int:
    import torch

    from redknot.eval.reference_backend import ReferenceBackend
    from redknot.headmap.provenance import git_commit

    args = parse_args(argv)
    if args.combine:
        code = combine(args.combine, args.out, args.default)
        if args.plot:
            print(plot(json.loads(Path(args.out).read_text()), args.plot))
        return code
    groups = [g for g in args.groups.split(",") if g]
    unknown = [g for g in groups if g not in GROUPS]
    if unknown:
        raise SystemExit(f"error: unknown group {unknown[0]!r}; known: {', '.join(GROUPS)}")
    sets = dict(item.split("=", 1) for item in args.cases.split(",") if item)
    base = recorded_options(args.head_map)
    settings = settings_of(groups, base)
    backend = ReferenceBackend.load(
        args.model,
        args.head_map,
        device=args.device,
        dtype=getattr(torch, args.dtype),
        max_new_tokens=args.max_new_tokens,
    )
    commit, dirty = git_commit()
    started = time.perf_counter()
    results = {}
    for name, path in sets.items():
        cases = load_cases(path)[: args.limit] if args.limit else load_cases(path)
        log = lambda line, name=name: print(f"{name} {line}", file=sys.stderr, flush=True)
        result = evaluate(backend, cases, settings, work_dir=Path(args.work_dir) / name, log=log)
        results[name] = {"file": path, **compact(result)}
        print(f"== {name}: {result['cases']['count']} cases, {result['seconds']} s")
        print(table(result["summary"]))
    info = backend.describe()
    out: dict[str, Any] = {
        "benchmark": "fidelity_frontier",
        "date": dt.datetime.now(dt.UTC).replace(microsecond=0).isoformat(),
        "device": info.pop("device"),
        "device_detail": info.pop("device_detail"),
        "commit": commit,
        "git_dirty": dirty,
        "command": "python benchmarks/fidelity_frontier.py "
        + " ".join(shlex.quote(a) for a in sys.argv[1:]),
        **info,
        "base_options": base.to_json(),
        "groups": {g: [label_of(p, k) for p, k in GROUPS[g]] for g in groups},
        "settings": [s.to_json() for s in settings],
        "sets": results,
        "seconds": round(time.perf_counter() - started, 1),
    }
    if args.default:
        out["default"] = default_block(args.default, results)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


FAMILY_COLOR = {"full": "black", "headclass": "grey", "naive": "tab:brown", "redknot": "tab:red",
                "epic": "tab:blue", "cacheblend": "tab:green", "sparsex": "tab:purple"}  # fmt: skip


def plot(result: dict, path: str) -> str:
    """One panel per case set: each setting's kept share of dense-correct answers against its
    prefill FLOPs (fraction of dense), coloured by policy, the default ringed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return f"matplotlib is not installed: no plot written ({path} skipped)"
    sets = result["sets"]
    default = (result.get("default") or {}).get("record", {}).get("setting", {}).get("policy")
    fig, axes = plt.subplots(1, len(sets), figsize=(6 * len(sets), 4.5), squeeze=False)
    for ax, (name, r) in zip(axes[0], sets.items()):
        dense_correct = r["cases"]["dense_correct"]
        for label, s in r["summary"].items():
            family = label.partition("[")[0]
            x, y = s["flops_fraction"], s["kept"]
            ax.scatter(x, y, color=FAMILY_COLOR.get(family, "orange"), s=30, zorder=3)
            if label == default:
                ax.scatter(x, y, s=160, facecolors="none", edgecolors="black", zorder=4)
            if family == "redknot" and label != "redknot":
                continue  # the ablation's points: coloured, unnamed (the table names them)
            ax.annotate(label.replace("blend_ratio=", "").replace("epic_k=", "k=")
                        .replace("sparseq_boundary=", "b="), (x, y), fontsize=6,
                        xytext=(3, 2), textcoords="offset points")  # fmt: skip
        ax.set_xscale("log")
        ax.set_xlabel("prefill FLOPs, fraction of dense (log)")
        ax.set_ylabel(f"kept of the {dense_correct} dense-correct answers")
        ax.set_title(f"{name}: {r['cases']['count']} cases")
        ax.set_ylim(-0.05, 1.05)
        ax.grid(alpha=0.3)
    handles = [
        plt.Line2D([], [], marker="o", ls="", color=c, label=f) for f, c in FAMILY_COLOR.items()
    ]
    axes[0][0].legend(handles=handles, fontsize=7, loc="lower right")
    fig.suptitle(
        f"answers against prefill FLOPs, reference path ({result['commit']}); ring: the default"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return f"wrote {path}"


def default_block(profile: str, results: dict[str, dict]) -> dict:
    """The served record of ``profile`` and its setting's summary on every case set."""
    from redknot.headmap import HeadMap

    record = HeadMap.load(profile).served
    if record is None:
        raise SystemExit(f"error: {profile} has no served record (run python -m redknot.calibrate)")
    label = record.label
    return {
        "profile": profile,
        "record": record.to_json(),
        "summary": {name: r["summary"].get(label) for name, r in results.items()},
    }


if __name__ == "__main__":
    raise SystemExit(main())
