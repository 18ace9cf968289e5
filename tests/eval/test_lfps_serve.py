"""``benchmarks/lfps_serve.py`` without a GPU: variants, answer scores against dense, decode
rates from streamed chunks, the runner's JSON (children faked) and merging runs."""

from __future__ import annotations

import json
import sys
from argparse import Namespace
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import lfps_serve as ls

from redknot.eval.cases import Case
from redknot.eval.compose import compose

WORDS = {1: "Paris", 2: "London", 3: "Rome", 4: "Oslo", 5: "maybe", 6: "Paris"}
CASES = [Case(cid, ("doc",), "Where?", (answer,)) for cid, answer in
         (("a", "Paris"), ("b", "London"), ("c", "Rome"), ("d", "Oslo"))]  # fmt: skip
PROMPTS = {"a": [7] * 10, "b": [7] * 20, "c": [7] * 30, "d": [7] * 40}


def decode(ids):
    return " ".join(WORDS[i] for i in ids)


class CharTokenizer:
    """One id per character, no special tokens, no chat template; EOS 2, no ``<|im_end|>``."""

    eos_token_id = 2

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [3 + ord(ch) % 100 for ch in text]}

    def convert_tokens_to_ids(self, token):
        return None

    def decode(self, ids, skip_special_tokens=True):
        return decode(ids)


def test_variants_take_keywords_over_the_longest_built_in_name():
    text = ("dense,lfps-b0.05=redknot_lfps_budget=0.05,redknot_lfps_selection=kv-head,"
            "lfps-kv-head-r4=redknot_lfps_max_requests=4,redknot_lfps_min_tokens=512,topk")  # fmt: skip
    specs = ls.split_variants(text)
    assert specs[1] == "lfps-b0.05=redknot_lfps_budget=0.05,redknot_lfps_selection=kv-head"
    variants = ls.parse_variants(text)
    assert list(variants) == ["dense", "lfps-b0.05", "lfps-kv-head-r4", "topk"]
    assert variants["dense"] == {"attention_backend": "flashinfer"}
    assert variants["lfps-b0.05"] == {**ls.REDKNOT, "redknot_lfps": "lfps",
                                      "redknot_lfps_budget": 0.05,
                                      "redknot_lfps_selection": "kv-head"}  # fmt: skip
    assert variants["lfps-kv-head-r4"] == {**ls.VARIANTS["lfps-kv-head"],
                                           "redknot_lfps_max_requests": 4,
                                           "redknot_lfps_min_tokens": 512}  # fmt: skip
    assert variants["topk"]["redknot_all_global"] is True
    # a child is handed its own spec and reads the same keywords
    assert dict(map(ls.parse_variant, specs)) == variants
    for bad, message in (("dense,bogus", "none of"), ("lfps-x", "none of"),
                         ("k=1,dense", "before any variant"), ("lfps,lfps", "twice")):  # fmt: skip
        with pytest.raises(SystemExit, match=message):
            ls.parse_variants(bad)


def test_lfps_settings_reach_sparse_variants_only_and_the_variant_has_the_last_word():
    base, lfps = {"mem_fraction_static": 0.3}, {"redknot_lfps_min_tokens": 1024}
    dense = ls.engine_options(ls.VARIANTS["dense"], base, lfps)
    assert dense == {"mem_fraction_static": 0.3, "attention_backend": "flashinfer"}
    assert "redknot_lfps_min_tokens" not in ls.engine_options(
        ls.VARIANTS["redknot-dense"], base, lfps
    )
    assert ls.engine_options(ls.VARIANTS["topk"], base, lfps)["redknot_lfps_min_tokens"] == 1024
    own = {**ls.VARIANTS["lfps"], "redknot_lfps_min_tokens": 64, "mem_fraction_static": 0.5}
    options = ls.engine_options(own, base, lfps)
    assert options["redknot_lfps_min_tokens"] == 64 and options["mem_fraction_static"] == 0.5


