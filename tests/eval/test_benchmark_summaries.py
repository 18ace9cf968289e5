"""The arithmetic of the benchmark summaries (``benchmarks/ttft.py``, ``plot_ttft.py``,
``fidelity_agreement.py``): what the GPU runs report is computed here, on made-up figures."""

from __future__ import annotations

import pytest

from benchmarks.plot_ttft import series
from benchmarks.ttft import SWEEP, merge, parse_points, prefill_flops, summarize

CFG = {  # Llama-3.1-8B's shape
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 14336,
}


def test_points_parse_and_malformed_points_are_refused():
    assert parse_points("32768x8, 8192x2") == [(32768, 8), (8192, 2)]
    assert (65536, 8) in parse_points(SWEEP) and (32768, 32) in parse_points(SWEEP)
    for bad in ("32768", "32768x0", "x8", "32Kx8"):
        with pytest.raises(SystemExit, match="LENGTHxSEGMENTS"):
            parse_points(bad)


def _row(length, segments, ttft, **extra):
    return {"length": length, "segments": segments, "prompt_tokens": length + 65,
            "ttft_s": ttft, "ttft_samples_s": [ttft], **extra}  # fmt: skip


def test_summary_ratios_against_flashinfer_at_the_same_point():
    results = {
        "flashinfer": {"points": {"8192x8": _row(8192, 8, 0.2), "32768x8": _row(32768, 8, 1.2)}},
        "redknot-g0.125-reuse": {
            "points": {
                "8192x8": _row(8192, 8, 0.1, every_segment_hit=True),
                "32768x4": _row(32768, 4, 0.6, every_segment_hit=False),
            }
        },
    }
    summary = summarize(CFG, results, reps=1)
    mine = summary["redknot-g0.125-reuse"]["8192x8"]
    assert mine["speedup_vs_flashinfer"] == pytest.approx(2.0)
    ratio = prefill_flops(CFG, 8192 + 65, None) / prefill_flops(CFG, 8192 + 65, 0.125)
    assert mine["flop_ratio_vs_flashinfer"] == pytest.approx(ratio)
    assert 1.0 < ratio < 2.0  # projections and FFN of every token bound the 1/8 schedule
    assert mine["fraction_of_flop_ratio"] == pytest.approx(2.0 / ratio)
    # a point flashinfer did not run has no ratio; a point with misses says so
    other = summary["redknot-g0.125-reuse"]["32768x4"]
    assert "speedup_vs_flashinfer" not in other and other["every_segment_hit"] is False
    assert summary["flashinfer"]["32768x8"]["speedup_vs_flashinfer"] == pytest.approx(1.0)


def test_a_second_flashinfer_engine_is_compared_with_the_first_at_the_same_flops():
    results = {
        "flashinfer": {"points": {"1024x8": _row(1024, 8, 0.036)}},
        "flashinfer-aa": {"points": {"1024x8": _row(1024, 8, 0.040)}},
    }
    aa = summarize(CFG, results, reps=5)["flashinfer-aa"]["1024x8"]
    assert aa["speedup_vs_flashinfer"] == pytest.approx(0.036 / 0.040)  # the engines' drift
    assert aa["flop_ratio_vs_flashinfer"] == pytest.approx(1.0)  # the same work


