"""How much of a token policy's served-vs-reference divergence the dtype alone explains.

The reference path is run twice on the same cases with the same code, once in float32 and once in
bfloat16 (the server's dtype); nothing else changes. Per policy it records which segment rows
the selection chose in each run (``TokenRecovery.selected``), their overlap (Jaccard) and
whether the greedy generations are identical. A policy whose choice does not read the data
(EPIC: the first ``epic_k`` tokens of each segment) can only move with the model's numerics;
one that ranks rows (SparseX by attention mass, CacheBlend by KV deviation) also moves with
its ranking. For SparseX it also counts the rows whose float32 score lies within bfloat16's
relative resolution (``2**-8``) of the cut, where rounding alone can swap a row in or out.

    python benchmarks/selection_numerics.py --cases benchmarks/cases/rag_v1.jsonl --limit 24 \\
        --out benchmarks/results/selection_numerics.json

``--served FILE=LABEL`` adds how often a server's generations (a ``redknot.eval fidelity
--backend server`` result, its policy served under ``LABEL``'s knobs) equal each run's, for the
policy and for its dense server; ``--rescore RESULT`` recomputes the summary of an earlier run
(with new ``--served`` files) without running the model.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Self

import torch

from redknot.eval.base import PolicySetting
from redknot.eval.cases import load_cases
from redknot.eval.compose import ComposedCase
from redknot.eval.reference_backend import ReferenceBackend
from redknot.headmap.provenance import git_commit
from redknot.recovery import RecoveryOptions
from redknot.recovery.tokenwise import TokenRecovery

BF16_RESOLUTION = 2.0**-8  # bfloat16 keeps 8 significant bits
SETTINGS = {  # label: (policy, options) as the server serves them
    "epic[epic_k=16]": ("epic", {"epic_k": 16}),
    "cacheblend[blend_ratio=0.15]": ("cacheblend", {"blend_ratio": 0.15}),
    "sparsex[sparseq_boundary=5]": ("sparsex", {"sparseq_boundary": 5}),
    "sparsex[sparseq_boundary=1]": ("sparsex", {"sparseq_boundary": 1}),
}


def jaccard(a: list[int], b: list[int]) -> float:
    sa, sb = set(a), set(b)
    return 1.0 if not sa | sb else len(sa & sb) / len(sa | sb)


def near_cut(scores: torch.Tensor, candidates: torch.Tensor, k: int) -> int:
    """Candidate rows whose score is within ``BF16_RESOLUTION`` (relative) of the ``k``-th
    largest candidate score: rows bfloat16 rounding alone can move across the top-k cut."""
    s = scores[candidates].double()
    if k <= 0 or k >= s.numel():
        return 0
    cut = s.topk(k).values[-1]
    return int(((s - cut).abs() <= BF16_RESOLUTION * cut.abs()).sum())


class Recorder:
    """Wraps ``TokenRecovery.restore_classes`` to keep the selection (and SparseX's scores) of
    every token policy served inside it: ``records``, one per policy, in the order they ran."""

    def __init__(self) -> None:
        self.policies: list[TokenRecovery] = []
        self.records: list[dict] = []
        self._orig = TokenRecovery.restore_classes

    def __enter__(self) -> Self:
        recorder = self

        def restore_classes(policy, ctx, q, keys, values):
            if not any(p is policy for p in recorder.policies):  # its first layer
                recorder.policies.append(policy)
                recorder.records.append({"selected": []})
            had = policy.selected is not None
            out = recorder._orig(policy, ctx, q, keys, values)
            if not had and policy.selected is not None:
                # prompt positions (rows of the call start after a cached head)
                rec = {"selected": (policy.selected + ctx.past_len).tolist()}
                selection = getattr(policy, "selection", None)
                if selection is not None:  # SparseX: its top-k ranks the reused rows
                    reused = torch.nonzero(policy._segment_mask(ctx)).flatten()
                    rec["near_cut"] = near_cut(selection.scores, reused, policy.options.sparseq_k)
                recorder.records[-1] = rec
            return out

        TokenRecovery.restore_classes = restore_classes
        return self

    def __exit__(self, *exc) -> None:
        TokenRecovery.restore_classes = self._orig


class HeadInCall(ReferenceBackend):
    """The reference path with the prompt's head (template and system rows) computed in the
    prefill call instead of cached before it: what a server computes when its radix cache holds
    no page of the head (the rows are then probed and ranked by SparseX like new text)."""

    def _prompt(self, composed: ComposedCase, head_map):
        return super()._prompt(ComposedCase(composed.ids, composed.segments, 0), head_map)


COMPARISONS = {  # --compare: the two runs, (name, dtype, backend class)
    "dtype": (("float32", torch.float32, ReferenceBackend),
              ("bfloat16", torch.bfloat16, ReferenceBackend)),
    "prefix": (("float32", torch.float32, ReferenceBackend),
               ("float32_head_in_call", torch.float32, HeadInCall)),
}  # fmt: skip


def run(backend: ReferenceBackend, case, labels: list[str]) -> dict[str, dict]:
    """Each setting of ``labels`` (and ``full``) on ``case``: generation and selection."""
    settings = [PolicySetting("full")] + [
        PolicySetting(SETTINGS[label][0], RecoveryOptions(**SETTINGS[label][1]), label)
        for label in labels
    ]
    with Recorder() as rec:  # one call: the case's segments are cached once for every setting
        got = backend.run_case(case, settings)
    out = {"full": {"output": got["full"].text.strip()}}
    for label, record in zip(labels, rec.records, strict=True):  # full is no token policy
        out[label] = {"output": got[label].text.strip(), **record}
    return out


def summarise(per_case: list[dict], labels: list[str], runs: tuple[str, str]) -> dict:
    """Per setting, how the two runs' selections and generations compare."""
    first, second = runs
    out = {}
    for label in ["full", *labels]:
        rows = [(c[first][label], c[second][label]) for c in per_case]
        same_output = [a["output"].strip() == b["output"].strip() for a, b in rows]
        item = {"identical_generations": sum(same_output)}
        if label != "full":
            js = [jaccard(a["selected"], b["selected"]) for a, b in rows]
            same = [a["selected"] == b["selected"] for a, b in rows]
            item["identical_selections"] = sum(same)
            item["mean_jaccard"] = round(sum(js) / len(js), 4)
            item["min_jaccard"] = round(min(js), 4)
            item["identical_generations_where_selection_identical"] = sum(
                o for o, s in zip(same_output, same) if s
            )
            item["identical_generations_where_selection_differs"] = sum(
                o for o, s in zip(same_output, same) if not s
            )
            if "near_cut" in rows[0][0]:
                item[f"mean_rows_within_bf16_of_cut_{first}"] = round(
                    sum(a["near_cut"] for a, _ in rows) / len(rows), 2
                )
        out[label] = item
    return out


def served_agreement(per_case: list[dict], served: list[str], runs: tuple[str, str]) -> dict:
    """Per ``FILE=LABEL``: identical generations of the server's policy and of its dense server
    with each dtype's run, on the cases both have (outputs stripped, as the evaluation's)."""
    out = {}
    for spec in served:
        path, _, label = spec.partition("=")
        data = json.loads(Path(path).read_text())
        policy = label.split("[")[0]
        theirs = {c["id"]: c["settings"] for c in data["per_case"]}
        common = [c for c in per_case if c["id"] in theirs]
        item = {"file": path, "commit": data.get("commit"), "cases": len(common)}
        for run in runs:
            item[run] = {
                name: sum(
                    theirs[c["id"]][name]["output"].strip() == c[run][mine]["output"].strip()
                    for c in common
                )
                for name, mine in ((policy, label), ("full", "full"))
            }
        out[spec] = item
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="benchmarks/cases/rag_v1.jsonl")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--head-map", default="configs/heads/smollm2-135m-instruct.json")
    ap.add_argument("--settings", default=",".join(SETTINGS), help="comma list of: "
                    + ", ".join(SETTINGS))  # fmt: skip
    ap.add_argument("--max-new-tokens", type=int, default=12, help="as the servers' results")
    ap.add_argument("--served", action="append", default=[], help="FILE=LABEL (repeatable)")
    ap.add_argument("--rescore", default=None, help="an earlier result: summarise, run nothing")
    ap.add_argument("--compare", choices=sorted(COMPARISONS), default="dtype",
                    help="dtype: float32 vs bfloat16; prefix: float32 with the prompt's head "
                    "cached (as the reference path serves it) vs computed in the call (as a "
                    "server without a radix-cache hit on it)")  # fmt: skip
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    labels = [s for s in args.settings.split(",") if s]
    unknown = [s for s in labels if s not in SETTINGS]
    if unknown:
        ap.error(f"unknown setting(s) {unknown}; choose from {list(SETTINGS)}")

    if args.rescore:
        result = json.loads(Path(args.rescore).read_text())
        runs = tuple(result.get("runs", ("float32", "bfloat16")))
        labels = [lb for lb in result["per_case"][0][runs[0]] if lb != "full"]
        result["summary"] = summarise(result["per_case"], labels, runs)
        result["served"] = served_agreement(result["per_case"], args.served, runs)
        result["rescore_command"] = "python " + " ".join([sys.argv[0], *(argv or sys.argv[1:])])
        return write(result, args.out)
    commit, dirty = git_commit()  # the code this run loads now, not the HEAD of its end
    cases = load_cases(args.cases)[: args.limit]
    runs = tuple(name for name, _, _ in COMPARISONS[args.compare])
    backends = {
        name: cls.load(args.model, args.head_map, dtype=dtype, max_new_tokens=args.max_new_tokens)
        for name, dtype, cls in COMPARISONS[args.compare]
    }
    per_case = []
    for case in cases:
        started = time.perf_counter()
        row = {"id": case.id}
        for name, backend in backends.items():
            row[name] = run(backend, case, labels)
        row["wall_s"] = round(time.perf_counter() - started, 1)
        per_case.append(row)
        print(case.id, {lb: row[runs[0]][lb]["output"] == row[runs[1]][lb]["output"]
                        for lb in ["full", *labels]}, flush=True)  # fmt: skip
    result = {
        "device": "cpu",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "commit": (commit or "unknown")[:7],
        "git_dirty": dirty,
        "command": "python " + " ".join([sys.argv[0], *(argv or sys.argv[1:])]),
        "model": backends[runs[0]].model_name,
        "runs": list(runs),
        "cases": args.cases,
        "count": len(per_case),
        "max_new_tokens": args.max_new_tokens,
        "summary": summarise(per_case, labels, runs),
        "served": served_agreement(per_case, args.served, runs),
        "per_case": per_case,
    }
    return write(result, args.out)


def write(result: dict, out: str | None) -> int:
    if out:
        Path(out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("summary", "served")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
