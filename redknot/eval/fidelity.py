"""The fidelity evaluation: every case under every policy setting, compared with dense.

Per case, the backend serves the setting ``full`` (dense prefill, the reference) and every
other setting; each is scored with :mod:`redknot.eval.metrics`. The summary gives, per
setting, the mean of every metric over all cases and over the cases dense answers correctly
(``contains``; ``kept`` is the share of those this setting also answers), the FLOPs as a
fraction of dense (mean of per-case ratios) and the recomputed fractions; ``pareto`` lists the settings no other setting beats on both FLOPs fraction and
first-token top-1 agreement.

>>> result = evaluate(backend, cases, settings)        # settings include "full"
>>> result["summary"]["redknot"]["top1"], result["pareto"]
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from redknot.eval.base import REFERENCE_LABEL, FidelityBackend, PolicyOutput, PolicySetting
from redknot.eval.cases import Case
from redknot.eval.metrics import answer_scores, first_token_scores
from redknot.eval.store import CaseStore

SCORES = ("top1", "top10", "cosine", "kl", "contains", "exact_match", "f1")
COSTS = (
    "flops_fraction",
    "attention_fraction",
    "ffn_fraction",
    "kv_head_fraction",
    "sequence_ratio",
    "recompute_ratio",
)


def score(output: PolicyOutput, dense: PolicyOutput, case: Case) -> dict[str, Any]:
    """Every metric of one setting on one case."""
    row: dict[str, Any] = first_token_scores(
        output.first_logits, output.first_top, dense.first_logits, dense.first_top
    )
    row.update(answer_scores(output.text, case.answers))
    row["output"] = output.text.strip()
    row["matches_dense_output"] = float(output.tokens == dense.tokens)
    if output.flops is not None and dense.flops is not None:
        row["flops"] = output.flops["total"]
        row["flops_fraction"] = output.flops["total"] / dense.flops["total"]
        row["flops_terms"] = output.flops
    row["attention_fraction"] = output.fractions.get("attention")
    row["ffn_fraction"] = output.fractions.get("ffn")
    row["kv_head_fraction"] = output.fractions.get("kv_heads")
    row["sequence_ratio"] = output.fractions.get("sequence_ratio")  # samkv: KV rows held
    row["recompute_ratio"] = output.fractions.get("recompute_ratio")
    row["restored_heads"] = output.restored_heads
    row["ttft_s"] = output.ttft_s
    row["wall_s"] = None if output.wall_s is None else round(output.wall_s, 2)
    return row


def _mean(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return sum(values) / len(values) if values else None


def summarise(per_case: list[dict], labels: Sequence[str]) -> dict[str, dict]:
    solved = [c for c in per_case if c["settings"][REFERENCE_LABEL]["contains"]]
    out = {}
    for label in labels:
        rows = [c["settings"][label] for c in per_case]
        on_correct = [c["settings"][label] for c in solved]
        summary = {k: _mean(rows, k) for k in SCORES + COSTS + ("matches_dense_output", "ttft_s")}
        summary["restored_heads"] = _mean(rows, "restored_heads")
        summary["on_dense_correct"] = {k: _mean(on_correct, k) for k in SCORES}
        # kept-of-dense-correct: the share of dense's right answers (contains) this one keeps
        summary["kept"] = summary["on_dense_correct"]["contains"]
        summary["cases"] = len(rows)
        summary["dense_correct_cases"] = len(on_correct)
        out[label] = summary
    return out


def pareto(summary: dict[str, dict], cost: str = "flops_fraction", gain: str = "top1") -> list:
    """Labels not dominated on (lower ``cost``, higher ``gain``), cheapest first."""
    points = [
        (s[cost], s[gain], label)
        for label, s in summary.items()
        if s.get(cost) is not None and s.get(gain) is not None
    ]
    front = [
        p
        for p in points
        if not any(q[0] <= p[0] and q[1] >= p[1] and (q[0] < p[0] or q[1] > p[1]) for q in points)
    ]
    return [label for _, _, label in sorted(front)]


def evaluate(
    backend: FidelityBackend,
    cases: Sequence[Case],
    settings: Sequence[PolicySetting],
    *,
    work_dir: str | Path | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run every case (``settings`` must contain the ``full`` reference; it runs first).
    With ``work_dir``, every finished (case, setting) and each case's reference output are
    kept there (:class:`~redknot.eval.store.CaseStore`): a rerun runs only what is missing."""
    labels = [s.label for s in settings]
    if REFERENCE_LABEL not in labels or len(set(labels)) != len(labels):
        raise ValueError(f"settings need unique labels and one named {REFERENCE_LABEL!r}")
    ordered = sorted(settings, key=lambda s: s.label != REFERENCE_LABEL)
    reference = ordered[0]
    described = backend.describe()
    started = time.perf_counter()
    per_case, reused = [], 0
    for i, case in enumerate(cases):
        store = CaseStore(work_dir, described, case)
        rows = {s.label: store.row(s) for s in ordered}
        missing = [s for s in ordered if rows[s.label] is None]
        reused += len(ordered) - len(missing)
        if missing:
            dense = store.dense()
            to_run = missing if dense is not None or reference in missing else [reference] + missing
            outputs = backend.run_case(case, to_run)
            if dense is None:
                dense = outputs[REFERENCE_LABEL]
                store.put_dense(dense)
            for s in missing:
                rows[s.label] = score(outputs[s.label], dense, case)
                store.put_row(s, rows[s.label])
        meta = store.meta()
        if meta is None:
            shape = backend.shape_of(case)
            meta = {
                "id": case.id,
                "kind": case.kind,
                "prompt_tokens": shape.prompt,
                "segment_tokens": shape.segments,
                "prefix_tokens": shape.prefix,
                "segments": shape.count,
                "answers": list(case.answers),
            }
            store.put_meta(meta)
        per_case.append({**meta, "settings": rows})
        others = ", ".join(
            f"{s.label} {rows[s.label]['top1']:.0f}/{rows[s.label]['contains']:.0f}"
            for s in ordered[1:]
        )
        log(
            f"[{i + 1}/{len(cases)}] {case.id}: {meta['prompt_tokens']} tokens, dense "
            f"{rows[REFERENCE_LABEL]['output']!r} (answer {case.answers[0]!r}); top1/contains: "
            f"{others}; {len(missing)} settings run, {time.perf_counter() - started:.0f} s"
        )
    summary = summarise(per_case, [s.label for s in ordered])
    kinds = sorted({c["kind"] for c in per_case})
    return {
        "settings": [s.to_json() for s in ordered],
        "summary": summary,
        "summary_by_kind": {
            k: summarise([c for c in per_case if c["kind"] == k], [s.label for s in ordered])
            for k in kinds
        },
        "pareto": {
            "top1_vs_flops": pareto(summary),
            "exact_match_vs_flops": pareto(summary, gain="exact_match"),
        },
        "cases": {
            "count": len(per_case),
            "by_kind": {k: sum(c["kind"] == k for c in per_case) for k in kinds},
            "dense_contains": summary[REFERENCE_LABEL]["contains"],
            "dense_exact_match": summary[REFERENCE_LABEL]["exact_match"],
            "dense_correct": summary[REFERENCE_LABEL]["dense_correct_cases"],
            "prompt_tokens": {
                "min": min(c["prompt_tokens"] for c in per_case),
                "max": max(c["prompt_tokens"] for c in per_case),
                "mean": round(sum(c["prompt_tokens"] for c in per_case) / len(per_case), 1),
            },
            "case_settings_reused_from_work_dir": reused,
        },
        "per_case": per_case,
        "seconds": round(time.perf_counter() - started, 1),
    }
