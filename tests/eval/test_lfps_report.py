"""``benchmarks/lfps_report.py``: issue 28's figures joined from the results that measured them."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import lfps_report


def test_the_report_copies_each_figure_from_its_source():
    report = lfps_report.build(lfps_report.RESULTS)
    decode = json.loads((lfps_report.RESULTS / "lfps_decode_union.json").read_text())
    row = next(r for r in decode["rows"] if (r["L"], r["B"]) == (131072, 8))
    targets = list(report["targets"].values())
    union = targets[1]["kv_head_union"]
    assert union["speedup"] == round(row["speedup_lfps_kv_head_union"], 2)
    assert union["met"] is (row["speedup_lfps_kv_head_union"] >= 5.0)
    assert report["decode_attention_ms"]["lfps_decode_union.json"]["131072x8"][
        "lfps_kv_head_union"
    ] == round(row["ms_lfps_kv_head_union"], 4)
    h200 = json.loads((lfps_report.RESULTS / "lfps_decode_topk_early_h200.json").read_text())
    row = next(r for r in h200["rows"] if (r["L"], r["B"]) == (131072, 8))
    # the H200's figure is the default step's, with the Top-K's early exit
    assert targets[1]["kv_head (NVIDIA H200)"] == {
        "speedup": round(row["speedup_lfps_topk_early_kv_head"], 2), "met": False,
        "source": "lfps_decode_topk_early_h200.json", "device": "NVIDIA H200"}  # fmt: skip
    assert targets[1]["kv_head"]["device"] == "NVIDIA H100 80GB HBM3"
    assert report["decode_attention_ms"]["lfps_decode_topk_early_h200.json"]["131072x8"] == {
        "full": round(row["ms_full"], 4), "topk_kv_head": round(row["ms_topk_kv_head"], 4),
        "lfps_kv_head": round(row["ms_lfps_topk_early_kv_head"], 4)}  # fmt: skip
    recall = json.loads((lfps_report.RESULTS / "lfps_recall_kv_head.json").read_text())
    worst = min(r["recall"] for r in recall["rows"] if r["data"] != "synthetic")
    assert targets[0]["kv_head"] == {"worst": round(worst, 4), "met": worst >= 0.85,
                                     "source": "lfps_recall_kv_head.json",
                                     "candidate_factor": 4}  # fmt: skip
    for name in lfps_report.CAPACITY:
        capacity = json.loads((lfps_report.RESULTS / name).read_text())
        offload = capacity["summary"]["capacity"]["lfps-offload"]
        verdict = targets[3][capacity["device"]]
        assert verdict["source"] == name
        assert (verdict["offload_concurrent"], verdict["dense_concurrent"]) == (
            offload["peak_decoding"], offload["dense_concurrent"])  # fmt: skip
        assert verdict["met"] is (offload["peak_decoding"] >= 4 * offload["dense_concurrent"])
    tiered = json.loads((lfps_report.RESULTS / lfps_report.TIERED).read_text())
    dense = json.loads((lfps_report.RESULTS / "lfps_capacity_h100.json").read_text())
    got = report["tiered_capacity"]
    assert got["offload_concurrent"] == tiered["per_capacity"][0]["peak_decoding"]
    assert got["dense_concurrent"] == dense["summary"]["capacity"]["lfps-offload"][
        "dense_concurrent"]  # fmt: skip
    assert got["ratio"] == round(got["offload_concurrent"] / got["dense_concurrent"], 3)
    assert "GPU's KV budget first" in got["store"]
    for name, source in report["sources"].items():
        assert all(source[k] for k in ("device", "date", "commit", "command")), name


def _copy_sources(to: Path) -> None:
    """Every result the report reads, copied under ``to`` (to be altered there)."""
    for name in (*lfps_report.RECALL.values(), *lfps_report.DECODE, *lfps_report.SERVE,
                 lfps_report.HOST, *lfps_report.CAPACITY):  # fmt: skip
        shutil.copy(lfps_report.RESULTS / name, to / name)


def test_a_target_is_met_only_at_its_threshold(tmp_path):
    """The same sources with the shared list's recall set to 0.85 at every length and one
    variant losing two dense-correct answers: recall met, that variant's answers not."""
    _copy_sources(tmp_path)
    path = tmp_path / "lfps_recall_kv_head.json"
    data = json.loads(path.read_text())
    for r in data["rows"]:
        r["recall"] = 0.85
    path.write_text(json.dumps(data))
    path = tmp_path / "lfps_serve.json"
    data = json.loads(path.read_text())
    data["summary"]["accuracy"]["topk"]["kept_of_dense_correct"] = "6/8"
    path.write_text(json.dumps(data))
    path = tmp_path / "lfps_capacity_h200.json"
    data = json.loads(path.read_text())
    data["summary"]["capacity"]["lfps-offload"].update(peak_decoding=28, concurrent_vs_dense=4.0)
    path.write_text(json.dumps(data))
    targets = list(lfps_report.build(tmp_path)["targets"].values())
    assert targets[3]["NVIDIA H200"] == dict(targets[3]["NVIDIA H200"], ratio=4.0, met=True)
    assert targets[0]["kv_head"]["met"] is True
    assert targets[2]["topk (lfps_serve.json)"]["met"] is False
    assert targets[2]["lfps (lfps_serve.json)"]["met"] is True


def test_without_an_h100_result_the_capacity_verdict_says_not_measured(tmp_path, monkeypatch):
    _copy_sources(tmp_path)
    (tmp_path / "lfps_capacity_h100.json").unlink()
    monkeypatch.delitem(lfps_report.CAPACITY, "lfps_capacity_h100.json")
    verdict = list(lfps_report.build(tmp_path)["targets"].values())[3]
    assert verdict["NVIDIA H100 80GB HBM3"]["met"] is None
    assert verdict["NVIDIA H200"]["source"] == "lfps_capacity_h200.json"