def test_summary_compares_reuse_with_the_same_engines_own_recompute():
    gate = {"gate_host_scale": 1.27, "served": ["reuse"] * 4}
    results = {
        "flashinfer": {"points": {"2048x8": _row(2048, 8, 0.060)}},
        "sparsex": {
            "points": {
                "2048x8": _row(
                    2048,
                    8,
                    0.045,
                    own_recompute_ttft_s=0.090,
                    own_recompute_paired=[2.1, 0.98, 1.9],
                    **gate,
                ),
                "1024x8": _row(1024, 8, 0.040),  # run without --own-recompute
            }
        },
    }
    summary = summarize(CFG, results, reps=3)
    mine = summary["sparsex"]["2048x8"]
    assert mine["speedup_vs_own_recompute"] == pytest.approx(2.0)  # 0.090 / 0.045
    assert mine["speedup_vs_flashinfer"] == pytest.approx(0.060 / 0.045)
    assert mine["own_recompute_ttft_s"] == 0.090 and mine["gate_host_scale"] == 1.27
    # pair by pair: the median ratio, and how many pairs reuse lost
    assert mine["speedup_vs_own_recompute_paired"] == pytest.approx(1.9)
    assert mine["pairs_slower_than_own_recompute"] == 1 and mine["pairs"] == 3
    assert "speedup_vs_own_recompute" not in summary["sparsex"]["1024x8"]
    assert "speedup_vs_own_recompute_paired" not in summary["sparsex"]["1024x8"]
    assert "own_recompute_ttft_s" not in summary["flashinfer"]["2048x8"]


def test_merged_runs_compare_each_variant_with_flashinfer_and_refuse_other_commits():
    def run(date, variants, **over):
        base = {"device": "H100", "commit": "abc", "date": date, "command": f"ttft {date}",
                "points": ",".join(sorted({k for v in variants.values() for k in v["points"]})),
                "reps": 1, "question": 64, "variants": variants, "summary": {}}  # fmt: skip
        return {**base, **over}

    first = run("d1", {"flashinfer": {"points": {"8192x8": _row(8192, 8, 0.2)}}})
    second = run("d2", {"naive": {"points": {"8192x8": _row(8192, 8, 0.05)}}})
    merged = merge(CFG, {"a.json": first, "b.json": second})
    assert merged["summary"]["naive"]["8192x8"]["speedup_vs_flashinfer"] == pytest.approx(4.0)
    assert [m["date"] for m in merged["merged_from"]] == ["d1", "d2"]
    assert (merged["date"], merged["commit"], merged["points"]) == ("d2", "abc", "8192x8")
    with pytest.raises(SystemExit, match="differs in commit"):
        merge(CFG, {"a.json": first, "c.json": {**second, "commit": "def"}})
    with pytest.raises(SystemExit, match="measures naive again"):
        merge(CFG, {"a.json": first, "b.json": second, "d.json": second})
    # a later run with its own flashinfer: its variants are compared with that one
    third = run("d3", {"flashinfer": {"points": {"8192x8": _row(8192, 8, 0.1)}},
                       "epic": {"points": {"8192x8": _row(8192, 8, 0.05)}}})  # fmt: skip
    merged = merge(CFG, {"a.json": first, "b.json": second, "c.json": third})
    assert merged["baselines"] == {"flashinfer": "flashinfer", "naive": "flashinfer",
                                   "flashinfer@3": "flashinfer@3", "epic": "flashinfer@3"}  # fmt: skip
    summary = merged["summary"]
    assert summary["epic"]["8192x8"]["speedup_vs_flashinfer"] == pytest.approx(2.0)
    assert summary["naive"]["8192x8"]["speedup_vs_flashinfer"] == pytest.approx(4.0)
    assert summary["flashinfer@3"]["8192x8"]["speedup_vs_flashinfer"] == pytest.approx(1.0)


def test_summary_subtracts_the_ffns_the_server_skipped():
    skipped = [7, 1000, 3000, 2000]  # warm-up, then three measured prompts: median 2000
    results = {
        "redknot-g0.125-reuse-sparse-ffn": {
            "points": {"8192x8": _row(8192, 8, 0.1)},
            "ffn_skipped_per_prompt": skipped,
        }
    }
    entry = summarize(CFG, results, reps=3)["redknot-g0.125-reuse-sparse-ffn"]["8192x8"]
    ffn = 2 * 3 * 4096 * 14336
    assert entry["flops"] == pytest.approx(prefill_flops(CFG, 8192 + 65, 0.125) - 2000 * ffn)
    assert entry["ffn_fraction_run"] == pytest.approx(1 - 2000 / ((8192 + 65) * 32))


