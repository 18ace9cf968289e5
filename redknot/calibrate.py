"""Calibration: measure the candidate reuse settings of a model on the reference path and write
the setting a server serves by default into the model's profile (its head map, key ``served``:
:mod:`redknot.headmap.served`).

Two ways to get the measurements:

* run them (reference path, CPU or ``--device cuda``; finished (case, setting) pairs are kept in
  ``--work-dir``, so a rerun resumes; greedy decoding, so a rerun gives the same record)::

      python -m redknot.calibrate --model smollm2 --head-map configs/heads/MAP.json \\
          --cases rag_v1=benchmarks/cases/rag_v1.jsonl,long_v1=benchmarks/cases/long_v1.jsonl \\
          --out PROFILE.json

* or read finished evaluations (``--from-result FILE ...``: a ``redknot eval fidelity`` result,
  ``benchmarks/fidelity_frontier.json`` or ``benchmarks/results/policies.json``), which is how the
  shipped SmolLM2 record was made (docs/calibration.md).

The choice (:func:`choose`): among the servable candidates (``full``, ``redknot`` and the
token-level policies) whose answers keep at least ``--floor-kept`` of the answers dense prefill
gets right (contains) and whose first token keeps ``--floor-top10`` top-10 overlap, pooled over
every case set, the cheapest in prefill FLOPs. ``full`` (no reuse) always meets the floor, so a
model on which no reuse setting is faithful is served without reuse. The record also keeps the
best head-aware setting under the map (a map below the floor is refused for ``--redknot-policy
redknot`` unless ``--redknot-accept-lossy-map``), the best token-level setting (what a server
serves for a model without a profile), every candidate, the map's fidelity-against-memory curve
(its measured windows) and the provenance (cases with their hashes, metric, floor, tool,
version, commit, sources).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import hashlib
import json
import shlex
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import redknot
from redknot.headmap import HeadMap
from redknot.headmap.served import (
    HEAD_AWARE,
    NO_REUSE,
    SERVABLE,
    TOKEN_LEVEL,
    Choice,
    ModelSignature,
    ServedRecord,
    ServedSetting,
)

FLOOR = {"kept": 0.99, "top10": 0.85}  # issue 25: >= 99% of dense-correct answers kept
METRIC = (
    "kept: share of the cases dense prefill answers correctly (answer contained in the greedy "
    "output) that the setting also answers; top10: first-token top-10 overlap with dense; "
    "cost: prefill FLOPs as a fraction of dense"
)
# The candidates a calibration run measures: (policy, knobs); redknot's knobs apply on top of
# the map's recorded ones.
CANDIDATES: tuple[tuple[str, dict[str, Any]], ...] = (
    ("redknot", {}),
    ("redknot", {"dense_layers": 30}),
    ("redknot", {"window": 1024}),
    ("naive", {}),
    ("epic", {"epic_k": 16}),
    ("epic", {"epic_k": 64}),
    ("epic", {"epic_k": 256}),
    ("cacheblend", {"blend_ratio": 0.15}),
    ("cacheblend", {"blend_ratio": 0.3}),
    ("cacheblend", {"blend_ratio": 0.5}),
    ("sparsex", {"sparseq_boundary": 5}),
)


def candidates() -> list[tuple[str, dict[str, Any]]]:
    return [(p, dict(k)) for p, k in CANDIDATES]


def _value(text: str) -> Any:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return {"None": None, "True": True, "False": False}.get(text, text)


def flags_of(setting: ServedSetting) -> str:
    """The server options that serve ``setting``: ``--redknot-policy P --redknot-KNOB V ...``."""
    knobs = " ".join(f"--redknot-{k.replace('_', '-')} {v}" for k, v in setting.knobs.items())
    return f"--redknot-policy {setting.policy}" + (f" {knobs}" if knobs else "")


def parse_label(label: str) -> ServedSetting | None:
    """``policy[k=v,...]`` (the evaluation's labels) as a setting, ``None`` when the policy or
    a knob cannot be served (``headclass``, ``redknot+sparseq``, ``redknot[repair_k=16]``)."""
    policy, _, rest = label.partition("[")
    if policy not in SERVABLE:
        return None
    knobs = {}
    for item in filter(None, rest.rstrip("]").split(",")):
        key, _, value = item.partition("=")
        knobs[key] = _value(value)
    from redknot.config import RedknotConfig

    fields = {f.name for f in dataclasses.fields(RedknotConfig)}
    if any(k not in fields for k in knobs):
        return None  # a reference-path knob the server has no option for (repair_k, ...)
    return ServedSetting(policy, knobs)


def summaries_of(result: Mapping[str, Any], name: str) -> dict[str, dict[str, dict]]:
    """``{case set: {label: summary}}`` of one result file of any of the three formats."""
    if "sets" in result:  # benchmarks/fidelity_frontier.py
        return {k: dict(v["summary"]) for k, v in result["sets"].items()}
    if "summary" in result:  # redknot eval fidelity
        return {name: dict(result["summary"])}
    if "rows" in result:  # benchmarks/policies.py
        out = {}
        for row in result["rows"]:
            s = dict(row)
            s.setdefault("cases", result["cases"]["count"])
            s.setdefault("dense_correct_cases", result["cases"].get("dense_correct"))
            out[row["setting"]] = s
        return {name: out}
    raise SystemExit(f"error: {name}: not an evaluation result (no sets, summary or rows)")


def _kept(s: Mapping[str, Any]) -> float | None:
    if s.get("kept") is not None:
        return s["kept"]
    return (s.get("on_dense_correct") or {}).get("contains")


def pool(sets: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per label measured on every case set: its numbers pooled over the sets (kept weighted by
    the dense-correct cases, the rest by the cases), and per set."""
    labels = [lbl for lbl in next(iter(sets.values()))]
    labels = [lbl for lbl in labels if all(lbl in s for s in sets.values())]
    out = {}
    for label in labels:
        per = {}
        tot = {"cases": 0, "dense_correct_cases": 0}
        acc = {"kept": 0.0, "top10": 0.0, "flops_fraction": 0.0, "exact_match": 0.0,
               "f1": 0.0, "contains": 0.0}  # fmt: skip
        for name, summary in sets.items():
            s = summary[label]
            n = int(s.get("cases") or 0)
            nc = int(s.get("dense_correct_cases") or 0)
            row = {
                "kept": _kept(s), "top10": s.get("top10"), "kl": s.get("kl"),
                "flops_fraction": s.get("flops_fraction"), "contains": s.get("contains"),
                "exact_match": s.get("exact_match"), "f1": s.get("f1"), "cases": n,
                "dense_correct_cases": nc,
            }  # fmt: skip
            per[name] = row
            tot["cases"] += n
            tot["dense_correct_cases"] += nc
            for key in acc:
                weight = nc if key == "kept" else n
                acc[key] += (row[key] or 0.0) * weight
        pooled = {
            k: round(v / max(1, tot["dense_correct_cases" if k == "kept" else "cases"]), 4)
            for k, v in acc.items()
        }
        out[label] = {"pooled": {**pooled, **tot}, **per}
    return out


def _meets(m: Mapping[str, Any], floor: Mapping[str, float]) -> bool:
    return (m.get("kept") or 0) >= floor["kept"] and (m.get("top10") or 0) >= floor["top10"]


def choose(
    measured: Mapping[str, Mapping[str, Any]], floor: Mapping[str, float]
) -> tuple[Choice, Choice | None, Choice | None, list[dict[str, Any]]]:
    """``(served, best head-aware, best token-level, candidates)`` from the pooled numbers."""
    rows = []
    for label, m in measured.items():
        setting = parse_label(label)
        if setting is None:
            continue
        p = m["pooled"]
        flops = 1.0 if setting.policy == NO_REUSE else p["flops_fraction"]
        meets = setting.policy == NO_REUSE or _meets(p, floor)
        rows.append((setting, {**p, "flops_fraction": flops}, meets, m))
    if not any(s.policy == NO_REUSE for s, *_ in rows):
        rows.append((ServedSetting(NO_REUSE), {"kept": 1.0, "top10": 1.0, "flops_fraction": 1.0},
                     True, {}))  # fmt: skip

    def cheapest(group):
        return min(group, key=lambda r: (r[1]["flops_fraction"], -(r[1]["kept"] or 0)))

    def best(group):
        return max(group, key=lambda r: (r[1]["kept"] or 0, r[1]["top10"] or 0))

    def as_choice(row):
        return None if row is None else Choice(row[0], dict(row[3] or {"pooled": row[1]}), row[2])

    served = cheapest([r for r in rows if r[2]])
    heads = [r for r in rows if r[0].policy in HEAD_AWARE]
    tokens = [r for r in rows if r[0].policy in TOKEN_LEVEL]
    token_ok = [r for r in tokens if r[2]]
    head = best(heads) if heads else None
    closest = max(tokens, key=lambda r: (r[1]["kept"] or 0, -r[1]["flops_fraction"]), default=None)
    token = cheapest(token_ok) if token_ok else closest
    table = [
        {
            "label": s.label,
            **{k: p.get(k) for k in ("kept", "top10", "flops_fraction")},
            "meets_floor": ok,
        }
        for s, p, ok, _ in sorted(rows, key=lambda r: r[1]["flops_fraction"])
    ]
    return as_choice(served), as_choice(head), as_choice(token), table


def curve(hm: HeadMap, measured: Mapping[str, Mapping[str, Any]], mean_tokens: float) -> list:
    """The map's fidelity against KV memory at each window measured for redknot: the memory of
    a local head is its sink + window, of a global head every token (mean prompt length)."""
    out = []
    for label, m in measured.items():
        setting = parse_label(label)
        if setting is None or setting.policy != "redknot":
            continue
        window = int(setting.knobs.get("window", hm.window))
        local = min(1.0, (hm.sink + window) / max(1.0, mean_tokens))
        g = hm.global_fraction
        out.append({
            "label": label, "global_fraction": round(g, 4), "window": window,
            "memory_fraction": round(g + (1 - g) * local, 4),
            **{k: m["pooled"].get(k) for k in ("kept", "top10", "flops_fraction")},
        })  # fmt: skip
    return sorted(out, key=lambda r: r["memory_fraction"])


def _sha(path: str) -> str | None:
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]
    except OSError:
        return None