def test_answers_are_scored_and_compared_with_dense_case_by_case():
    dense = {"a": [1], "b": [2], "c": [3], "d": [1]}  # right, right, right, wrong
    lfps = {"a": [1], "b": [1], "c": [5, 3], "d": [4]}  # same, lost, kept (changed), gained
    lfps_ids = {**lfps, "a": [6]}  # the same text from other ids: not an identical generation
    topk = {"a": [1], "b": [2]}  # served two cases only
    rows = ls.variant_rows("dense", CASES, PROMPTS, dense, decode)
    rows += ls.variant_rows("lfps", CASES, PROMPTS, lfps, decode)
    rows += ls.variant_rows("topk", CASES, PROMPTS, topk, decode)
    other_ids = ls.variant_rows("lfps", CASES, PROMPTS, lfps_ids, decode)
    by = {(r["variant"], r["case"]): r for r in rows}
    assert by["lfps", "c"]["output"] == "maybe Rome"
    assert (by["lfps", "c"]["contains"], by["lfps", "c"]["exact_match"]) == (1.0, 0.0)
    assert by["lfps", "c"]["f1"] == pytest.approx(2 / 3)
    assert by["topk", "b"]["prompt_tokens"] == 20 and by["topk", "b"]["output_ids"] == [2]
    summary = ls.accuracy_summary(rows)
    assert summary["dense"]["contains"] == 0.75 and "kept_of_dense_correct" not in summary["dense"]
    assert summary["dense"]["mean_prompt_tokens"] == 25
    mine = summary["lfps"]
    assert mine["contains"] == 0.75 and mine["exact_match"] == 0.5
    assert mine["kept_of_dense_correct"] == "2/3"
    assert mine["kept_of_dense_correct_fraction"] == pytest.approx(2 / 3)
    assert mine["identical_generations"] == "1/4" and mine["identical_generations_fraction"] == 0.25
    assert mine["lost_cases"] == ["b"]
    other = summary["topk"]  # against dense on the cases both served
    assert (other["cases"], other["kept_of_dense_correct"]) == (2, "2/2")
    assert other["identical_generations"] == "2/2" and other["mean_prompt_tokens"] == 15
    assert ls.accuracy_summary(rows[:4] + other_ids)["lfps"]["identical_generations"] == "0/4"
    alone = ls.accuracy_summary([r for r in rows if r["variant"] == "lfps"])["lfps"]
    assert "kept_of_dense_correct" not in alone  # no dense: nothing to compare with


def test_decode_rate_starts_when_every_session_decodes():
    # session 0 prefills first and waits for session 1's prefill; then both decode together
    streams = [
        [(1.0, 1), (3.0, 2), (4.0, 3), (5.0, 4)],
        [(2.0, 1), (3.0, 2), (4.0, 3), (5.0, 4)],
    ]
    figures = ls.stream_figures(0.0, streams)
    assert figures["generated_tokens"] == 8 and figures["decode_tokens"] == 6
    assert figures["decode_window_s"] == 3.0 and figures["decode_tokens_per_s"] == 2.0
    assert figures["decode_step_ms"] == pytest.approx(1000.0)
    assert figures["decode_step_ms_median"] == 1000.0 and figures["steady_decode_tokens_per_s"] == 2
    assert figures["end_to_end_tokens_per_s"] == 8 / 5 and figures["wall_s"] == 5.0
    assert figures["ttft_last_session_s"] == 2.0 and figures["peak_decoding"] == 2
    # one session: first token to last; chunks may carry several tokens
    one = ls.stream_figures(10.0, [[(11.0, 1), (11.5, 3), (12.0, 5)]])
    assert one["decode_tokens_per_s"] == 4.0 and one["decode_step_ms"] == 250.0
    assert one["peak_decoding"] == 1
    # a stall (a kernel compiled at the first step) moves the mean rate, not the steady one
    stall = [(1.0, 1), (7.0, 2), (8.0, 3), (9.0, 4), (10.0, 5)]
    stalled = ls.stream_figures(0.0, [stall, [(2.0, 1)] + stall[1:]])
    assert stalled["decode_tokens_per_s"] == 1.0 and stalled["steady_decode_tokens_per_s"] == 2.0
    assert stalled["decode_step_ms_max"] == 5000.0 and stalled["decode_step_ms_median"] == 1000.0
    # sessions one after the other never decode together
    apart = ls.stream_figures(0.0, [[(1.0, 1), (2.0, 2)], [(3.0, 1), (4.0, 2)]])
    assert apart["peak_decoding"] == 1 and apart["decode_tokens"] == 1


