"""Chat messages as segments (--redknot-chat-segments), through SGLang's OpenAIServingChat."""

from __future__ import annotations

import pytest

from redknot.api.marks import decode_marks
from redknot.api.options import ChatSegments

DOC = "Paris is the capital of France. Berlin is the capital of Germany."


@pytest.fixture
def chat(make_api, smollm_tokenizer, server_args):
    """``chat(mode, **api options)`` -> (serving chat, api); SmolLM2's Jinja chat template."""
    from tests.api.cpu_server import serving_chat

    def make(mode, **options):
        api = make_api(smollm_tokenizer, chat=mode, **options)
        return serving_chat(api.tokenizer_manager, server_args), api

    return make


def _request(messages, **extra):
    from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest

    return ChatCompletionRequest(model="m", messages=messages, max_tokens=4, **extra)


MESSAGES = [
    {"role": "system", "content": "You answer from the documents."},
    {"role": "user", "content": DOC},
    {"role": "assistant", "content": "Noted."},
    {"role": "user", "content": "What is the capital of France?"},
]


def _plain_ids(tok, messages):
    return tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))


def test_every_message_is_a_segment(chat, smollm_tokenizer):
    serving, api = chat("messages")
    obj, _ = serving._convert_to_internal_request(_request(MESSAGES))
    marks = decode_marks(obj.sampling_params["custom_params"], obj.input_ids)
    assert len(marks) == 4
    for m, msg in zip(marks, MESSAGES, strict=True):
        assert obj.input_ids[m.start : m.end] == smollm_tokenizer.encode(
            msg["content"], add_special_tokens=False
        )
        assert m.namespace == "default"
    # the template around the segments is the template's own text
    assert smollm_tokenizer.decode(obj.input_ids) == smollm_tokenizer.apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True
    )
    assert api.counters.segments_marked == 4


def test_min_tokens_selects_long_messages(chat, smollm_tokenizer):
    serving, _ = chat("min-tokens:10")
    obj, _ = serving._convert_to_internal_request(_request(MESSAGES))
    (mark,) = decode_marks(obj.sampling_params["custom_params"], obj.input_ids)
    assert smollm_tokenizer.decode(obj.input_ids[mark.start : mark.end]) == DOC


def test_off_serves_as_sglang_does(chat, smollm_tokenizer):
    serving, _ = chat("off")
    obj, _ = serving._convert_to_internal_request(_request(MESSAGES))
    assert obj.input_ids == _plain_ids(smollm_tokenizer, MESSAGES)
    assert not (obj.sampling_params.get("custom_params") or {})


def test_namespace_from_custom_params(chat):
    serving, _ = chat("messages", namespaces="tenant1")
    req = _request(MESSAGES, custom_params={"redknot_namespace": "tenant1", "other": 2})
    obj, _ = serving._convert_to_internal_request(req)
    custom = obj.sampling_params["custom_params"]
    assert custom["other"] == 2 and "redknot_namespace" not in custom
    assert {m.namespace for m in decode_marks(custom, obj.input_ids)} == {"tenant1"}


@pytest.mark.parametrize(
    "mode, custom, message",
    [
        ("messages", {"redknot_namespace": "a b"}, "not a valid namespace name"),
        ("messages", {"redknot_seg_bounds": [0, 1]}, "reserved for redknot"),
        ("messages", {"redknot_capture": "no"}, "redknot_capture must be true or false"),
        ("off", {"redknot_namespace": "default"}, "--redknot-chat-segments"),
    ],
)
def test_bad_chat_requests_are_value_errors(chat, mode, custom, message):
    serving, _ = chat(mode)
    with pytest.raises(ValueError, match=message):
        serving._convert_to_internal_request(_request(MESSAGES, custom_params=custom))


def test_template_that_rewrites_content_falls_back(chat, smollm_tokenizer):
    serving, _ = chat("messages")
    padded = [{"role": "user", "content": "  " + DOC + "  "}]
    tok = serving.tokenizer_manager.tokenizer
    trimming = tok.chat_template.replace("message['content']", "message['content'] | trim")
    assert trimming != tok.chat_template
    original, tok.chat_template = tok.chat_template, trimming
    try:
        obj, _ = serving._convert_to_internal_request(_request(padded))
        assert obj.input_ids == _plain_ids(tok, padded)
        assert not (obj.sampling_params.get("custom_params") or {})
    finally:
        tok.chat_template = original


def test_chat_route_answers_400(chat, client):
    serving, _ = chat("messages", namespaces="kb")  # a fixed set: "x" stays unknown
    client.app.state.openai_serving_chat = serving
    body = {"model": "m", "messages": MESSAGES, "custom_params": {"redknot_namespace": "x"}}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400
    assert "'x' is unknown" in r.json()["message"]


@pytest.mark.parametrize(
    "value, parsed",
    [
        ("off", ChatSegments(False)),
        ("messages", ChatSegments(True)),
        ("min-tokens:32", ChatSegments(True, 32)),
    ],
)
def test_chat_option_values(value, parsed):
    assert ChatSegments.parse(value) == parsed


@pytest.mark.parametrize("value", ["on", "min-tokens:0", "min-tokens:x", ""])
def test_bad_chat_option_values(value):
    with pytest.raises(ValueError, match="is not one of off, messages, min-tokens:N"):
        ChatSegments.parse(value)