def build_record(
    hm: HeadMap,
    sets: Mapping[str, Mapping[str, Mapping[str, Any]]],
    *,
    floor: Mapping[str, float],
    signature: ModelSignature | None,
    provenance: Mapping[str, Any],
    mean_tokens: float = 3000.0,
) -> ServedRecord:
    measured = pool(sets)
    served, head, token, table = choose(measured, floor)
    n = len(table)
    if served.setting.policy == NO_REUSE:
        reason = (
            f"no reuse setting among {n} candidates keeps kept >= {floor['kept']} and top-10 "
            f">= {floor['top10']} pooled over {', '.join(sets)}: prompts are computed in full"
        )
        if token is not None:
            m = token.measured.get("pooled", {})
            reason += (
                f"; the closest token-level setting, {token.setting.label}, kept "
                f"{m.get('kept', 0):.3f} at {m.get('flops_fraction', 0):.3f} of dense FLOPs "
                f"(serve it with {flags_of(token.setting)})"
            )
    else:
        reason = (
            f"the cheapest (prefill FLOPs) of {n} candidates that keeps kept >= {floor['kept']} "
            f"and top-10 >= {floor['top10']} pooled over {', '.join(sets)}"
        )
        if head is not None and not head.meets_floor:
            reason += (
                f"; the best head-aware setting, {head.setting.label}, keeps only "
                f"{head.measured['pooled'].get('kept'):.3f}"
            )
    return ServedRecord(
        setting=served.setting,
        reason=reason,
        floor=dict(floor),
        meets_floor=served.meets_floor,
        measured=dict(served.measured),
        head_aware=head,
        token_level=token,
        candidates=tuple(table),
        curve=tuple(curve(hm, measured, mean_tokens)),
        model_signature=signature,
        provenance=dict(provenance),
    )


