"""Join SamKV's results into ``benchmarks/results/samkv.json`` (the figures issue 27 asks for),
each figure with the file it comes from and that file's device and commit. Stdlib only.

| part           | source                                                                    |
| -------------- | ------------------------------------------------------------------------- |
| ``served_fidelity`` | ``fidelity_server_samkv.json``: the samkv server against a dense server, SmolLM2, 24 ``rag_v1`` cases; CacheBlend-15's server on the same cases from ``fidelity_server_cacheblend.json`` |
| ``reference_fidelity`` | the reference path (9 ``rag_v1`` cases): ``fidelity_samkv_budget.json`` (fixed budgets), ``fidelity_samkv_equal_recompute.json`` (CacheBlend and EPIC at SamKV's recompute ratio), ``fidelity_samkv_server_rules.json`` (the server's rules there) |
| ``serving``    | ``samkv_serve.json``: 32K prompts of 8 documents on the 8B shape, one GPU, flashinfer / CacheBlend / samkv; ``by_size``: ``ttft_samkv.json``, TTFT alone at 2-32K (``benchmarks/ttft.py``) |
| ``targets``    | each of the issue's targets, its figure and whether it is met             |

    python benchmarks/samkv_report.py
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
FIDELITY_KEYS = ("top1", "top10", "contains", "exact_match", "f1", "sequence_ratio",
                 "recompute_ratio", "flops_fraction", "ttft_s")  # fmt: skip


def load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def source(name: str, data: dict) -> dict:
    return {"file": name, "device": data.get("device"), "commit": data.get("commit"),
            "date": data.get("date")}  # fmt: skip


def kept(summary: dict) -> dict:
    """Dense-correct answers a setting keeps: count, of how many, share."""
    of = summary.get("dense_correct_cases")
    share = summary.get("kept")
    if share is None:  # older files: the share on the dense-correct cases
        share = (summary.get("on_dense_correct") or {}).get("contains")
    count = round(share * of) if share is not None and of else None
    return {"kept_of_dense_correct": count, "dense_correct": of, "kept_share": share}


def setting(summary: dict) -> dict:
    return {**{k: summary.get(k) for k in FIDELITY_KEYS}, **kept(summary)}


def fidelity_part(name: str, settings: list[str] | None = None) -> dict:
    data = load(name)
    chosen = settings or list(data["summary"])
    return {
        "source": source(name, data),
        "settings": {s: setting(data["summary"][s]) for s in chosen if s in data["summary"]},
    }


def build() -> dict:
    served = fidelity_part("fidelity_server_samkv.json")
    blend = fidelity_part("fidelity_server_cacheblend.json", ["cacheblend"])
    served["settings"]["cacheblend (its own server run)"] = blend["settings"]["cacheblend"]
    served["cacheblend_source"] = blend["source"]
    reference = {
        "budget": fidelity_part("fidelity_samkv_budget.json"),
        "equal_recompute": fidelity_part("fidelity_samkv_equal_recompute.json"),
        "server_rules": fidelity_part("fidelity_samkv_server_rules.json"),
    }
    serve = load("samkv_serve.json")
    serving = {"source": source("samkv_serve.json", serve), "summary": serve["summary"],
               "setting": {k: serve["runs"]["samkv"]["command"] for k in ("command",)}}  # fmt: skip
    sizes = load("ttft_samkv.json")
    serving["by_size"] = {"source": source("ttft_samkv.json", sizes), "summary": sizes["summary"]}
    s = serve["summary"]["samkv"]
    sam = served["settings"]["samkv"]
    blend_kept = served["settings"]["cacheblend (its own server run)"]["kept_of_dense_correct"]
    targets = {
        "sequence_ratio <= 0.20 (8B shape, 32K x 8, budget 0.15, blocks of 64)": {
            "value": s["sequence_ratio"], "met": s["sequence_ratio"] <= 0.20},
        "sequence_ratio <= 0.20 (SmolLM2 rag_v1, blocks of 16)": {
            "value": sam["sequence_ratio"], "met": sam["sequence_ratio"] <= 0.20},
        "kept of dense-correct within one case of CacheBlend-15 (SmolLM2, 24 rag_v1 cases)": {
            "value": f"{sam['kept_of_dense_correct']} of {sam['dense_correct']} against "
                     f"{blend_kept}",
            "met": sam["kept_of_dense_correct"] >= blend_kept - 1},
        ">= 4x CacheBlend's concurrent 32K multi-document requests": {
            "value": s["concurrent_requests_vs_cacheblend"],
            "met": s["concurrent_requests_vs_cacheblend"] >= 4},
        "decode tokens/s at 32K >= 3x CacheBlend's at the same batch": {
            "value": s["decode_tokens_per_s_vs_cacheblend"], "batch": s["batch"],
            "met": s["decode_tokens_per_s_vs_cacheblend"] >= 3},
    }  # fmt: skip
    device = (
        f"serving: {serve['device']}; served fidelity: {served['source']['device']}; "
        "reference fidelity: CPU"
    )
    return {"date": serve["date"], "device": device,
            "commit": serve["commit"], "command": "python benchmarks/samkv_report.py",
            "served_fidelity": served, "reference_fidelity": reference, "serving": serving,
            "targets": targets}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(RESULTS / "samkv.json"))
    args = ap.parse_args(argv)
    report = build()
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    json.dump(report["targets"], sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
