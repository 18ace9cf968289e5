from __future__ import annotations

import random

import pytest

from redknot.profiler.calibration import HFTextEncoder, needle_prompt, segment_case

from .conftest import ByteEncoder, word_tokenizer


def test_needle_prompt_is_deterministic_and_well_formed():
    enc = ByteEncoder()
    a = needle_prompt(random.Random(7), enc, 1500, depth=0.3)
    b = needle_prompt(random.Random(7), enc, 1500, depth=0.3)
    c = needle_prompt(random.Random(8), enc, 1500, depth=0.3)
    assert a == b and a.ids != c.ids
    assert 1400 < len(a) <= 1500
    start, end = a.needle
    fact = enc.decode(a.ids[start:end])
    assert a.answer in fact and ("secret number" in fact or "hidden in" in fact)
    assert abs(start / len(a) - 0.3) < 0.05
    tail = enc.decode(a.ids[a.question_start :])
    assert tail.startswith("\n\n") and "?" in tail and a.answer not in tail


def test_needle_prompt_needs_room():
    with pytest.raises(ValueError, match="needs more than"):
        needle_prompt(random.Random(0), ByteEncoder(), 40)


def test_segment_case_lengths():
    case = segment_case(random.Random(3), ByteEncoder(), 400, (100, 300))
    longest_sentence = 100  # bytes of one record line: the fill stops less than that short
    assert 400 - longest_sentence < len(case.segment) <= 400
    for prefix, n in zip(case.prefixes, (100, 300)):
        assert n - longest_sentence < len(prefix) <= n
    assert ByteEncoder().decode(case.segment).lstrip().startswith("Record ")
    assert case == segment_case(random.Random(3), ByteEncoder(), 400, (100, 300))


def test_hf_encoder_wraps_prompts_in_the_chat_template():
    tok = word_tokenizer()
    enc = HFTextEncoder(tok)
    head, tail = enc.prompt_parts()
    assert tok.convert_ids_to_tokens(head) == ["<user>"]
    assert tok.convert_ids_to_tokens(tail) == ["<assistant>"]
    prompt = needle_prompt(random.Random(1), enc, 300)
    assert prompt.ids[0] == head[0] and tail[0] in prompt.ids[prompt.question_start :]
    assert (
        tok.convert_ids_to_tokens(list(prompt.ids[prompt.needle[0] : prompt.needle[1]]))[0] == "The"
    )
    plain = HFTextEncoder(tok, chat=False)
    assert plain.prompt_parts() == ([tok.bos_token_id], [])