def test_summary_subtracts_projections_and_ffns_of_rows_left_to_the_cache():
    results = {
        "redknot-g0.125-reuse-sparse-cached": {
            "points": {"8192x8": _row(8192, 8, 0.1)},
            "ffn_skipped_per_prompt": [0, 500, 500],  # warm-up, then two measured prompts
            "left_per_prompt": [0, 40000, 60000],  # median 50000
        }
    }
    entry = summarize(CFG, results, reps=2)["redknot-g0.125-reuse-sparse-cached"]["8192x8"]
    proj = 2 * 4096 * 128 * (2 * 32 + 2 * 8)
    ffn = 2 * 3 * 4096 * 14336
    n = 8192 + 65
    row = proj + ffn + 4 * 128 * 32 * (0.125 * n / 2 + 0.875 * (64 + 256))  # attention row
    want = prefill_flops(CFG, n, 0.125) - 500 * ffn - 50000 * row
    assert entry["flops"] == pytest.approx(want)
    assert entry["token_layers_left_to_cache"] == 50000
    assert entry["ffn_fraction_run"] == pytest.approx(1 - 50500 / ((8192 + 65) * 32))


def test_summary_of_a_token_policy_counts_every_head_global():
    results = {
        "cacheblend": {
            "points": {"8192x8": _row(8192, 8, 0.1)},
            "ffn_skipped_per_prompt": [],  # a token-level policy logs no FFN schedule
            "left_per_prompt": [0, 100000, 100000],
        }
    }
    entry = summarize(CFG, results, reps=2)["cacheblend"]["8192x8"]
    proj = 2 * 4096 * 128 * (2 * 32 + 2 * 8)
    ffn = 2 * 3 * 4096 * 14336
    n = 8192 + 65
    row = proj + ffn + 4 * 128 * 32 * (n / 2)  # every head global: keys at the mean position
    assert entry["flops"] == pytest.approx(prefill_flops(CFG, n, 1.0) - 100000 * row)
    assert entry["token_layers_left_to_cache"] == 100000


def _samkv_plan(doc_tokens, question, budget):
    from redknot.recovery.samkv.served import SamkvKnobs, plan_documents

    hits, start = [], 1  # one first token, then the documents, then the question
    for i, n in enumerate(doc_tokens):
        hits.append((start, n, "bench", f"s{i}"))
        start += n
    knobs = SamkvKnobs(block=64, budget=budget, init_blocks=1, local_blocks=2, bias=True)
    return plan_documents(start + question, hits, knobs)


def test_samkv_work_counts_the_rows_a_cut_prompt_computes_and_their_keys():
    from benchmarks.ttft import samkv_work

    # documents of whole blocks, one with a remainder, one too short for a middle block
    doc_tokens, question = [1024, 1000, 150], 64
    plan = _samkv_plan(doc_tokens, question, budget=0.15)
    assert plan.dropped > 0
    slots = set()  # the served rows no layer computes (the middle slots), brute force
    for d in plan.docs:
        slots.update(range(d.start + d.init, d.start + d.init + d.slots))
    computed = [p for p in range(plan.served_tokens) if p not in slots]
    rows, pairs = samkv_work(1, doc_tokens, question, plan.report(), block=64, init_blocks=1)
    assert rows == len(computed) and pairs == sum(p + 1 for p in computed)
    with pytest.raises(ValueError, match="does not match"):  # another layout than the report's
        samkv_work(1, doc_tokens, question + 1, plan.report(), block=64, init_blocks=1)


