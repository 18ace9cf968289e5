"""/generate with segment markup, through SGLang's real app and /generate route."""

from __future__ import annotations

import pytest

from redknot.api import segment
from redknot.api.marks import decode_marks, segment_id

DOC = "Paris is the capital of France."
Q = " Question: what is the capital of France?"


def _custom(obj):
    return (obj.sampling_params or {}).get("custom_params") or {}


def test_text_spans_become_input_ids_and_marks(make_api, client, bpe_tokenizer):
    api = make_api(bpe_tokenizer)
    text = "Context: " + DOC + Q
    start = text.index(DOC)
    body = {
        "text": text,
        "sampling_params": {"max_new_tokens": 4, "temperature": 0},
        "redknot_segments": [{"start": start, "end": start + len(DOC), "namespace": "default"}],
    }
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    obj = api.tokenizer_manager.last
    assert obj.text is None
    seg = bpe_tokenizer.encode(DOC, add_special_tokens=False)
    (mark,) = decode_marks(_custom(obj), obj.input_ids)
    assert obj.input_ids[mark.start : mark.end] == seg
    assert obj.input_ids[0] == bpe_tokenizer.bos_token_id
    assert mark.segment_id == segment_id("default", seg)
    assert obj.sampling_params["max_new_tokens"] == 4


def test_token_spans_over_input_ids(make_api, client, bpe_tokenizer):
    api = make_api(bpe_tokenizer)
    ids = list(range(1, 41))
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": 1, "custom_params": {"mine": 1}},
        "redknot_segments": [{"start": 20, "end": 30}, {"start": 2, "end": 10}],
    }
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    obj = api.tokenizer_manager.last
    assert obj.input_ids == ids
    custom = _custom(obj)
    assert custom["mine"] == 1
    marks = decode_marks(custom, ids)
    assert [(m.start, m.end, m.namespace) for m in marks] == [
        (2, 10, "default"),
        (20, 30, "default"),
    ]


def test_batch_of_texts(make_api, client, bpe_tokenizer):
    api = make_api(bpe_tokenizer)
    body = {
        "text": [DOC + Q, "no segments here"],
        "sampling_params": {"max_new_tokens": 1},
        "redknot_segments": [[{"start": 0, "end": len(DOC)}], None],
    }
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    obj = api.tokenizer_manager.last
    assert obj.text is None and len(obj.input_ids) == 2
    assert isinstance(obj.sampling_params, list)
    (mark,) = decode_marks(_custom_at(obj, 0), obj.input_ids[0])
    assert mark.start == 1  # after the BOS
    assert decode_marks(_custom_at(obj, 1)) == []
    assert obj.input_ids[1] == bpe_tokenizer.encode("no segments here")


def _custom_at(obj, i):
    return obj.sampling_params[i].get("custom_params") or {}


def test_in_band_markers(make_api, client, bpe_tokenizer):
    api = make_api(bpe_tokenizer, namespaces="kb")
    text = "Context: " + segment(DOC, namespace="kb") + Q
    r = client.post("/generate", json={"text": text, "sampling_params": {"max_new_tokens": 1}})
    assert r.status_code == 200, r.text
    obj = api.tokenizer_manager.last
    (mark,) = decode_marks(_custom(obj), obj.input_ids)
    assert mark.namespace == "kb"
    assert obj.input_ids[mark.start : mark.end] == bpe_tokenizer.encode(
        DOC, add_special_tokens=False
    )
    assert bpe_tokenizer.decode(obj.input_ids, skip_special_tokens=True) == "Context: " + DOC + Q


def test_plain_requests_pass_untouched(make_api, client, bpe_tokenizer):
    api = make_api(bpe_tokenizer)
    r = client.post("/generate", json={"text": "hello", "sampling_params": {"max_new_tokens": 1}})
    assert r.status_code == 200
    obj = api.tokenizer_manager.last
    assert obj.text == "hello" and obj.input_ids is None
    assert api.counters.requests_with_segments == 0


def test_streaming_request_with_segments(make_api, client, bpe_tokenizer):
    api = make_api(bpe_tokenizer)
    body = {"input_ids": [5, 6, 7, 8], "stream": True, "redknot_segments": [{"start": 0, "end": 2}]}
    with client.stream("POST", "/generate", json=body) as r:
        assert r.status_code == 200
        assert "data: [DONE]" in "".join(r.iter_text())
    assert decode_marks(_custom(api.tokenizer_manager.last))[0].end == 2


TEXT = DOC + Q  # 72 characters


@pytest.mark.parametrize(
    "spans, message",
    [
        ([{"start": 0, "end": 10}, {"start": 5, "end": 20}], "overlap"),
        ([{"start": 0, "end": 500}], "out of range: the prompt has 72 characters"),
        ([{"start": -3, "end": 5}], "negative offset"),
        ([{"start": 4, "end": 4}], "is empty"),
        ([{"start": "0", "end": 5}], r"redknot_segments\[0\].start must be an integer"),
        ([{"start": 0.5, "end": 5}], "must be an integer"),
        ({"start": 0, "end": 5}, "must be a list"),
        ([[0, 5]], "must be an object"),
        ([{"start": 0}], "needs 'start' and 'end'"),
        ([{"start": 0, "end": 5, "ns": "kb"}], "needs 'start' and 'end'"),
        ([{"start": 0, "end": 5, "namespace": 7}], "not a valid namespace name"),
        ([{"start": 0, "end": 5, "namespace": "a b"}], "not a valid namespace name"),
    ],
)
def test_bad_spans_are_400_with_a_message(make_api, client, bpe_tokenizer, spans, message):
    make_api(bpe_tokenizer)
    r = client.post("/generate", json={"text": TEXT, "redknot_segments": spans})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert __import__("re").search(message, err["message"]), err["message"]
    # the server keeps serving
    ok = client.post("/generate", json={"text": TEXT, "redknot_segments": [{"start": 0, "end": 5}]})
    assert ok.status_code == 200