def signature_of(model: str) -> ModelSignature:
    """The signature of ``model`` (a reference-path model spec) from its config, no weights."""
    from transformers import AutoConfig

    from redknot.reference.loading import resolve_source

    source = resolve_source(model)
    return ModelSignature.from_hf_config(
        AutoConfig.from_pretrained(source.directory, **source.kwargs())
    )


def run_sets(args: argparse.Namespace, hm_path: str, case_sets: Mapping[str, str]) -> dict:
    """Evaluate every candidate on every case set on the reference path (resumable)."""
    import torch

    from redknot.eval.base import REFERENCE_LABEL, PolicySetting
    from redknot.eval.cases import load_cases
    from redknot.eval.fidelity import evaluate
    from redknot.eval.reference_backend import ReferenceBackend
    from redknot.recovery import KNOBS, RecoveryOptions

    recorded = HeadMap.load(hm_path).recorded_recovery()
    base = RecoveryOptions().replace(**{k: v for k, v in recorded.items() if k in KNOBS})
    settings = [PolicySetting(REFERENCE_LABEL)]
    for policy, knobs in candidates():
        settings.append(
            PolicySetting(policy, base.replace(**knobs), ServedSetting(policy, knobs).label)
        )
    backend = ReferenceBackend.load(
        args.model, hm_path, device=args.device, dtype=getattr(torch, args.dtype),
        max_new_tokens=args.max_new_tokens,
    )  # fmt: skip
    out = {}
    for name, path in case_sets.items():
        cases = load_cases(path)[: args.limit] if args.limit else load_cases(path)
        result = evaluate(
            backend,
            cases,
            settings,
            work_dir=Path(args.work_dir) / name,
            log=lambda line, name=name: print(f"{name} {line}", file=sys.stderr, flush=True),
        )
        out[name] = result["summary"]
    return out