def test_summary_of_a_samkv_cut_prompt_counts_only_its_computed_rows():
    from benchmarks.ttft import rows_prefill_flops, samkv_row

    docs, question = [1024] * 8, 64
    report = _samkv_plan(docs, question, budget=0.15).report()
    row = _row(8192, 8, 0.05, **samkv_row([report, report], docs, question, {}))
    uncut = {"note": "stored documents hold 8192 tokens, under --redknot-samkv-min-tokens"}
    small = _row(8192, 8, 0.2, **samkv_row([uncut, uncut], docs, question, {}))
    results = {"flashinfer": {"points": {"8192x8": _row(8192, 8, 0.2)}},
               "samkv": {"points": {"8192x8": row}, "left_per_prompt": []},
               "samkv[samkv_min_tokens=9000]": {"points": {"8192x8": small}}}  # fmt: skip
    summary = summarize(CFG, results, reps=2)
    entry = summary["samkv"]["8192x8"]
    proj = 2 * 4096 * 128 * (2 * 32 + 2 * 8)
    ffn = 2 * 3 * 4096 * 14336
    # each document: 64 + 128 anchor rows computed, 2 of its 13 middle blocks in slots
    assert row["samkv_rows"] == 1 + 8 * 192 + 64 and entry["samkv_cut"] == 2
    want = 32 * (row["samkv_rows"] * (proj + ffn) + 4 * 128 * 32 * row["samkv_pairs"])
    assert entry["flops"] == pytest.approx(want)
    assert rows_prefill_flops(CFG, row["samkv_rows"], row["samkv_pairs"]) == entry["flops"]
    assert entry["served_tokens"] == 1 + 8 * (192 + 128) + 64
    assert entry["sequence_ratio"] == pytest.approx(8 * 320 / 8192, abs=1e-4)
    assert entry["flop_ratio_vs_flashinfer"] > 5
    full = summary["samkv[samkv_min_tokens=9000]"]["8192x8"]  # not cut: the whole prompt
    assert full["samkv_cut"] == 0 and full["samkv_note"] == uncut["note"]
    assert full["flops"] == pytest.approx(prefill_flops(CFG, 8192 + 65, 1.0))


def test_variants_take_their_policys_knobs_in_the_evaluations_label_format():
    from benchmarks.ttft import parse_variant, split_variants

    text = "flashinfer,cacheblend[blend_ratio=0.3],sparsex[sparseq_k=256,sparseq_block=8]"
    names = split_variants(text)
    assert names == ["flashinfer", "cacheblend[blend_ratio=0.3]",
                     "sparsex[sparseq_k=256,sparseq_block=8]"]  # fmt: skip
    assert parse_variant(names[0]) == ("flashinfer", {})
    assert parse_variant(names[1]) == ("cacheblend", {"blend_ratio": 0.3})
    assert parse_variant(names[2]) == ("sparsex", {"sparseq_k": 256, "sparseq_block": 8})
    fresh = "redknot-g0.125-reuse-sparse-cached[local_kv=fresh]"  # redknot's recovery knobs
    assert parse_variant(fresh) == ("redknot-g0.125-reuse-sparse-cached", {"local_kv": "fresh"})
    for bad, message in (
        ("nope", "is not one of"),
        ("epic[blend_ratio=0.3]", "knobs of epic are epic_k"),
        ("flashinfer[epic_k=4]", "knobs of flashinfer are none"),
        ("redknot-g0.125[local_kv=fresh]", "knobs of redknot-g0.125 are none"),
        ("redknot-g0.125-reuse[epic_k=4]", "knobs of redknot-g0.125-reuse are local_kv"),
        ("epic[epic_k=]", "knobs of epic"),
    ):
        with pytest.raises(SystemExit, match=message):
            parse_variant(bad)


def test_log_lines_of_both_skipped_modes_parse():
    from benchmarks.ttft import SKIPPED

    old = (
        "redknot sparse FFN: 12 token-layer FFNs skipped in layers 8-31 of this extend (99 tokens)"
    )
    new = old + "; 345 token-layers left to the cache (skipped=cached)"
    assert SKIPPED.search(old).groups() == ("12", None)
    assert SKIPPED.search(new).groups() == ("12", "345")