def test_segment_longer_than_the_context(make_api, client, bpe_tokenizer):
    make_api(bpe_tokenizer, context_len=16)
    r = client.post(
        "/generate",
        json={"input_ids": list(range(40)), "redknot_segments": [{"start": 0, "end": 20}]},
    )
    assert r.status_code == 400
    assert "more than the model's context (16 tokens): split it" in r.json()["error"]["message"]


@pytest.mark.parametrize(
    "body, message",
    [
        ({"text": "x" + "\U000f0001default\U000f0002abc", "sampling_params": {}}, "unbalanced"),
        ({"text": "a\U000f0003b"}, "end marker"),
        (
            {"text": "\U000f0001default\U000f0002a\U000f0001default\U000f0002b\U000f0003c"},
            "nested",
        ),
        ({"text": segment("abc"), "redknot_segments": [{"start": 0, "end": 1}]}, "use one"),
        (
            {"text": "abc", "sampling_params": {"custom_params": {"redknot_seg_bounds": [0, 1]}}},
            "reserved for redknot",
        ),
        ({"input_ids": [1, -2, 3], "redknot_segments": []}, "non-negative integers"),
        ({"text": "abc", "input_ids": [1], "redknot_segments": []}, "exactly one of"),
        ({"text": ["a", "b"], "redknot_segments": [[]]}, "one list of spans"),
        ({"text": "abc", "image_data": "x.png", "redknot_segments": []}, "image_data"),
    ],
)
def test_bad_markup_is_400(make_api, client, bpe_tokenizer, body, message):
    make_api(bpe_tokenizer)
    r = client.post("/generate", json=body)
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"]


def test_segments_over_text_need_a_tokenizer(make_api, client):
    make_api(None)
    r = client.post("/generate", json={"text": segment("abc")})
    assert r.status_code == 400
    assert "--skip-tokenizer-init" in r.json()["error"]["message"]


def test_malformed_json_is_left_to_sglang(make_api, client, bpe_tokenizer):
    make_api(bpe_tokenizer)
    r = client.post(
        "/generate",
        content=b'{"text": "a", "redknot_segments": [',
        headers={"content-type": "application/json"},
    )
    assert r.status_code in (400, 422)


@pytest.mark.parametrize(
    "path, body, message",
    [
        (
            "/v1/completions",
            {"model": "m", "prompt": "hi", "custom_params": {"redknot_pin": 1}},
            "reserved for redknot",
        ),
        (
            "/v1/chat/completions",
            {"model": "m", "messages": [], "custom_params": {"redknot_seg_ids": ["x"]}},
            "reserved for redknot",
        ),
        ("/v1/completions", {"model": "m", "prompt": segment("doc")}, "only by /generate"),
    ],
)
def test_other_endpoints_refuse_reserved_keys_and_markers(
    make_api, client, bpe_tokenizer, path, body, message
):
    make_api(bpe_tokenizer)
    r = client.post(path, json=body)
    assert r.status_code == 400
    assert message in r.json()["error"]["message"]


def test_input_logprobs_over_tokens_that_leave_recovery_are_refused(
    make_api, client, bpe_tokenizer
):
    """Under an option that leaves reused tokens to the cache, their rows are not computed:
    input-token logprobs over them are a 400; output logprobs and logprobs after the last
    segment are served."""
    api = make_api(bpe_tokenizer)
    ids = list(range(1, 41))
    spans = [{"start": 2, "end": 10}, {"start": 20, "end": 30}]

    def post(**extra):
        body = {"input_ids": ids, "redknot_segments": spans, **extra}
        return client.post("/generate", json=body)

    assert post(return_logprob=True, logprob_start_len=0).status_code == 200  # nothing leaves
    api.rows_leave = "--redknot-policy cacheblend"
    r = post(return_logprob=True, logprob_start_len=25)
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert "set logprob_start_len to 30 or more" in message and "cacheblend" in message
    for ok in (
        {"return_logprob": True, "logprob_start_len": 30},  # after the last segment
        {"return_logprob": True},  # output logprobs only (SGLang's default start)
        {"return_logprob": False, "logprob_start_len": 0},  # start ignored without logprobs
    ):
        assert post(**ok).status_code == 200, ok
    # a prompt ending inside a segment: its last row is always computed
    r = client.post("/generate", json={"input_ids": ids, "return_logprob": True,
                                       "logprob_start_len": 39,
                                       "redknot_segments": [{"start": 30, "end": 40}]})  # fmt: skip
    assert r.status_code == 200, r.text


def test_the_options_under_which_rows_leave_recovery():
    from redknot.config import RedknotConfig

    assert RedknotConfig(all_global=True).rows_leave is None
    assert RedknotConfig(all_global=True, dense_layers=8, skipped="residual").rows_leave is None
    assert "dense-layers 8" in RedknotConfig(all_global=True, dense_layers=8).rows_leave
    assert RedknotConfig(policy="naive").rows_leave == "--redknot-policy naive"