def test_throughput_is_compared_with_dense_at_the_same_point():
    def point(variant, length, batch, decode, e2e):
        return {"variant": variant, "length": length, "batch": batch, "peak_decoding": batch,
                "decode_tokens_per_s": decode, "steady_decode_tokens_per_s": 2 * decode,
                "end_to_end_tokens_per_s": e2e}  # fmt: skip

    points = [
        point("dense", 32768, 8, 100.0, 50.0),
        point("lfps-kv-head", 32768, 8, 300.0, 60.0),
        point("lfps-kv-head", 131072, 1, 90.0, 20.0),
        {"variant": "dense", "length": 131072, "batch": 8, "skipped": "needs 2 KV tokens"},
    ]
    summary = ls.throughput_summary(points)
    mine = summary["lfps-kv-head"]["32768x8"]
    assert mine["decode_speedup_vs_dense"] == pytest.approx(3.0)
    assert mine["end_to_end_speedup_vs_dense"] == pytest.approx(1.2)
    assert mine["steady_decode_speedup_vs_dense"] == pytest.approx(3.0)
    assert mine["steady_decode_tokens_per_s"] == 600.0 and mine["peak_decoding"] == 8
    assert summary["dense"]["32768x8"]["decode_speedup_vs_dense"] == 1.0
    assert "decode_speedup_vs_dense" not in summary["lfps-kv-head"]["131072x1"]
    assert summary["dense"]["131072x8"] == {"skipped": "needs 2 KV tokens"}


def test_prompts_are_the_evaluations_composition():
    tokenizer = CharTokenizer()
    job = ls.prompt_job(tokenizer, CASES[:2])
    assert job["stop_token_ids"] == [2]
    assert job["prompts"]["a"] == list(compose(tokenizer, CASES[0]).ids)
    assert len(job["prompts"]["b"]) == len("doc" + "Where?")


def _args(tmp_path) -> Namespace:
    return Namespace(
        variants=None, lfps_min_tokens=1024, accuracy_model="/m/smol", tokenizer=None,
        cases="cases.jsonl", limit=None, context_length=8192, max_new_tokens=4,
        accuracy_mem_fraction=0.3, throughput_model="/m/8b", lengths="32768,131072",
        batches="1,8", new_tokens=16, mem_fraction_static=0.8, out=str(tmp_path / "out.json"),
        capacity_requests=6, capacity_length=130000, capacity_new_tokens=16,
        capacity_deadline=None,
    )  # fmt: skip


