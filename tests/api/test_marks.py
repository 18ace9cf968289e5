"""Segment marks: encoding, transport through SGLang's IPC to a scheduler Req, validation."""

from __future__ import annotations

from array import array

import pytest

from redknot.api import markers
from redknot.api.marks import (
    KEY_BOUNDS,
    SegmentMark,
    SegmentMarkError,
    decode_marks,
    encode_marks,
    registration_of,
    segment_id,
    segments_of,
)

IDS = list(range(100, 140))


def _mark(start, end, ns="default", ids=IDS):
    return SegmentMark(start, end, ns, segment_id(ns, ids[start:end]))


def _req(custom, ids=IDS):
    """A scheduler Req built from a tokenized request that went through SGLang's msgpack IPC."""
    from sglang.srt.managers.io_struct import (
        TokenizedGenerateReqInput,
        msgpack_decode,
        msgpack_encode,
    )
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    sent = TokenizedGenerateReqInput(
        rid="r",
        input_text=None,
        input_ids=array("q", ids),
        input_embeds=None,
        mm_inputs=None,
        token_type_ids=None,
        sampling_params=SamplingParams(max_new_tokens=0, custom_params=custom),
        return_logprob=False,
        logprob_start_len=-1,
        top_logprobs_num=0,
        token_ids_logprob=None,
        stream=False,
    )
    got = msgpack_decode(msgpack_encode(sent))
    return Req(got.rid, "", got.input_ids, got.sampling_params)


def test_marks_reach_a_scheduler_req():
    marks = [_mark(0, 5, "kb"), _mark(10, 30)]
    req = _req({"user": 3, **encode_marks(marks)})
    assert segments_of(req) == marks
    assert registration_of(req) is None
    assert req.sampling_params.custom_params["user"] == 3


def test_request_without_marks():
    assert segments_of(_req(None)) == []
    assert segments_of(_req({"x": 1})) == []


def test_registration_roundtrip():
    mark = _mark(0, len(IDS), "kb")
    reg = registration_of(_req(encode_marks([mark], register=True, pin=True)))
    assert reg is not None and reg.pin and reg.marks == (mark,)


def test_segment_id_is_the_store_s():
    from redknot.segcache.entry import segment_id as store_id

    assert segment_id("kb", IDS[:4]) == store_id("kb", IDS[:4])
    assert segment_id("kb", IDS[:4]) != segment_id("default", IDS[:4])


@pytest.mark.parametrize(
    "custom, message",
    [
        ({KEY_BOUNDS: [0, 5], "redknot_seg_namespaces": ["a"]}, "must be lists"),
        (
            {KEY_BOUNDS: [0, 5, 7], "redknot_seg_namespaces": ["a"], "redknot_seg_ids": ["x"]},
            "2 bounds per segment",
        ),
        (encode_marks([_mark(0, 5)]) | {"redknot_seg_ids": ["0" * 32]}, "is not the id"),
        (encode_marks([_mark(30, 40)]) | {KEY_BOUNDS: [30, 45]}, "ends after the prompt"),
        (encode_marks([_mark(0, 5), _mark(3, 9)]), "overlap"),
        (encode_marks([_mark(0, 5)]) | {KEY_BOUNDS: [5, 5]}, "non-empty token range"),
    ],
)
def test_scheduler_side_validation(custom, message):
    with pytest.raises(SegmentMarkError, match=message):
        decode_marks(custom, IDS)


def test_registration_must_cover_the_prompt():
    with pytest.raises(SegmentMarkError, match="exactly one segment"):
        registration_of(_req(encode_marks([_mark(0, 5)]) | {"redknot_register": True}))
    n = len(IDS)
    with pytest.raises(SegmentMarkError, match="exactly one segment"):  # a client's: from 0
        registration_of(_req(encode_marks([_mark(4, n)], register=True)))


def test_a_capture_may_follow_its_context():
    """A capture's prompt is its context then its segment, which must end the prompt."""
    n = len(IDS)
    reg = registration_of(_req(encode_marks([_mark(4, n)], register=True, capture=True)))
    assert reg is not None and reg.capture and not reg.pin and reg.marks[0].start == 4
    two = [_mark(2, 9), _mark(9, n)]  # consecutive segments after a context of 2
    assert registration_of(_req(encode_marks(two, register=True, capture=True))).marks == tuple(two)
    for bad in ([_mark(4, n - 1)], [_mark(2, 8), _mark(9, n)]):  # not ending it; a gap
        with pytest.raises(SegmentMarkError, match="consecutive segments ending it"):
            registration_of(_req(encode_marks(bad, register=True, capture=True)))
    with pytest.raises(SegmentMarkError, match="exactly one segment"):  # a client's: one
        encode_marks(two, register=True)
    with pytest.raises(SegmentMarkError, match="exactly one segment"):
        registration_of(_req(encode_marks(two) | {"redknot_register": True}))


def test_markers_roundtrip_and_strip():
    text = "a " + markers.segment("doc one", "kb") + " b " + markers.segment("doc two") + "!"
    clean, spans = markers.parse_markers(text)
    assert clean == "a doc one b doc two!" == markers.strip_markers(text)
    assert [(clean[s.start : s.end], s.namespace) for s in spans] == [
        ("doc one", "kb"),
        ("doc two", "default"),
    ]


@pytest.mark.parametrize(
    "args, message",
    [
        (("",), "non-empty"),
        ((markers.segment("x"),), "cannot nest"),
        (("x", "bad ns"), "namespace"),
    ],
)
def test_segment_expression_rejects_bad_input(args, message):
    with pytest.raises(ValueError, match=message):
        markers.segment(*args)
