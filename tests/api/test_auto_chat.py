"""Automatic segments of unmarked OpenAI chat requests (``--redknot-auto-segments cdc`` with
``--redknot-chat-segments off``) against the CPU server stand-in (``cpu_server.py``: SGLang's
real app and ``OpenAIServingChat`` with SmolLM2's chat template, redknot's real request API,
segment store, capture and reuse path; no model, no radix cache).

With ``--redknot-auto-chunk-tokens 32`` chunks are 8 to 128 tokens: a content of 8 to 128 tokens
is one segment, a longer one is cut into content-defined chunks, a shorter one is left alone.
"""

from __future__ import annotations

import pytest

from redknot.api.chunking import Chunker
from redknot.api.marks import decode_marks
from tests.api.test_auto_segments import document

CHUNKER = Chunker.of_average(32)  # min 8, max 128
SYSTEM_A = "You are a careful travel agent. Answer in one sentence, citing the tool."
SYSTEM_B = "You plan journeys for a small company. Keep every answer short and exact."
USER_1 = "Plan my trip. " + document(10, 40)
ASSISTANT_1 = "I will look up the routes with the search tool first. " + document(11, 12)
TOOL_1 = "Search results: " + document(12, 220)  # longer than the chunker's maximum


def turn(system: str, question: str) -> list[dict]:
    """One turn of an agent session: the history (user, assistant, tool), then a question."""
    return [
        {"role": "system", "content": system},
        {"role": "user", "content": USER_1},
        {"role": "assistant", "content": ASSISTANT_1},
        {"role": "tool", "content": TOOL_1},
        {"role": "user", "content": question},
    ]


@pytest.fixture
def make_server(http_app, smollm_tokenizer, server_args):
    from tests.api.cpu_server import CpuServer

    def make(**options):
        options.setdefault("region_tokens", 4096)
        options.setdefault("auto_segments", "cdc")
        options.setdefault("auto_chunk_tokens", 32)
        server = CpuServer(http_app, smollm_tokenizer, server_args=server_args, **options)
        server.enable_chat(server_args)
        return server

    return make


def chat(client, messages, status=200, **extra) -> dict:
    body = {
        "model": "m",
        "messages": messages,
        "max_completion_tokens": 2,
        "return_meta_info": True,
    }
    r = client.post("/v1/chat/completions", json={**body, **extra})
    assert r.status_code == status, r.text
    return r.json()


def report(answer: dict) -> dict:
    (out,) = answer["choices"][0]["meta_info"]["redknot_reuse"]
    return out


def tokens(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def segments_of(ids: list[int]) -> list[list[int]]:
    """The stated rule: a content of at most 128 tokens whole, a longer one in its chunks; none
    shorter than 8 tokens."""
    spans = [(0, len(ids))] if len(ids) <= CHUNKER.max_tokens else CHUNKER.spans(ids)
    return [ids[a:b] for a, b in spans if b - a >= CHUNKER.min_tokens]


def marked(server) -> list[list[int]]:
    """The token ids of every segment marked in the last request, in prompt order."""
    obj = server.tm.last
    custom = (obj.sampling_params or {}).get("custom_params") or {}
    marks = decode_marks(custom, obj.input_ids)
    assert {m.namespace for m in marks} <= {"auto"}
    return [obj.input_ids[m.start : m.end] for m in marks]


def captures(server) -> list:
    return server.tm.captures


def plain_ids(tok, messages) -> list[int]:
    return tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))


@pytest.mark.parametrize("in_place", ["on", "off"])
def test_a_history_resent_under_another_system_prompt_hits(
    make_server, client, smollm_tokenizer, in_place
):
    """Turn 1's messages miss and are stored: by the request itself (in place, the default;
    its report lists them, no capture request) or by captures sent after its answer; turn 2,
    under another system prompt, hits every one of them."""
    tok = smollm_tokenizer
    server = make_server(auto_capture_in_place=in_place)
    history = [tokens(tok, t) for t in (USER_1, ASSISTANT_1, TOOL_1)]
    assert [len(ids) <= 128 for ids in history] == [True, True, False]
    want = {name: segments_of(tokens(tok, name)) for name in (SYSTEM_A, SYSTEM_B)}
    reused = [seg for ids in history for seg in segments_of(ids)]  # what turn 2 should hit
    assert len(segments_of(history[2])) >= 3 and len(want[SYSTEM_A]) == 1

    first = report(chat(client, turn(SYSTEM_A, "Which route?")))
    assert marked(server) == want[SYSTEM_A] + reused  # the question is too short
    assert (first["segments_marked"], first["segments_hit"], first["reused_tokens"]) == (
        len(reused) + 1,
        0,
        0,
    )
    if in_place == "on":
        assert captures(server) == [] and len(first["stored"]) == len(reused) + 1
        assert server.api.counters.captures_in_place == len(reused) + 1
    else:
        assert len(captures(server)) == len(reused) + 1 and "stored" not in first

    second = report(chat(client, turn(SYSTEM_B, "And the cheapest?")))
    assert marked(server) == want[SYSTEM_B] + reused
    assert second["segments_hit"] == len(reused)  # all but the new system prompt
    assert second["reused_tokens"] == sum(len(seg) for seg in reused) > 0
    assert {s["namespace"] for s in second["segments"]} == {"auto"}
    auto = client.get("/redknot/stats").json()["auto"]
    assert (auto["requests"], auto["chunks_marked"]) == (2, 2 * (len(reused) + 1))
    assert (auto["chunk_hits"], auto["chunk_misses"]) == (len(reused), len(reused) + 2)
    assert auto["chunk_hit_tokens"] == second["reused_tokens"]
    assert auto["chunks_stored"] == auto["chunk_captures"] == len(reused) + 2
    assert server.api.counters.requests_with_segments == 0  # not chat segments