def test_capacity_runs_compare_the_concurrent_requests_served(tmp_path, monkeypatch):
    """``--mode capacity``: one record per variant, the concurrent requests served (the most
    sessions decoding at once) against dense's, the engine log's largest batch beside it, a
    failed engine kept with its error; merging two such runs keeps both."""

    def run_child(script, argv, log_grep=None):
        opts = dict(zip(argv[::2], argv[1::2]))
        assert opts["--mode"] == "capacity" and opts["--capacity-requests"] == "6"
        peak = {"dense": 3, "lfps-offload": 6}.get(opts["--child"].split("=")[0])
        if peak is None:
            return {"error": "exit 1", "log_tail": "cudaHostRegister failed"}
        run = {"requests": 6, "length": 130000, "kv_pool_tokens": peak * 140000,
               "fit_by_pool": peak, "peak_decoding": peak, "wall_s": 60.0,
               "output_ids": [[1, 2], [peak, 4]]}  # fmt: skip
        lines = [f"Decode batch. #running-req: {peak}, gen throughput (token/s): 9.5"]
        return {"capacity": run, "log_lines": lines}

    monkeypatch.setattr(ls.common, "run_child", run_child)
    args = _args(tmp_path)
    args.variants = "dense,lfps-offload=redknot_lfps_offload_gb=100,lfps-offload-big"
    args.variants += "=redknot_lfps_offload_gb=900"
    figures = ls.run(args, ["capacity"], str(tmp_path))
    summary = figures["summary"]["capacity"]
    assert summary["dense"]["peak_decoding"] == 3 and summary["dense"]["concurrent_vs_dense"] == 1
    assert summary["lfps-offload"]["concurrent_vs_dense"] == 2.0
    assert summary["lfps-offload-big"]["error"] == "exit 1"
    assert "concurrent_vs_dense" not in summary["lfps-offload-big"]
    assert summary["dense"]["same_outputs_as"] == []  # its second session's ids differ
    rows = {r["variant"]: r for r in figures["per_capacity"]}
    assert rows["lfps-offload"]["peak_running"] == 6
    assert figures["variants"]["lfps-offload"]["redknot_lfps_offload_gb"] == 100
    assert figures["settings"]["capacity"]["requests"] == 6
    recorded = json.loads(Path(args.out).read_text())
    other = dict(recorded, per_capacity=[dict(rows["dense"], variant="dense-again")])
    unstarted = {"variant": "lfps-offload-late", "requests": 6, "sessions_started": 0}
    assert (
        "concurrent_vs_dense"
        not in ls.capacity_summary([rows["dense"], unstarted])["lfps-offload-late"]
    )  # a deadline before any first token: no figure, not an error
    assert summary["lfps-offload"]["dense_concurrent_from"] == "peak_decoding"
    # dense sent no more requests than its pool holds: its pool, not its peak, is the bound
    roomy = dict(rows["dense"], requests=3, fit_by_pool=7)
    both = ls.capacity_summary([roomy, rows["lfps-offload"]])
    row = both["lfps-offload"]
    assert row["concurrent_vs_dense"] == 6 / 7 and row["dense_concurrent_from"] == "fit_by_pool"
    assert both["dense"]["concurrent_vs_dense"] == 1.0 and both["dense"]["dense_concurrent"] == 7
    merged = ls.merge({"a.json": recorded, "b.json": other})
    assert set(merged["summary"]["capacity"]) == {"dense", "lfps-offload", "lfps-offload-big",
                                                  "dense-again"}  # fmt: skip
    assert merged["summary"]["capacity"]["dense-again"]["same_outputs_as"] == ["dense"]


