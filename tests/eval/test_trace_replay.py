"""The replayed workloads of ``benchmarks/trace_replay.py`` and their replay against the CPU
server stand-in: what markup could reuse, what the server reused with markup and without."""

from __future__ import annotations

import json

import pytest

from benchmarks.trace_replay import (
    CLOSED,
    Profile,
    Sent,
    StandIn,
    capture_overhead,
    chat_workload,
    fill_speedups,
    main,
    markable_fraction,
    paired_figures,
    phase_figures,
    rag_workload,
    replay,
    replay_open,
    salt_of,
)


def test_rag_requests_draw_pool_documents_in_any_order_with_fresh_questions():
    reqs = rag_workload(3, docs=6, requests=20, per_request=(4, 6), doc_tokens=(50, 80), question=8)
    assert reqs == rag_workload(
        3, docs=6, requests=20, per_request=(4, 6), doc_tokens=(50, 80), question=8
    )
    docs = {tuple(r.ids[a:b]) for r in reqs for a, b in r.spans}
    assert len(docs) <= 6 and all(50 <= len(d) <= 80 for d in docs)
    for r in reqs:
        assert 4 <= len(r.spans) <= 6 and r.spans[0][0] == 24  # after the system head
        assert len(r.ids) - r.spans[-1][1] == 8  # the question, never marked
    orders = {tuple(tuple(r.ids[a : a + 4]) for a, _ in r.spans) for r in reqs}
    assert len(orders) == len(reqs)  # documents come in different orders


def test_chat_turns_resend_the_history_under_either_system_prompt():
    reqs = chat_workload(1, sessions=2, turns=3, tool_every=2)
    first, again = reqs[0], reqs[2]  # session 0, turns 0 and 1
    assert first.spans == [] and len(again.spans) == 2  # its user turn and the answer
    (a, b), _ = again.spans
    assert again.ids[a:b] == first.ids[-(b - a) :]  # the earlier user turn, re-sent
    assert len(reqs[4].spans) == 5  # turn 2: two turns, one tool output


def test_markable_counts_spans_seen_in_an_earlier_request_after_warmup():
    reqs = rag_workload(0, docs=2, requests=3, per_request=(2, 2), doc_tokens=(10, 10))
    # request 0 sees both documents first; requests 1 and 2 can reuse all 20 document tokens
    want = 40 / sum(len(r.ids) for r in reqs[1:])
    assert abs(markable_fraction(reqs, 1) - want) < 1e-4
    assert markable_fraction(reqs[:1], 0) == 0.0


def test_replay_on_the_standin_reuses_what_markup_marks_and_chunks_find_without_it():
    reqs = rag_workload(5, docs=4, requests=12, per_request=(3, 4), doc_tokens=(600, 900))
    target = StandIn(region_tokens=16384, context_len=8192)
    marked = replay(target, reqs, "marked", warmup=4)
    auto = replay(target, reqs, "auto", warmup=4)
    plain = replay(target, reqs, "plain", warmup=4)  # no markup, automatic chunks off
    best = markable_fraction(reqs, 4)
    assert marked["reused_token_fraction"] == best > 0.8
    assert 0.5 < auto["reused_token_fraction"] < best  # chunks straddling documents miss
    assert plain["reused_token_fraction"] == 0.0
    assert marked["ttft_p50_s"] is None  # the stand-in measures no time


def test_salts_change_heads_and_questions_never_documents():
    a = rag_workload(2, salt=1, docs=9, requests=6, doc_tokens=(20, 30))
    b = rag_workload(2, salt=2, docs=9, requests=6, doc_tokens=(20, 30))
    for x, y in zip(a, b):
        assert x.spans == y.spans and x.ids[:24] != y.ids[:24]  # another head: no radix hit
        assert [x.ids[i:j] for i, j in x.spans] == [y.ids[i:j] for i, j in y.spans]
        assert x.ids[-32:] != y.ids[-32:]
    c, d = chat_workload(1, salt=1, sessions=2, turns=3), chat_workload(
        1, salt=3, sessions=2, turns=3
    )
    assert [r.spans for r in c] == [r.spans for r in d] and c[0].ids[:64] != d[0].ids[:64]
    assert salt_of("plain", CLOSED) == salt_of("auto", CLOSED) != salt_of("marked", CLOSED)
    passes = [salt_of(m, a) for m in ("marked", "auto") for a in (CLOSED, "poisson 2", "poisson 4")]
    assert len(set(passes)) == len(passes)


def test_distinct_rag_requests_never_repeat_a_document():
    reqs = rag_workload(4, requests=5, distinct=True, doc_tokens=(20, 40))
    docs = [tuple(r.ids[a:b]) for r in reqs for a, b in r.spans]
    assert len(docs) == len(set(docs)) and markable_fraction(reqs, 0) == 0.0


class Clock:
    """A target whose TTFT is 1 s, or 1.2 s when the request may be captured."""

    name = "fake"

    def __init__(self):
        self.bodies = []

    def start(self, mode):
        pass

    def send(self, payload):
        self.bodies.append(payload)
        ttft = 1.0 if payload.get("redknot_capture") is False else 1.2
        return Sent(len(payload["input_ids"]), 10, ttft, "cacheblend")