def test_plot_series_groups_each_sweep_by_what_it_holds_fixed():
    summary = {
        "flashinfer": {
            "8192x8": {"length": 8192, "segments": 8, "ttft_s": 0.2},
            "32768x8": {"length": 32768, "segments": 8, "ttft_s": 1.2},
            "32768x2": {"length": 32768, "segments": 2, "ttft_s": 1.1},
        }
    }
    by_length = series(summary, "length", "segments")
    assert by_length[8]["flashinfer"] == [(8192, 0.2, None), (32768, 1.2, None)]
    assert 2 not in by_length  # a single point is not a line
    by_count = series(summary, "segments", "length")
    assert by_count[32768]["flashinfer"] == [(2, 1.1, None), (8, 1.2, None)]


def test_fidelity_agreement_counts_identical_generations_per_setting_pair():
    from benchmarks.fidelity_agreement import agreement

    def result(outputs):
        return {"per_case": [
            {"id": i, "settings": {"x": {"output": o, "top1": 1.0}}} for i, o in outputs.items()
        ]}  # fmt: skip

    a = result({"c1": "Paris.", "c2": "12", "c3": "only in a"})
    b = result({"c1": "Paris.", "c2": "11"})
    out = agreement(a, b, [("x", "x")])
    row = out["pairs"]["x | x"]
    assert out["cases"] == 2 and row["identical_outputs"] == 1 and row["same_top1_with_dense"] == 2
    assert row["differing_cases"] == [{"id": "c2", "a": "12", "b": "11"}]
    with pytest.raises(SystemExit, match="no case id"):
        agreement(a, result({"zz": "x"}), [("x", "x")])


def test_profile_summary_busy_time_and_ranges_on_a_made_up_trace():
    from benchmarks.profile_summary import summarize as profile

    k = lambda ts, dur, name="k": {"ph": "X", "cat": "kernel", "ts": ts, "dur": dur, "name": name}
    events = [
        k(0, 10, "gemm"),
        k(5, 10, "gemm"),
        k(30, 5, "copy"),  # union [0,15] + [30,35]
        {"ph": "X", "cat": "user_annotation", "name": "redknot.spread", "ts": 0, "dur": 40},
        {"ph": "X", "cat": "gpu_user_annotation", "name": "redknot.spread", "ts": 10, "dur": 22},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 1, "dur": 7},
        {"ph": "X", "cat": "user_annotation", "name": "other", "ts": 0, "dur": 3},
    ]
    out = profile(events)
    assert out["span_ms"] == 0.035 and out["gpu_busy_ms"] == 0.02 and out["gpu_idle_ms"] == 0.015
    spread = out["ranges"]["redknot.spread"]
    # host 40 us; GPU range [10, 32]: kernels busy in [10, 15] and [30, 32] = 7 us
    assert spread == {"count": 1, "host_ms": 0.04, "gpu_span_ms": 0.022, "gpu_kernel_ms": 0.007}
    assert "other" not in out["ranges"]
    assert out["kernels"][0] == {"name": "gemm", "count": 2, "total_ms": 0.02}
    assert out["runtime"] == [{"name": "cudaStreamSynchronize", "count": 1, "host_ms": 0.007}]
    assert out["longest_host"] == [  # host events only, longest first
        {"name": "redknot.spread", "cat": "user_annotation", "ms": 0.04},
        {"name": "cudaStreamSynchronize", "cat": "cuda_runtime", "ms": 0.007},
        {"name": "other", "cat": "user_annotation", "ms": 0.003},
    ]