def test_the_runner_writes_one_record_after_every_child(tmp_path, monkeypatch):
    calls = []

    def prepare(args, workdir):
        job = {"stop_token_ids": [2], "prompts": PROMPTS}
        Path(workdir, "job.json").write_text(json.dumps(job))
        return CASES, PROMPTS, CharTokenizer(), str(Path(workdir, "job.json"))

    def run_child(script, argv, log_grep=None):
        opts = dict(zip(argv[::2], argv[1::2]))
        calls.append((opts["--mode"], opts["--child"]))
        assert script == ls.__file__ and opts["--lfps-min-tokens"] == "1024"
        assert "lfps" in log_grep and "gen throughput" in log_grep
        if opts["--mode"] == "accuracy":
            assert json.loads(Path(opts["--prompts"]).read_text())["prompts"] == PROMPTS
            ids = [1] if opts["--child"] == "dense" else [5]
            return {
                "outputs": {c: ids for c in PROMPTS},
                "log_lines": [
                    "ServerArgs(redknot_lfps='lfps', ...)",
                    "redknot LFPS: 4 requests sparse",
                ],
            }
        if opts["--child"] == "topk-kv-head":
            return {"error": "exit 1", "log_tail": "CUDA out of memory"}
        seen = json.loads(Path(tmp_path / "out.json").read_text())  # written before this child
        assert seen["per_case"] and len(seen["engines"]["accuracy"]) == 3
        point = {"length": 32768, "batch": 8, "decode_tokens_per_s": 10.0, "peak_decoding": 8,
                 "end_to_end_tokens_per_s": 5.0}  # fmt: skip
        lines = ["Decode batch. #running-req: 8, gen throughput (token/s): 9.5"]
        return {"kv_pool_tokens": 500000, "points": [point], "log_lines": lines}

    monkeypatch.setattr(ls, "prepare_accuracy", prepare)
    monkeypatch.setattr(ls.common, "run_child", run_child)
    args = _args(tmp_path)
    ls.run(args, ["accuracy", "throughput"], str(tmp_path))
    assert calls == [("accuracy", "dense"), ("accuracy", "lfps"), ("accuracy", "topk"),
                     ("throughput", "dense"), ("throughput", "lfps-kv-head"),
                     ("throughput", "lfps-query-head"), ("throughput", "topk-kv-head")]  # fmt: skip
    record = json.loads(Path(args.out).read_text())
    assert {"device", "date", "commit", "command"} <= set(record)
    assert set(record) - {"device", "date", "commit", "command"} == {
        "settings", "variants", "engines", "per_case", "per_point", "summary"}  # fmt: skip
    assert record["settings"]["accuracy"]["prompt_tokens"] == {"min": 10, "max": 40}
    assert record["settings"]["throughput"]["lengths"] == [32768, 131072]
    assert record["variants"]["lfps-query-head"]["redknot_lfps_selection"] == "query-head"
    assert len(record["per_case"]) == 12 and len(record["per_point"]) == 3
    assert record["summary"]["accuracy"]["lfps"]["kept_of_dense_correct"] == "0/1"
    assert record["summary"]["accuracy"]["topk"]["identical_generations"] == "0/4"
    engines = record["engines"]
    assert engines["accuracy"]["lfps"]["lfps_log_lines"] == ["redknot LFPS: 4 requests sparse"]
    assert engines["throughput"]["dense"]["peak_running"] == 8
    assert engines["throughput"]["topk-kv-head"]["error"] == "exit 1"
    assert record["summary"]["throughput"]["lfps-kv-head"]["32768x8"][
        "decode_speedup_vs_dense"] == 1.0  # fmt: skip


def test_runs_of_one_commit_merge_and_are_compared_across_files():
    def run(rows, points, date, commit="abc"):
        figures = ls.assemble({"modes": ["accuracy"]}, {}, rows, points, {"accuracy": {}})
        return {"device": "H100", "date": date, "commit": commit, "command": date, **figures}

    dense = ls.variant_rows("dense", CASES, PROMPTS, {c: [1] for c in PROMPTS}, decode)
    lfps = ls.variant_rows("lfps", CASES, PROMPTS, {c: [1] for c in PROMPTS}, decode)
    merged = ls.merge({"a.json": run(dense, [], "d1"), "b.json": run(lfps, [], "d2")})
    assert merged["summary"]["accuracy"]["lfps"]["kept_of_dense_correct"] == "1/1"
    assert merged["summary"]["accuracy"]["lfps"]["identical_generations"] == "4/4"
    assert merged["date"] == "d2" and [m["path"] for m in merged["merged_from"]] == [
        "a.json", "b.json"]  # fmt: skip
    with pytest.raises(SystemExit, match="measured twice"):
        ls.merge({"a.json": run(dense, [], "d1"), "b.json": run(dense, [], "d2")})
    with pytest.raises(SystemExit, match="differs in commit"):
        ls.merge({"a.json": run(dense, [], "d1"), "b.json": run(lfps, [], "d2", commit="x")})


def test_sessions_stop_at_the_deadline_and_keep_what_ran():
    """``sessions(..., deadline_s)``: a session still streaming at the deadline is abandoned;
    every session's chunks so far are returned, finished ones with their output ids."""
    import asyncio

    class Engine:
        loop = asyncio.new_event_loop()

        async def async_generate(self, input_ids, sampling_params, stream):
            async def chunks():
                for n in range(1, 4):
                    await asyncio.sleep(0.01 if input_ids[0] == 0 else 5.0)
                    yield {"meta_info": {"completion_tokens": n}, "output_ids": [7] * n}

            return chunks()

    outputs = [None, None]
    _, marks = ls.sessions(Engine(), [[0], [1]], {}, outputs, deadline_s=0.5)
    assert [n for _, n in marks[0]] == [1, 2, 3] and marks[1] == []
    assert outputs == [[7, 7, 7], None]
