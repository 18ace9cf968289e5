"""Automatic segments of unmarked ``/generate`` prompts (``--redknot-auto-segments cdc``) against
the CPU server stand-in (``cpu_server.py``: SGLang's real app, redknot's real request API,
segment store, capture and reuse path; no model)."""

from __future__ import annotations

import random
import types

import pytest

from redknot.api.marks import decode_marks

_WORDS = (
    "river stone market winter lantern copper harbor orchard signal thunder velvet garden "
    "mirror engine canyon meadow silver paper island candle forest bridge yellow marble "
    "falcon quiet summer violet anchor cotton desert planet ribbon shadow spirit window"
)
WORDS = _WORDS.split(" ")


def document(i: int, words: int = 300) -> str:
    rng = random.Random(i)
    sentences = []
    while sum(len(s.split()) for s in sentences) < words:
        n = rng.randint(6, 14)
        sentences.append(" ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + ".")
    return f"Document {i}: " + " ".join(sentences)


DOCS = [document(i) for i in range(4)]


def rag_prompt(system: str, order: list[int], question: str) -> str:
    body = "\n\n".join(DOCS[i] for i in order)
    return f"{system}\n\n{body}\n\nQuestion: {question}\nAnswer:"


def auto_server(http_app, tokenizer, **options):
    """A stand-in server with automatic chunks (``cdc``, chunks of about 32 tokens)."""
    from tests.api.cpu_server import CpuServer

    options.setdefault("region_tokens", 4096)
    options.setdefault("auto_segments", "cdc")
    options.setdefault("auto_chunk_tokens", 32)
    return CpuServer(http_app, tokenizer, **options)


@pytest.fixture
def make_server(http_app, smollm_tokenizer):
    def make(**options):
        # the capture path apart (what most tests here check); in place: test_auto_in_place.py
        options.setdefault("auto_capture_in_place", "off")
        return auto_server(http_app, smollm_tokenizer, **options)

    return make


def generate(client, text=None, **extra):
    body = {"sampling_params": {"max_new_tokens": 4, "temperature": 0}, **extra}
    if text is not None:
        body["text"] = text
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def marks_of(obj) -> list:
    custom = (obj.sampling_params or {}).get("custom_params") or {}
    return decode_marks(custom, obj.input_ids)


def captures(server) -> list:
    return server.tm.captures


def test_rag_documents_in_another_order_under_another_prefix_hit(
    make_server, client, smollm_tokenizer
):
    server = make_server(auto_capture_after=1)  # every chunk captured at its first miss
    first = rag_prompt("You are a helpful assistant.", [0, 1, 2, 3], "Which river?")
    out = generate(client, first)
    assert out["meta_info"]["standin_read_tokens"] == 0
    sent = server.tm.last
    assert sent.input_ids == smollm_tokenizer.encode(first)  # SGLang's own tokens, unchanged
    marks = marks_of(sent)
    assert len(marks) > 5 and {m.namespace for m in marks} == {"auto"}
    assert marks[0].start > 0 and marks[-1].end < len(sent.input_ids)  # not first, not last
    assert len(captures(server)) == len({m.segment_id for m in marks})
    assert server.store.stats("auto")["captures"] == len({m.segment_id for m in marks})

    second = rag_prompt("Answer from these documents only.", [2, 0, 3, 1], "Which harbor?")
    out = generate(client, second)
    doc_tokens = sum(len(smollm_tokenizer.encode(d, add_special_tokens=False)) for d in DOCS)
    assert out["meta_info"]["standin_read_tokens"] >= 0.7 * doc_tokens
    stats = client.get("/redknot/stats").json()
    auto = stats["auto"]
    assert auto["chunk_hits"] >= 0.6 * len(marks_of(server.tm.last))
    assert auto["requests"] == 2 and auto["chunk_captures"] == len(captures(server))
    assert auto["chunk_hit_tokens"] == out["meta_info"]["standin_read_tokens"]
    assert "auto" in stats["namespaces"]


@pytest.mark.parametrize("context", [64, 0])
def test_a_chunk_is_captured_after_the_tokens_that_preceded_it(make_server, client, context):
    """``--redknot-auto-capture-context K``: each chunk is captured after the tokens before it
    in the prompt that missed it: the (up to) K before the first of a run of consecutive missed
    chunks, which are captured in one prompt, each after the ones before it (alone, from
    position 0, under K = 0); the store holds each chunk's tokens only, and a prompt with the
    documents in another order hits them as before."""
    server = make_server(auto_capture_after=1, auto_capture_context=context)
    generate(client, rag_prompt("You are a helpful assistant.", [0, 1, 2, 3], "Which river?"))
    sent = server.tm.last
    where = {m.segment_id: m.start for m in marks_of(sent)}
    assert captures(server) and len(captures(server)) == len(where)
    for capture in captures(server):  # one per chunk: what it was computed after, then it
        (mark,) = marks_of(capture)
        start = where[mark.segment_id]
        assert mark.end == len(capture.input_ids)
        assert mark.start == 0 if context == 0 else mark.start >= min(start, context)
        assert (
            capture.input_ids == sent.input_ids[start - mark.start : mark.end - mark.start + start]
        )
        assert server.store.registration_state("auto", mark.segment_id)["state"] == "ready"
        stored = server.store.lookup("auto", capture.input_ids[mark.start :])
        assert stored is not None and stored.num_tokens == mark.end - mark.start
    prompts = [
        obj for obj in server.tm.received if obj is not sent and obj.input_ids != sent.input_ids
    ]
    sent_prompts = sum(len(p.input_ids) if isinstance(p.input_ids[0], list) else 1 for p in prompts)
    assert (sent_prompts == len(where)) == (context == 0)  # runs share a prompt
    out = generate(client, rag_prompt("Be brief.", [2, 0, 3, 1], "Which harbor?"))
    assert out["meta_info"]["standin_read_tokens"] > 0


def test_chunks_are_captured_at_their_second_miss_by_default(make_server, client):
    server = make_server()
    docs = [rag_prompt("You are a helpful assistant.", [0, 1, 2, 3], "Which river?"),
            rag_prompt("Answer from these documents only.", [2, 0, 3, 1], "Which harbor?"),
            rag_prompt("Be brief.", [1, 3, 0, 2], "Which bridge?")]  # fmt: skip
    generate(client, docs[0])
    first = {m.segment_id for m in marks_of(server.tm.last)}
    api = client.get("/redknot/stats").json()["api"]
    assert captures(server) == [] and api["captures_deferred"] == len(first)
    generate(client, docs[1])  # the chunks inside documents miss again: captured now
    second = {m.segment_id for m in marks_of(server.tm.last)}
    again = first & second
    assert len(again) >= 0.6 * len(second)  # most chunks lie inside a document
    captured = {m.segment_id for c in captures(server) for m in marks_of(c)}
    assert captured == again  # only what missed twice
    out = generate(client, docs[2])
    assert out["meta_info"]["standin_read_tokens"] > 0
    assert client.get("/redknot/stats").json()["auto"]["chunk_hits"] > 0


@pytest.mark.parametrize("exact_prefix", [True, False])
def test_chunks_the_prefix_cache_served_are_not_captured(make_server, client, exact_prefix):
    """A conversation through ``/generate`` (each turn the previous prompt and more), chunks
    captured at their third sighting: the chunks of a turn that start inside its exact-prefix
    hit (``cached_tokens``, the stand-in's model of SGLang's radix cache) are not captured,
    the prefix cache serving them to the next turn, so the conversation captures nothing; their
    sightings count, so a prompt that computes the first turn's document elsewhere captures
    its chunks at once. Without a prefix hit every chunk seen three times is captured."""
    server = make_server(exact_prefix=exact_prefix, auto_capture_after=3)
    turns, text = [], "You are a helpful assistant."
    for k in range(3):
        text += f"\n\nUser: {DOCS[k]}\nAssistant: noted {k}."
        turns.append(text)
    first_seen: dict[str, int] = {}
    cached = []
    for k, prompt in enumerate(turns):
        out = generate(client, prompt)
        cached.append(out["meta_info"]["cached_tokens"])
        for m in marks_of(server.tm.last):
            first_seen.setdefault(m.segment_id, k)
    captured = {m.segment_id for c in captures(server) for m in marks_of(c)}
    counters = server.api.counters
    if not exact_prefix:
        assert cached == [0, 0, 0] and counters.captures_prefix_cached == 0
        thrice = {sid for sid, k in first_seen.items() if k == 0}
        assert captured and captured <= thrice
        return
    assert cached[0] == 0 and cached[1] > 0 and cached[2] > cached[1]
    assert captured == set() and counters.captures_prefix_cached > 0
    # the first turn's chunks: computed once, then served twice from the prefix hit; another
    # prompt computes them (no prefix hit) and, seen three times, they are captured now
    out = generate(client, f"Another assistant.\n\nUser: {DOCS[0]}\nAssistant: noted.")
    assert out["meta_info"]["cached_tokens"] == 0
    captured = {m.segment_id for c in captures(server) for m in marks_of(c)}
    turn0 = {sid for sid, k in first_seen.items() if k == 0}
    assert captured & turn0 and captured <= {m.segment_id for m in marks_of(server.tm.last)}


def test_a_stored_chunk_is_never_counted_as_a_miss_to_defer(make_server, client):
    server = make_server()
    text = rag_prompt("Hi.", [0, 1, 2], "Why?")
    counters = server.api.counters
    generate(client, text)
    n = counters.captures_deferred
    assert n > 0 and counters.captures_sent == 0
    generate(client, text)  # every chunk misses a second time: all captured
    assert counters.captures_deferred == n and counters.captures_stored == n
    generate(client, text)  # every chunk hits: nothing deferred, nothing sent
    assert counters.captures_deferred == n and counters.captures_sent == n
    assert server.store.stats("auto")["hits"] == n


def test_input_ids_prompts_are_chunked_as_given(make_server, client):
    server = make_server(auto_capture_after=1)
    ids = random.Random(5).choices(range(3, 500), k=600)
    generate(client, input_ids=ids)
    assert server.tm.last.input_ids == ids and marks_of(server.tm.last)
    generate(client, input_ids=[1, 2] + ids[100:])  # the same tokens after another head
    assert server.store.stats("auto")["hits"] > 0


def test_option_off_leaves_prompts_alone(make_server, client):
    server = make_server(auto_segments="off")
    text = rag_prompt("Hi.", [0, 1], "Why?")
    for _ in range(2):
        generate(client, text)
    assert server.tm.last.text == text and server.tm.last.input_ids is None
    assert not marks_of(server.tm.last) and not captures(server)
    assert server.store.stats()["misses"] == 0 and server.api.counters.auto_requests == 0
    assert "auto" not in client.get("/redknot/stats").json()


def test_request_opt_out_is_served_unsegmented_and_the_flag_removed(make_server, client):
    for mode in ("cdc", "off"):
        server = make_server(auto_segments=mode)
        text = rag_prompt("Hi.", [0, 1], "Why?")
        generate(client, text, redknot_auto_segments=False)
        assert server.tm.last.text == text and not marks_of(server.tm.last)
        assert not captures(server) and server.store.stats()["misses"] == 0
    generate(client, text, redknot_auto_segments=True)  # on a server with it off: no effect
    assert server.tm.last.text == text


@pytest.mark.parametrize("value", ["no", 0, None])
def test_bad_opt_out_flag_is_a_400(make_server, client, value):
    server = make_server()
    r = client.post("/generate", json={"text": "plain", "redknot_auto_segments": value})
    assert r.status_code == 400 and "redknot_auto_segments must be true or false" in r.text
    assert not server.tm.received


def test_capture_opt_out_keeps_lookups_and_stores_nothing(make_server, client):
    server = make_server()
    generate(client, rag_prompt("Hi.", [0, 1], "Why?"), redknot_capture=False)
    assert marks_of(server.tm.last) and not captures(server)
    assert server.store.stats("auto")["misses"] > 0 and server.store.stats()["segments"] == 0


def test_marked_requests_are_left_as_they_are(make_server, client, smollm_tokenizer):
    server = make_server()
    text = rag_prompt("Hi.", [0, 1, 2], "Why?")
    start = text.index(DOCS[1])
    spans = [{"start": start, "end": start + len(DOCS[1]), "namespace": "kb"}]
    generate(client, text, redknot_segments=spans)
    (mark,) = marks_of(server.tm.last)
    assert mark.namespace == "kb"
    assert server.store.stats("auto")["misses"] == 0 and server.api.counters.auto_requests == 0


def test_closed_namespaces_without_auto_serve_unsegmented(make_server, client):
    server = make_server(namespaces="kb")
    text = rag_prompt("Hi.", [0, 1], "Why?")
    generate(client, text)
    assert server.tm.last.text == text and not marks_of(server.tm.last)
    server = make_server(namespaces="kb,auto")
    generate(client, text)
    assert marks_of(server.tm.last)


@pytest.mark.parametrize(
    "gate_min, marked",
    [(None, False), (10**6, False), (20, True)],
    ids=["nothing-pays", "above-max", "pays"],
)
def test_chunks_below_the_reuse_gate_break_even_are_not_segments(
    make_server, client, gate_min, marked
):
    server = make_server()
    asked = []

    def min_segment_tokens(prompt_tokens=8192, question=64):
        asked.append(prompt_tokens)
        return gate_min

    from redknot.costmodel.gate import Decision

    server.scheduler.pool.reuse_gate = types.SimpleNamespace(
        min_segment_tokens=min_segment_tokens,
        decide=lambda work: Decision(True, 1.0, 2.0, "a stand-in gate: always reuse"),
        hopeless=lambda prompt_len, prefix_len: None,
    )
    for order in ([0, 1, 2], [2, 1, 0]):
        generate(client, rag_prompt("Hi.", order, "Why?"))
        marks = marks_of(server.tm.last)
        assert bool(marks) == marked
        assert all(m.num_tokens >= max(gate_min or 0, 8) for m in marks)
    assert asked == [8192]  # asked once per server
    auto = client.get("/redknot/stats").json()["auto"]
    assert auto["gate_min_tokens"] == gate_min
    assert (auto["idle"] is not None) == (gate_min is None)
    assert auto["min_store_tokens"] == max(gate_min or 0, 8)
    if not marked:
        assert not captures(server) and server.store.stats("auto")["misses"] == 0


def test_no_chunk_is_a_segment_where_the_gate_measured_that_no_hit_pays(make_server, client):
    """A gate whose record lets segments pay but whose server measured that no hit can
    (``ReuseGate.recomputes_all``, after the startup calibration): unmarked prompts get no
    automatic segments, and the reason is the gate's."""
    server = make_server()
    why = "no segment hit can make a prompt of up to 4096 tokens faster (measured)"
    server.scheduler.model_config = types.SimpleNamespace(context_len=4096)
    server.scheduler.pool.reuse_gate = types.SimpleNamespace(
        min_segment_tokens=lambda prompt_tokens=8192, question=64: 20,
        recomputed_up_to=lambda limit: 0,
        recomputes_all=lambda limit: why,
        calibration_plan=lambda limit: [],
        hopeless=lambda prompt_len, prefix_len: None,
    )
    generate(client, rag_prompt("Hi.", [0, 1, 2], "Why?"))
    assert not marks_of(server.tm.last) and not captures(server)
    auto = client.get("/redknot/stats").json()["auto"]
    assert auto["idle"] == why and auto["requests"] == 0


def test_prompts_sglang_refuses_are_left_to_it(make_server, client):
    server = make_server(context_len=256)
    r = client.post("/generate", json={"text": " ".join(DOCS)})  # longer than the context
    assert r.status_code == 400 and "longer than the model's context length" in r.text
    assert server.tm.last.text == " ".join(DOCS)
    for body in ([1, 2], "text", 3, None, {"text": None}, {"text": 5}, {"text": ["a", 5]}):
        r = client.post("/generate", json=body)  # SGLang's to refuse, never a 5xx here
        assert r.status_code < 500, r.text
    client.post("/generate", json={"input_ids": [1, -2, 3] * 100})  # not token ids
    assert server.tm.last.input_ids == [1, -2, 3] * 100
    assert server.api.counters.auto_requests == 0


def test_a_server_without_a_segment_store_marks_no_chunks(make_server, client):
    from redknot.segcache.store import SegmentStore

    server = make_server()
    server.scheduler.tree_cache.segments = SegmentStore(0, 1, 0)  # segment fraction 0
    text = rag_prompt("Hi.", [0, 1], "Why?")
    generate(client, text)
    assert server.tm.last.text == text and not captures(server)
    auto = client.get("/redknot/stats").json()["auto"]
    assert "segment store is off" in auto["idle"] and auto["requests"] == 0


def test_a_repeated_document_is_captured_once_and_batches_are_chunked(make_server, client):
    server = make_server(auto_capture_after=1)
    text = "Notes.\n\n" + "\n\n".join([DOCS[0]] * 3) + "\n\nQuestion: why?"
    generate(client, text)
    marks = marks_of(server.tm.last)
    ids = {m.segment_id for m in marks}
    assert len(ids) < len(marks)  # the same chunks recur
    assert len(captures(server)) == len(ids) == server.store.stats("auto")["segments"]
    assert server.api.counters.captures_deduplicated == len(marks) - len(ids)
    prompts = [rag_prompt("A.", [1, 0], "x?"), rag_prompt("B.", [0, 1], "y?")]
    r = client.post("/generate", json={"text": prompts, "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 200, r.text
    assert len(r.json()) == 2 and isinstance(server.tm.last.input_ids[0], list)
    assert server.store.stats("auto")["hits"] > 0


def _adversarial_body(rng: random.Random, vocab: int) -> dict:
    """One unmarked /generate body of a seeded adversarial kind."""
    doc = [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 400))]
    kind = rng.choice(["repeat", "edit", "token", "short", "batch", "vocab", "limit", "text"])
    if kind == "repeat":  # a prompt of repeated chunks
        ids = doc[:60] * rng.randrange(2, 8)
    elif kind == "edit":  # a document that differs in one token
        at = rng.randrange(len(doc))
        ids = [5] * 20 + doc[:at] + [(doc[at] + 1) % vocab] + doc[at + 1 :]
    elif kind == "token":  # one token repeated
        ids = [rng.randrange(vocab)] * rng.randrange(1, 1500)
    elif kind == "short":
        ids = doc[: rng.randrange(0, 3)]
    elif kind == "batch":
        ids = [doc, doc[::-1], doc[: len(doc) // 2]]
    elif kind == "vocab":  # ids SGLang refuses
        ids = doc + [vocab + rng.randrange(5)]
    elif kind == "limit":  # at and past the context length (2048)
        ids = (doc * 2048)[: rng.choice([2046, 2047, 2048, 2049])]
    else:
        return {
            "text": rng.choice(DOCS) * rng.randrange(1, 4),
            "redknot_capture": rng.random() < 0.5,
        }
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1}}
    if rng.random() < 0.2:
        body["redknot_auto_segments"] = rng.random() < 0.5
    return body


@pytest.mark.parametrize("mode", ["cdc", "cdc-edges", "cdc-docs"])
@pytest.mark.parametrize("seed", [0, 1])
def test_adversarial_unmarked_prompts_get_no_5xx_and_lose_nothing(make_server, client, seed, mode):
    server = make_server(
        region_tokens=512, namespace_fraction=0.5, auto_capture_after=1, auto_segments=mode
    )
    keep = client.post("/redknot/segments", json={"namespace": "kb", "input_ids": [9] * 40})
    assert keep.status_code == 200, keep.text
    rng = random.Random(seed)
    vocab = server.tm.model_config.vocab_size
    statuses = []
    for _ in range(60):
        body = _adversarial_body(rng, vocab)
        r = client.post("/generate", json=body)
        assert r.status_code < 500, (body, r.text)
        statuses.append(r.status_code)
        if r.status_code == 200 and "input_ids" in body:
            assert server.tm.last.input_ids == body["input_ids"]  # the prompt as sent
        server.store.check()
    assert 200 in statuses and 400 in statuses
    assert server.store.stats("auto")["evictions"] > 0  # the flood stayed within its cap
    assert [e.id for e in server.store.list("kb")] == [keep.json()["segment_id"]]
    text = rag_prompt("After.", [0], "Still?")  # and the store still serves
    for _ in range(2):
        generate(client, text)
    assert server.store.stats("auto")["hits"] > 0


def test_a_capture_asks_the_store_once_before_and_once_after(make_server, client):
    server = make_server(auto_capture_after=1)
    ops = server.record_control_ops()
    generate(client, rag_prompt("Hi.", [0, 1, 2, 3], "Why?"))
    stored = server.api.counters.captures_stored
    assert stored > 8  # many chunks: one control request each way, not one per chunk
    assert [op for op in ops if op.startswith("registration")] == ["registrations"] * 2


def test_a_miss_while_the_first_is_being_decided_counts_toward_capture(make_server):
    import asyncio

    from redknot.api.marks import segment_id

    server = make_server()  # chunks captured at their second miss
    capturer, ask = server.api.capture, server.tm.redknot_segments_communicator
    ids = list(range(10, 90))
    chunk = [("auto", ids, True, [], None)]

    async def two_overlapping_requests():
        held = asyncio.Event()

        async def slow(req):  # the store answers after the scheduler's step under way
            await held.wait()
            return await ask(req)

        server.tm.redknot_segments_communicator = slow
        first = asyncio.ensure_future(capturer.capture(chunk))
        await asyncio.sleep(0)  # the first miss is being decided
        second = asyncio.ensure_future(capturer.capture(chunk))
        await asyncio.sleep(0)
        held.set()
        await asyncio.gather(first, second)

    asyncio.run(two_overlapping_requests())
    counters = server.api.counters
    assert counters.captures_deduplicated == 1 and counters.captures_deferred == 0
    assert counters.captures_stored == 1
    assert server.store.registration_state("auto", segment_id("auto", ids))["state"] == "ready"


def test_learned_document_edges_serve_what_straddling_chunks_lose(make_server, client):
    """``cdc-edges``: the chunks that straddle two documents never hit, but the documents' heads
    and tails they share with earlier misses are learned, captured and then served, so the
    same stream of reordered prompts reuses more than under ``cdc``."""
    orders = [[0, 1, 2, 3], [2, 0, 3, 1], [1, 3, 0, 2], [3, 2, 1, 0], [0, 2, 1, 3], [3, 1, 2, 0]]
    served = {}
    for mode in ("cdc", "cdc-edges"):
        server = make_server(auto_segments=mode, region_tokens=16384)
        cached = []
        for k, order in enumerate(orders):
            text = rag_prompt(f"System prompt {k}.", order, f"Question {k}?")
            cached.append(generate(client, text)["meta_info"]["standin_read_tokens"])
        stats = client.get("/redknot/stats").json()
        served[mode] = sum(cached[-2:])
        learned = stats["auto"]["edges_learned"]
        assert (learned > 0) == (mode == "cdc-edges"), (mode, learned)
        if mode == "cdc-edges":  # every learned edge was captured and stored
            assert server.store.stats("auto")["captures"] >= learned
    assert served["cdc-edges"] > served["cdc"] > 0, served


def test_the_edge_mode_parses_and_unknown_modes_are_refused():
    from redknot.api.options import AutoSegmentsOption

    option = AutoSegmentsOption.parse("cdc-edges", 256)
    assert option.enabled and option.edges
    assert not AutoSegmentsOption.parse("cdc", 256).edges
    docs = AutoSegmentsOption.parse("cdc-docs", 256)
    assert docs.enabled and docs.edges and docs.documents
    assert not option.documents
    with pytest.raises(ValueError, match="cdc-edges"):
        AutoSegmentsOption.parse("edges", 256)


def test_documents_between_learned_edges_are_served_whole(make_server, client, smollm_tokenizer):
    """``cdc-docs``: once a document's head and tail are learned and the run between them has
    recurred, it is captured (with the separator tokens its learned edges share across
    prompts) and later prompts mark it as one segment, which hits; ``cdc-edges`` marks the same
    stream in more, smaller segments and never a whole document."""
    orders = [[0, 1, 2, 3], [2, 0, 3, 1], [1, 3, 0, 2], [3, 2, 1, 0], [0, 2, 1, 3], [3, 1, 2, 0],
              [1, 0, 3, 2], [2, 3, 0, 1]]  # fmt: skip
    orders += [random.Random(k).sample(range(4), 4) for k in range(12)]
    docs = [smollm_tokenizer.encode(d, add_special_tokens=False) for d in DOCS]

    def whole_documents(last) -> list[tuple[int, int]]:
        """``(start, tokens)`` of the marks of ``last`` that hold a whole document and at most
        8 tokens more."""
        ids, out = list(last.input_ids), []
        for m in marks_of(last):
            span = ids[m.start : m.end]
            for doc in docs:
                inside = any(span[i : i + len(doc)] == doc for i in range(len(span) - len(doc) + 1))
                if inside and len(span) - len(doc) <= 8:
                    out.append((m.start, m.end - m.start))
        return out

    marked = {}
    for mode in ("cdc-edges", "cdc-docs"):
        server = make_server(auto_segments=mode, region_tokens=65536)
        counts, assembled, served_whole = [], 0, 0
        for k, order in enumerate(orders):
            out = generate(client, rag_prompt(f"System prompt {k}.", order, f"Question {k}?"))
            counts.append(len(marks_of(server.tm.last)))
            whole = whole_documents(server.tm.last)
            (report,) = out["meta_info"]["redknot_reuse"]
            hits = {(h["start"], h["tokens"]) for h in report["segments"]}
            assembled += len(whole)
            served_whole += len(hits & set(whole))
        marked[mode] = sum(counts[-6:])
        if mode == "cdc-edges":
            assert assembled == 0, "cdc-edges never marks a whole document"
        else:
            assert assembled == served_whole > 0, "a document is marked whole once stored"
    assert marked["cdc-docs"] < marked["cdc-edges"], marked


def test_documents_join_a_learned_head_to_the_next_learned_tail():
    """A tail belongs to the latest head starting at or before its last window, even when the
    next document's head starts before the tail ends (their edges share the separator)."""
    from redknot.api.chunking import WINDOW
    from redknot.api.edges import documents

    assert WINDOW == 32  # the positions below are written for it
    starts, ends = [100, 300, 450], [290, 460, 40]
    # 100 -> 290; 300 -> 460 although the head at 450 starts before 460; 450 is left open;
    # the tail ending at 40 has no head before it
    assert documents(starts, ends, max_tokens=500) == [(100, 290), (300, 460)]
    assert documents(starts, ends, max_tokens=180) == [(300, 460)]  # 100 -> 290 is too long
    assert documents([100, 200], [290], 500) == [(200, 290)]  # the latest head
    assert documents([], ends, 500) == [] and documents(starts, [], 500) == []