def parse_args(argv: Sequence[str] | None, prog: str | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog=prog,
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
        "  redknot calibrate --model smollm2 --head-map configs/heads/MAP.json --out PROFILE.json"
        " --cases rag_v1=benchmarks/cases/rag_v1.jsonl --device cuda\n"
        "  redknot calibrate --head-map configs/heads/smollm2-135m-instruct.json --out "
        "configs/heads/smollm2-135m-instruct.json --from-result "
        "rag_v1=benchmarks/results/policies.json\n"
        "then serve it: --redknot-head-map PROFILE.json (or put it in $REDKNOT_PROFILES); "
        "docs/calibration.md",
    )
    p.add_argument("--head-map", required=True, help="the model's head map (profile)")
    p.add_argument("--out", required=True, help="where to write the profile with its record")
    p.add_argument("--model", default="smollm2", help="reference-path model (its signature)")
    p.add_argument("--from-result", nargs="*", default=None, metavar="FILE",
                   help="[NAME=]FILE: read these finished evaluations (NAME: the case set) instead of running the candidates")  # fmt: skip
    p.add_argument("--cases", default="rag_v1=benchmarks/cases/rag_v1.jsonl",
                   help="NAME=FILE,... case sets to run")  # fmt: skip
    p.add_argument("--floor-kept", type=float, default=FLOOR["kept"])
    p.add_argument("--floor-top10", type=float, default=FLOOR["top10"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--max-new-tokens", type=int, default=12)
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--work-dir", default="benchmarks/calibrate.work")
    return p.parse_args(argv)


def _case_files(results: Iterable[Mapping[str, Any]]) -> list[str]:
    files = []
    for r in results:
        if "sets" in r:
            files += [v.get("file") for v in r["sets"].values()]
        else:
            files.append(r.get("cases_file") or (r.get("cases") or {}).get("file"))
    return [f for f in files if f]


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    from redknot.headmap.provenance import git_commit

    args = parse_args(argv, prog)
    hm = HeadMap.load(args.head_map)
    floor = {"kept": args.floor_kept, "top10": args.floor_top10}
    sources: list[str] = []
    if args.from_result is not None:
        sets: dict = {}
        loaded = []
        for item in args.from_result:
            name, _, path = item.rpartition("=")
            result = json.loads(Path(path).read_text())
            loaded.append(result)
            sets.update(summaries_of(result, name or Path(path).stem))
            sources.append(f"{path} (commit {result.get('commit') or result.get('git_commit')})")
        case_files = _case_files(loaded)
    else:
        case_sets = dict(item.split("=", 1) for item in args.cases.split(",") if item)
        sets = run_sets(args, args.head_map, case_sets)
        case_files = list(case_sets.values())
        sources.append(f"reference path, {args.device} {args.dtype}, {args.work_dir}")
    try:
        signature = signature_of(args.model)
    except Exception as e:  # noqa: BLE001 - a model whose config cannot be read: no signature
        print(f"warning: no model signature ({e}); the profile is found only by flag",
              file=sys.stderr)  # fmt: skip
        signature = None
    commit, dirty = git_commit()
    provenance = {
        "tool": "redknot.calibrate",
        "version": redknot.__version__,
        "commit": commit,
        "git_dirty": dirty,
        "date": dt.datetime.now(dt.UTC).replace(microsecond=0).isoformat(),
        "command": "python -m redknot.calibrate "
        + " ".join(map(shlex.quote, sys.argv[1:] if argv is None else argv)),
        "model": args.model,
        "cases": {f: _sha(f) for f in case_files},
        "metric": METRIC,
        "floor": floor,
        "sources": sources,
    }
    record = build_record(hm, sets, floor=floor, signature=signature, provenance=provenance)
    out = dataclasses.replace(hm, served=record)
    out.save(args.out)
    print(f"served default: {record.summary()}")
    print(f"why: {record.reason}")
    for row in record.candidates:
        print(f"  {row['label']:40s} kept {row['kept']:.3f} top10 {row['top10']:.3f} "
              f"flops {row['flops_fraction']:.3f} {'meets' if row['meets_floor'] else '-'}")  # fmt: skip
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