def test_policies_take_the_servers_ttft_at_their_default_knobs_only():
    from benchmarks.policies import attach_ttft

    defaults = {"epic_k": 16, "blend_ratio": 0.15, "blend_check_layer": 1}
    rows = [
        {"policy": "full", "setting": "full", "options": None},
        {"policy": "epic", "setting": "epic[epic_k=16]", "options": {**defaults}},
        {"policy": "epic", "setting": "epic[epic_k=64]",  # not what the server ran
         "options": {**defaults, "epic_k": 64}},
        {"policy": "cacheblend", "setting": "cacheblend", "options": {**defaults}},  # unmeasured
        {"policy": "headclass", "setting": "headclass", "options": {**defaults}},  # no variant
    ]  # fmt: skip
    ttft = {"device": "H100", "commit": "abc", "summary": {
        "flashinfer": {"32768x8": {"ttft_s": 1.2, "speedup_vs_flashinfer": 1.0}},
        "epic": {"32768x8": {"ttft_s": 0.3, "speedup_vs_flashinfer": 4.0},
                 "8192x8": {"ttft_s": 0.1, "speedup_vs_flashinfer": 2.0}},
    }}  # fmt: skip
    assert attach_ttft(rows, ttft, "32768x8", defaults) == 2
    swept = {"policy": "epic", "setting": "epic[epic_k=64]", "options": {**defaults, "epic_k": 64}}
    ttft["summary"]["epic[epic_k=64]"] = {"32768x8": {"ttft_s": 0.4, "speedup_vs_flashinfer": 3.0}}
    assert attach_ttft([swept], ttft, "32768x8", defaults) == 1  # the variant of its label
    assert swept["ttft_speedup"] == 3.0 and swept["ttft_source"]["variant"] == "epic[epic_k=64]"
    assert (rows[0]["ttft_s"], rows[1]["ttft_speedup"]) == (1.2, 4.0)
    assert rows[1]["ttft_source"] == {"variant": "epic", "point": "32768x8", "device": "H100",
                                      "commit": "abc"}  # fmt: skip
    assert all("ttft_s" not in r for r in rows[2:])


def test_each_served_setting_finds_the_reference_row_of_its_knobs():
    """``server_policies.py``: a server's resolved knobs pick the reference row of the same
    policy and knobs (the restore edge only while restore is on); one that does not record
    ``local_kv`` reused cached local K/V, one that does not record ``restore_thresh`` did not
    restore."""
    from benchmarks.server_policies import reference_row

    served = {"window": None, "sink": None, "dense_layers": 8, "mass_thresh": 0.5,
              "recent_n": 128, "skipped": "cached"}  # fmt: skip
    redknot = {**served, "restore_edge": 32, "local_kv": "cached"}
    rows = [
        {"policy": "epic", "setting": "epic[epic_k=16]", "options": {"epic_k": 16}},
        {"policy": "epic", "setting": "epic[epic_k=64]", "options": {"epic_k": 64}},
        {"policy": "redknot", "setting": "redknot", "options": {**redknot, "restore_thresh": None}},
        {"policy": "redknot", "setting": "r-on", "options": {**redknot, "restore_thresh": 0.1}},
        {"policy": "naive", "setting": "naive", "options": None},
    ]
    assert reference_row(rows, "epic", {"epic_k": 64}, "f")["setting"] == "epic[epic_k=64]"
    assert reference_row(rows, "redknot", served, "f")["setting"] == "redknot"
    fresh = {"policy": "redknot", "setting": "fresh",
             "options": {**redknot, "restore_thresh": None, "local_kv": "fresh"}}  # fmt: skip
    rows.append(fresh)
    assert reference_row(rows, "redknot", {**served, "local_kv": "fresh"}, "f") is fresh
    assert reference_row(rows, "redknot", {**served, "local_kv": "cached"}, "f")["setting"] == (
        "redknot"
    )
    assert reference_row(rows, "naive", {}, "f")["setting"] == "naive"
    restoring = {**served, "restore_thresh": 0.1, "restore_edge": 32, "restore_heads": 3}
    assert reference_row(rows, "redknot", restoring, "f")["setting"] == "r-on"
    with pytest.raises(SystemExit, match="0 reference rows of redknot"):
        reference_row(rows, "redknot", {**restoring, "restore_edge": 16}, "f")
    assert reference_row(rows, "redknot", {**served, "restore_edge": 16}, "f")["setting"] == (
        "redknot"
    )  # restore off: the edge is not compared
    with pytest.raises(SystemExit, match="0 reference rows of epic with knobs {'epic_k': 32}"):
        reference_row(rows, "epic", {"epic_k": 32}, "f")
    with pytest.raises(SystemExit, match="0 reference rows of redknot"):
        reference_row(rows, "redknot", {**served, "dense_layers": 4}, "f")


