"""Issue 28's figures in one file: ``benchmarks/results/lfps.json``, a join of the LFPS results.

Nothing is measured here. Each section is copied from the result that measured it, with that
file's device, date, commit and command under ``sources``; ratios are taken only within one
file (one run on one machine). ``targets`` says, per target of the issue and per selection or
variant, the figure, whether it is met and where it comes from; a target nothing measured (the
server's offload capacity) is ``met: null`` with the reason.

    python benchmarks/lfps_report.py --out benchmarks/results/lfps.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving_common import record, write_json

RESULTS = Path(__file__).resolve().parent / "results"
RECALL = {  # selection -> result of benchmarks/lfps_recall.py on SmolLM2's attention
    "query_head": "lfps_recall.json",
    "kv_head": "lfps_recall_kv_head.json",
    "kv_head_union": "lfps_recall_kv_head_union.json",
    # not a selection: what any shared list of K keys could recall (exact logits, no LFPS)
    "kv_head_bound": "lfps_recall_kv_head_bound.json",
}
DECODE = {  # result of benchmarks/lfps_decode.py -> the selections taken from it
    "lfps_decode.json": ("kv_head", "query_head"),
    "lfps_decode_union.json": ("kv_head_union",),
    # an H200 run that timed the Top-K's early exit apart (TOPK_EARLY_EXIT, on by default
    # since): its LFPS figures are the step with the early exit (ms_lfps_topk_early_*)
    "lfps_decode_topk_early_h200.json": ("kv_head",),
}
SERVE = ("lfps_serve.json", "lfps_serve_union.json", "lfps_serve_union_t32k.json")
HOST = "lfps_decode_host.json"
CAPACITY = {  # result of lfps_serve.py --mode capacity (offload and flashinfer, one machine)
    "lfps_capacity_h100.json": "lfps-offload",
    "lfps_capacity_h200.json": "lfps-offload",
}
TIERED = "lfps_capacity_tiered_h100.json"  # the tiered store alone (no flashinfer in its run)
CAPACITY_TARGET = 4.0
RECALL_TARGET, SPEEDUP_TARGET, LONG, BATCH = 0.85, 5.0, 131072, 8


def load(results: Path, name: str, sources: dict) -> dict:
    data = json.loads((results / name).read_text())
    sources[name] = {k: data.get(k) for k in ("device", "date", "commit", "command")}
    return data


def recall(results: Path, sources: dict) -> tuple[dict, dict]:
    table, verdict = {}, {}
    for sel, name in RECALL.items():
        data = load(results, name, sources)
        rows = [r for r in data["rows"] if r["data"] != "synthetic"]
        table[sel] = {str(r["length"]): round(r["recall"], 4) for r in rows}
        worst = min(r["recall"] for r in rows)
        verdict[sel] = {"worst": round(worst, 4), "met": worst >= RECALL_TARGET, "source": name,
                        "candidate_factor": data["params"].get("candidate_factor")}  # fmt: skip
        if all("recall_group_topk" in r for r in rows):  # a shared list against its group's
            group = [r["recall_group_topk"] for r in rows]
            table[f"{sel}_vs_group_topk"] = {str(r["length"]): round(g, 4)
                                             for r, g in zip(rows, group)}  # fmt: skip
            verdict[f"{sel}_vs_group_topk"] = {"worst": round(min(group), 4),
                                               "met": min(group) >= RECALL_TARGET,
                                               "source": name}  # fmt: skip
    return table, verdict


def decode(results: Path, sources: dict) -> tuple[dict, dict]:
    table, verdict = {}, {}
    for name, selections in DECODE.items():
        data = load(results, name, sources)
        for r in data["rows"]:
            point = table.setdefault(name, {}).setdefault(f"{r['L']}x{r['B']}", {})
            point["full"] = round(r["ms_full"], 4)
            for sel in selections:
                # the default step: with the Top-K's early exit where the run timed it apart
                lfps = "lfps_topk_early" if f"ms_lfps_topk_early_{sel}" in r else "lfps"
                for method, key in (("topk", "topk"), ("lfps", lfps)):
                    ms = r.get(f"ms_{key}_{sel}")
                    if ms is not None:
                        point[f"{method}_{sel}"] = round(ms, 4)
                if r["L"] == LONG and r["B"] == BATCH and r.get(f"speedup_{lfps}_{sel}"):
                    speedup = r[f"speedup_{lfps}_{sel}"]
                    # one entry per selection and device (the first device's named plainly)
                    key = sel if sel not in verdict else f"{sel} ({data['device']})"
                    verdict[key] = {"speedup": round(speedup, 2), "source": name,
                                    "met": speedup >= SPEEDUP_TARGET,
                                    "device": data["device"]}  # fmt: skip
    return table, verdict


def serving(results: Path, sources: dict) -> tuple[dict, dict, dict]:
    accuracy, throughput, verdict = {}, {}, {}
    for name in SERVE:
        data = load(results, name, sources)
        for variant, row in data["summary"].get("accuracy", {}).items():
            accuracy.setdefault(name, {})[variant] = {
                k: row.get(k) for k in ("cases", "contains", "exact_match", "f1",
                                        "kept_of_dense_correct", "identical_generations")
            }  # fmt: skip
            kept = row.get("kept_of_dense_correct")
            if kept and variant != "dense":
                got, of = (int(x) for x in kept.split("/"))
                verdict[f"{variant} ({name})"] = {"kept_of_dense_correct": kept,
                                                  "met": got >= of - 1}  # fmt: skip
        for variant, points in data["summary"].get("throughput", {}).items():
            throughput.setdefault(name, {})[variant] = {
                p: {k: round(v, 3) for k, v in row.items() if k.startswith("decode")}
                for p, row in points.items()
            }
    return accuracy, throughput, verdict


def host(results: Path, sources: dict) -> dict:
    data = load(results, HOST, sources)
    keys = ("ms_full", "ms_lfps_kv_head", "ms_full_host", "ms_lfps_host_kv_head",
            "ms_lfps_host_staged_kv_head")  # fmt: skip
    return {f"{r['L']}x{r['B']}": {k[3:]: round(r[k], 4) for k in keys if r.get(k)}
            for r in data["rows"]}  # fmt: skip


def capacity(results: Path, sources: dict) -> dict:
    """The offloaded server's concurrent 128K requests against flashinfer's, per machine."""
    verdict = {}
    for name, variant in CAPACITY.items():
        data = load(results, name, sources)
        row = data["summary"]["capacity"][variant]
        dense = data["summary"]["capacity"]["dense"]
        ratio = row["concurrent_vs_dense"]
        verdict[data["device"]] = {
            "offload_concurrent": row["peak_decoding"],
            "dense_concurrent": row["dense_concurrent"],
            "dense_concurrent_from": row["dense_concurrent_from"],
            "dense_kv_pool_tokens": dense["kv_pool_tokens"],
            "ratio": round(ratio, 3),
            "met": ratio >= CAPACITY_TARGET,
            "source": name,
        }
    verdict.setdefault("NVIDIA H100 80GB HBM3", {  # the GPU, until a file measures it
        "met": None,
        "why": "not measured: no lfps_capacity_h100.json (a machine of two H100s and 256 GiB of "
        "host memory runs benchmarks/lfps_capacity_x2.sh; docs/lfps.md)",
    })  # fmt: skip
    return verdict


def tiered(results: Path, sources: dict) -> dict:
    """The tiered store's concurrent 128K requests (GPU KV budget first, then host memory) on a
    machine of less host memory, beside flashinfer's on the same GPU model from the capacity run
    of ``lfps_capacity_h100.json`` (another machine: its pool depends on the GPU only)."""
    if not (results / TIERED).exists():
        return {"measured": False}
    data = load(results, TIERED, sources)
    (row,) = data["per_capacity"]
    dense_row = load(results, "lfps_capacity_h100.json", sources)["summary"]["capacity"][
        "lfps-offload"
    ]
    lines = data["engines"]["capacity"][row["variant"]]["lfps_log_lines"]
    return {
        "device": data["device"],
        "store": next((x.split("redknot: ")[-1] for x in lines if "token slots in" in x), None),
        "requests_sent": row["requests"],
        "length": row["length"],
        "kv_pool_tokens": row["kv_pool_tokens"],
        "offload_concurrent": row["peak_decoding"],
        "dense_concurrent": dense_row["dense_concurrent"],
        "ratio": round(row["peak_decoding"] / dense_row["dense_concurrent"], 3),
        "source": TIERED,
        "dense_source": "lfps_capacity_h100.json",
    }


def build(results: Path) -> dict:
    sources: dict = {}
    recall_table, recall_verdict = recall(results, sources)
    decode_table, decode_verdict = decode(results, sources)
    accuracy, throughput, accuracy_verdict = serving(results, sources)
    return {
        "note": "a join of the results under sources: nothing measured here; ratios within one "
        "file, one run on one machine",
        "sources": sources,
        "targets": {
            f"recall >= {RECALL_TARGET} of exact Top-k at a 2% budget (SmolLM2, teacher-forced, "
            "worst length)": recall_verdict,
            f"decode attention >= {SPEEDUP_TARGET:g}x full attention at 128K, B = {BATCH} (GPU "
            "path)": decode_verdict,
            "answers within one case of dense on SmolLM2's long cases": accuracy_verdict,
            f"offload serves >= {CAPACITY_TARGET:g}x the concurrent 128K requests of "
            "flashinfer (same GPU)": capacity(results, sources),
        },
        "recall_vs_exact_topk": recall_table,
        "decode_attention_ms": decode_table,
        "accuracy": accuracy,
        "decode_tokens_per_s": throughput,
        "host_kv_decode_ms": host(results, sources),
        "tiered_capacity": tiered(results, sources),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", type=Path, default=RESULTS, help="where the sources are")
    ap.add_argument("--out", type=Path, default=RESULTS / "lfps.json")
    args = ap.parse_args(argv)
    result = record(**build(args.results))
    write_json(args.out, result)
    for target, verdict in result["targets"].items():
        print(target, json.dumps(verdict))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