def test_capture_overhead_compares_all_miss_passes_with_capture_off_and_on():
    target = Clock()
    row = capture_overhead(target, "auto", 0, 3)
    assert row["capture_overhead"] == 1.2 and row["capture_requests"] == 3
    off, on = target.bodies[:3], target.bodies[3:]
    assert all(b["redknot_capture"] is False for b in off) and all(
        "redknot_capture" not in b for b in on
    )
    assert all("redknot_segments" not in b for b in target.bodies)  # auto: no markup


def test_capture_overhead_in_auto_mode_sends_each_request_until_its_chunks_are_captured():
    """Automatic chunks are captured at their second miss: one send each would capture nothing
    and measure no capture at all. The repeat has another first token: an exact-prefix hit
    (the stand-in's model of SGLang's radix cache is on) would serve its chunks, no miss."""
    target = Clock()
    row = capture_overhead(target, "auto", 0, 3, sightings=2)
    assert row["capture_sightings"] == 2 and len(target.bodies) == 12
    first, repeat = target.bodies[0]["input_ids"], target.bodies[1]["input_ids"]
    assert first[1:] == repeat[1:] and first[0] != repeat[0]
    assert target.bodies[1]["input_ids"] != target.bodies[2]["input_ids"]
    for in_place in ("on", "off"):  # stored by the missing request itself, or captured apart
        for sightings, captured in ((1, False), (2, True)):
            standin = StandIn(
                region_tokens=1 << 16, context_len=1 << 15, exact_prefix=True, in_place=in_place
            )
            try:
                capture_overhead(standin, "auto", 0, 2, sightings=sightings)
                api = standin.stats()["api"]
            finally:
                standin.stop()
            key = "captures_in_place" if in_place == "on" else "captures_sent"
            assert (api[key] > 0) == captured, (in_place, sightings, api)
            assert api["captures_sent" if in_place == "on" else "captures_in_place"] == 0


def test_open_loop_sends_every_request_and_counts_what_failed():
    target = Clock()
    reqs = rag_workload(0, docs=9, requests=5, doc_tokens=(5, 8))
    row = replay_open(target, reqs, "marked", rate=500.0, seed=0)
    assert row["requests"] == 5 and row["failed"] == 0 and row["ttft_p50_s"] == 1.2
    assert row["reused_token_fraction"] == round(50 / sum(len(r.ids) for r in reqs), 4)
    assert row["policies"] == ["cacheblend"] and len(target.bodies) == 5


def test_a_paired_baseline_gets_every_request_unmarked_in_alternating_order():
    log: list[str] = []

    class Timed:
        def __init__(self, name, ttft):
            self.name, self.ttft = name, ttft

        def start(self, mode):
            pass

        def send(self, payload):
            log.append(self.name)
            assert ("redknot_segments" in payload) == (self.name == "redknot")
            return Sent(len(payload["input_ids"]), 0, self.ttft(len(log)), None)

    reqs = rag_workload(0, docs=9, requests=6, doc_tokens=(5, 8))
    # the baseline is twice as slow on every second call, the server 0.5 s throughout
    base = Timed("flashinfer", lambda n: 2.0 if n % 4 == 3 else 1.0)
    row = replay(Timed("redknot", lambda n: 0.5), reqs, "marked", 2, paired=base)
    assert log == ["redknot", "flashinfer", "flashinfer", "redknot"] * 3
    paired = row["paired"]
    assert paired["system"] == "flashinfer" and paired["requests"] == 4
    assert paired["ttfts_s"] == [1.0, 2.0] * 3  # every request's, warmup included
    assert paired["speedup_p50"] == 3.0 and paired["ttft_p50_ratio"] == 3.0  # of 2, 4, 2, 4
    assert "paired" not in replay(Timed("redknot", lambda n: 0.5), reqs, "marked", 2)


def test_paired_figures_set_apart_requests_the_two_prefix_caches_served_unequally():
    # (baseline TTFT, server TTFT, baseline cached, server cached) after one warmup request
    rows = [(9.0, 9.0, 0, 0), (2.0, 1.0, 50, 50), (4.0, 1.0, 50, 50), (1.0, 4.0, 90, 10)]
    rows += [(3.0, 1.0, 0, 0)]
    base = [Sent(100, 0, b, None, cached_tokens=bc) for b, _, bc, _ in rows]
    sent = [Sent(100, 0, s, None, cached_tokens=sc) for _, s, _, sc in rows]
    paired = paired_figures(sent, base, 1, "flashinfer")
    assert paired["requests"] == 4 and paired["equal_cached_requests"] == 3
    assert paired["speedup_p50"] == 2.5  # of 2, 4, 0.25, 3
    assert paired["speedup_p50_equal_cached"] == 3.0  # of 2, 4, 3
    assert paired["prefix_cached_fraction"] == 0.475  # the baseline's 190 of 400 after warmup
    assert paired["cached_tokens"] == [0, 50, 50, 90, 0]


