"""The replayed workloads of ``benchmarks/trace_replay.py`` and their replay against the CPU
server stand-in: what markup could reuse, what the server reused with markup and without."""

from __future__ import annotations

from benchmarks.trace_replay import (
    StandIn,
    chat_workload,
    markable_fraction,
    rag_workload,
    replay,
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