def test_a_tool_output_quoted_in_a_later_message_hits_by_its_chunks(
    make_server, client, smollm_tokenizer
):
    tok = smollm_tokenizer
    server = make_server()
    system = "Be brief."  # too short to be a segment
    chat(client, [{"role": "system", "content": system}, {"role": "tool", "content": TOOL_1}])
    stored = segments_of(tokens(tok, TOOL_1))
    assert marked(server) == stored and len(stored) >= 3

    quote = f"My colleague pasted this:\n{TOOL_1}\nIs the second route right?"
    cut = segments_of(tokens(tok, quote))
    hits = [seg for seg in cut if seg in stored]
    assert len(hits) >= len(stored) - 3  # all but a chunk or two at each edge of the quote
    out = report(
        chat(client, [{"role": "system", "content": system}, {"role": "user", "content": quote}])
    )
    assert marked(server) == cut
    assert out["segments_hit"] == len(hits)
    assert out["reused_tokens"] == sum(len(seg) for seg in hits) > 0
    assert client.get("/redknot/stats").json()["auto"]["chunk_hits"] == len(hits)


def test_text_parts_are_contents_too(make_server, client, smollm_tokenizer):
    tok = smollm_tokenizer
    server = make_server()
    result = "Route 3 leaves at nine and costs forty euros; route 5 is full until Friday."
    chat(
        client, [{"role": "user", "content": "Find a route."}, {"role": "tool", "content": result}]
    )
    assert marked(server) == [tokens(tok, result)]

    parts = [
        {"type": "text", "text": result},
        {"type": "text", "text": "Which of the two routes should I take tomorrow morning?"},
    ]
    messages = [{"role": "user", "content": parts}]
    out = report(chat(client, messages))
    assert marked(server) == [
        tokens(tok, result),
        tokens(tok, "Which of the two routes should I take tomorrow morning?"),
    ]
    assert (out["segments_hit"], out["reused_tokens"]) == (1, len(tokens(tok, result)))
    # SGLang joins the parts with a space, which is tokenised on its own (docs/api.md)
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": " ".join(p["text"] for p in parts)}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert tok.decode(server.tm.last.input_ids) == rendered


def test_messages_shorter_than_the_minimum_are_not_segments(make_server, client, smollm_tokenizer):
    tok = smollm_tokenizer
    server = make_server()
    short = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there."},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Route?"},
    ]
    assert all(len(tokens(tok, m["content"])) < 8 for m in short)
    for _ in range(2):
        out = report(chat(client, short))
        assert out["segments_marked"] == 0
        assert server.tm.last.input_ids == plain_ids(tok, short)  # SGLang's own prompt
    assert not captures(server) and server.store.stats()["misses"] == 0
    assert server.api.counters.auto_requests == 0

    chat(client, short[:3] + [{"role": "user", "content": USER_1}])
    assert marked(server) == [tokens(tok, USER_1)]


def test_request_opt_out_and_capture_opt_out(make_server, client, smollm_tokenizer):
    tok = smollm_tokenizer
    server = make_server()
    messages = turn(SYSTEM_A, "Which route?")
    custom = {"custom_params": {"redknot_auto_segments": False}}
    for _ in range(2):
        assert report(chat(client, messages, **custom))["segments_marked"] == 0
        assert server.tm.last.input_ids == plain_ids(tok, messages)
        assert not (server.tm.last.sampling_params.get("custom_params") or {})
    assert not captures(server) and server.store.stats()["misses"] == 0

    out = report(chat(client, messages, custom_params={"redknot_capture": False}))
    assert out["segments_marked"] > 0 and out["segments_hit"] == 0
    assert not captures(server) and server.store.stats()["segments"] == 0


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"redknot_auto_segments": False}, "must be given inside custom_params"),
        ({"custom_params": {"redknot_auto_segments": "no"}}, "must be true or false"),
    ],
)
def test_misplaced_or_bad_opt_out_is_a_400(make_server, client, extra, message):
    server = make_server()
    answer = chat(client, turn(SYSTEM_A, "Which route?"), status=400, **extra)
    assert message in str(answer)
    assert not server.tm.received


def test_servers_that_give_chat_no_automatic_segments(make_server, client, smollm_tokenizer):
    from redknot.segcache.store import SegmentStore

    tok = smollm_tokenizer
    messages = turn(SYSTEM_A, "Which route?")
    for options in ({"auto_segments": "off"}, {"namespaces": "kb"}):
        server = make_server(**options)
        chat(client, messages)
        assert server.tm.last.input_ids == plain_ids(tok, messages)
        assert not marked(server) and not captures(server)
    server = make_server()
    server.scheduler.tree_cache.segments = SegmentStore(0, 1, 0)  # segment fraction 0
    chat(client, messages)
    assert not marked(server) and not captures(server)
    assert "segment store is off" in client.get("/redknot/stats").json()["auto"]["idle"]

    server = make_server(namespaces="kb,auto")
    chat(client, messages)
    assert len(marked(server)) > 3


def test_chat_segments_when_on_decide_alone(make_server, client, smollm_tokenizer):
    tok = smollm_tokenizer
    server = make_server(chat="messages")
    messages = turn(SYSTEM_A, "Which route?")
    chat(client, messages)
    obj = server.tm.last
    marks = decode_marks(obj.sampling_params["custom_params"], obj.input_ids)
    assert {m.namespace for m in marks} == {"default"}
    assert [obj.input_ids[m.start : m.end] for m in marks] == [
        tokens(tok, m["content"]) for m in messages
    ]  # every message whole, the long tool output included
    assert server.api.counters.auto_requests == 0 and server.store.stats("auto")["misses"] == 0