def test_profiled_requests_run_under_every_servers_profiler_and_leave_the_figures(monkeypatch):
    import serving_common

    posts, log = [], []
    monkeypatch.setattr(serving_common, "post", lambda url, path, payload=None: posts.append(
        (url, path, (payload or {}).get("output_dir"), len(log))))  # fmt: skip

    class Timed:
        def __init__(self, name, ttft):
            self.name, self.url, self.ttft = name, f"http://{name}", ttft

        def start(self, mode):
            pass

        def send(self, payload):
            log.append(self.name)
            return Sent(len(payload["input_ids"]), 0, self.ttft(len(log)), None)

    reqs = rag_workload(0, docs=9, requests=6, doc_tokens=(5, 8))
    # requests 2 and 3 are profiled, and the profiler makes them slow on both servers
    row = replay(
        Timed("redknot", lambda n: 9.0 if 5 <= n <= 8 else 0.5), reqs, "marked", 0,
        paired=Timed("flashinfer", lambda n: 9.0 if 5 <= n <= 8 else 1.0),
        profile=Profile("/tmp/p", at=2, requests=2),
    )  # fmt: skip
    assert posts == [
        ("http://redknot", "/start_profile", "/tmp/p/redknot-marked", 4),
        ("http://flashinfer", "/start_profile", "/tmp/p/flashinfer-marked", 4),
        ("http://redknot", "/stop_profile", None, 8),
        ("http://flashinfer", "/stop_profile", None, 8),
    ]
    assert row["profiled_requests"] == [2, 4]
    assert row["ttft_p50_s"] == 0.5 and row["paired"]["speedup_p50"] == 2.0
    assert row["paired"]["requests"] == 4 and row["per_request"][2][2] == 9.0  # kept, flagged


def test_phase_figures_are_medians_after_warmup_and_every_request_in_ms():
    def sent(prefill):
        return Sent(10, 0, 0.05, phases={"to_forward": 0.001, "prefill": prefill})

    rows = [sent(0.9), sent(0.010), sent(0.030), Sent(10, 0, 0.05), sent(0.020)]
    figures = phase_figures(rows, warmup=1)
    assert figures["phases_p50_ms"] == {"to_forward": 1.0, "prefill": 20.0}
    assert figures["phases_ms"][0] == {"to_forward": 1.0, "prefill": 900.0}
    assert figures["phases_ms"][3] is None and len(figures["phases_ms"]) == 5
    assert phase_figures([Sent(10, 0, 0.05)], warmup=0) == {}  # a server without metrics


def test_speedups_pair_rows_of_the_same_workload_and_arrival_with_the_baseline():
    rows = [
        {"workload": "rag", "arrival": CLOSED, "system": "flashinfer", "ttft_p50_s": 0.9},
        {"workload": "rag", "arrival": CLOSED, "system": "redknot", "ttft_p50_s": 0.3},
        {"workload": "rag", "arrival": "poisson 2", "system": "redknot", "ttft_p50_s": 0.3},
    ]
    fill_speedups(rows)
    assert rows[1]["speedup_p50_vs_flashinfer"] == 3.0
    assert "speedup_p50_vs_flashinfer" not in rows[0] and "speedup_p50_vs_flashinfer" not in rows[2]


def test_join_labels_runs_of_one_server_under_other_options(tmp_path):
    """Two runs of the same server label (other server options) keep both rows under --join's
    labels; without labels the later file's row replaces the earlier one."""
    from benchmarks.trace_replay import join

    row = {"workload": "rag", "mode": "auto", "arrival": CLOSED, "system": "redknot-cacheblend"}
    paths = []
    for step, overhead in ((2048, 1.13), (1024, 1.07)):
        path = tmp_path / f"s{step}.json"
        data = {"device": "GPU", "date": f"2026-01-0{step % 9}", "commit": "abc",
                "commands": ["x"], "rows": [row | {"capture_overhead": overhead}]}  # fmt: skip
        path.write_text(json.dumps(data))
        paths.append(path)
    out = tmp_path / "joined.json"
    join([f"{paths[0]}=step-2048", f"{paths[1]}=step-1024"], str(out))
    joined = json.loads(out.read_text())
    got = {r["system"]: (r["capture_overhead"], r["system_run"]) for r in joined["rows"]}
    assert got == {"step-2048": (1.13, "redknot-cacheblend"),
                   "step-1024": (1.07, "redknot-cacheblend")}  # fmt: skip
    assert [r["label"] for r in joined["runs"]] == ["step-2048", "step-1024"]
    join([str(p) for p in paths], str(out))
    assert [r["capture_overhead"] for r in json.loads(out.read_text())["rows"]] == [1.07]


def test_a_mode_given_twice_is_refused_before_anything_is_sent(tmp_path, capsys):
    out = tmp_path / "x.json"
    with pytest.raises(SystemExit) as exc:
        main(["--url", "http://127.0.0.1:9", "--modes", "optout,auto,optout", "--out", str(out)])
    assert exc.value.code == 2 and "each mode once" in capsys.readouterr().err
    assert not out.exists()