def test_first_request_summary_keeps_the_first_prompt_apart_from_the_later_ones():
    from benchmarks.first_request import first_prompts

    run = {"variants": {"redknot": {
        "server_warmup_s": 0.9, "triton_compiled_at_startup": {"k": 1},
        "points": {"32768x8": {"warmup_ttft_s": 6.7, "ttft_samples_s": [0.31, 0.30],
                               "triton_compiled_in_warmup": {"rope_align_kernel": 2}}},
    }}}  # fmt: skip
    got = first_prompts(run)["redknot"]
    assert got["server_warmup_s"] == 0.9 and got["triton_compiled_at_startup"] == {"k": 1}
    assert got["points"]["32768x8"] == {
        "first_ttft_s": 6.7, "later_ttft_s": [0.31, 0.30],
        "triton_compiled_in_first": {"rope_align_kernel": 2},
    }  # fmt: skip


def test_summary_counts_how_the_reuse_gate_served_a_point():
    served = ["recomputed", "reuse", "reuse", "recomputed"]  # warm-up and three prompts
    results = {"epic": {"points": {"1024x8": _row(1024, 8, 0.03, served=served)}}}
    entry = summarize(CFG, results, reps=3)["epic"]["1024x8"]
    assert (entry["served_with_reuse"], entry["served_recomputed"]) == (2, 2)
    assert (
        "served_with_reuse"
        not in summarize(CFG, {"epic": {"points": {"1024x8": _row(1024, 8, 0.03)}}}, reps=1)[
            "epic"
        ]["1024x8"]
    )


def test_logged_counts_of_a_point_after_a_recomputed_one_stay_with_their_point():
    # the server logs "token-layers left to the cache" only for prompts served with reuse: the
    # 1K point was recomputed (no entries), so the first four entries belong to the 2K point
    recomputed, reused = ["recomputed"] * 4, ["reuse"] * 4
    results = {
        "flashinfer": {"points": {"1024x8": _row(1024, 8, 0.035), "2048x8": _row(2048, 8, 0.06)}},
        "epic": {
            "points": {
                "1024x8": _row(1024, 8, 0.036, served=recomputed),
                "2048x8": _row(2048, 8, 0.036, served=reused),
            },
            "left_per_prompt": [1800 * 32] * 4,
        },
    }
    summary = summarize(CFG, results, reps=3)["epic"]
    full_1k = prefill_flops(CFG, 1024 + 65, None)
    assert summary["1024x8"]["flops"] == pytest.approx(full_1k)  # recomputed: every FLOP
    assert "token_layers_left_to_cache" not in summary["1024x8"]
    assert summary["2048x8"]["token_layers_left_to_cache"] == 1800 * 32
    assert 0 < summary["2048x8"]["flops"] < prefill_flops(CFG, 2048 + 65, None)
    assert summary["2048x8"]["flop_ratio_vs_flashinfer"] > 1


def test_summary_carries_each_points_host_probe():
    results = {
        "flashinfer": {"points": {"1024x8": _row(1024, 8, 0.034, host_probe_ms=[0.07, 0.08])}},
        "epic": {"points": {"1024x8": _row(1024, 8, 0.026)}},
    }
    summary = summarize(CFG, results, reps=1)
    assert summary["flashinfer"]["1024x8"]["host_probe_ms"] == [0.07, 0.08]
    assert "host_probe_ms" not in summary["epic"]["1024x8"]
