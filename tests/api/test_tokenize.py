"""Piecewise tokenisation: a segment's tokens inside a prompt are its standalone tokens."""

from __future__ import annotations

import pytest

from redknot.api.spans import Span
from redknot.api.tokenize import PiecewiseTokenizer

# Segment edges that whole-text tokenisation would merge across (no space at the edges,
# words cut in the middle, digits, non-ASCII).
CASES = [
    ("The capital of France is Paris.", "capital of Fra"),
    ("x=12345+67890;", "45+678"),
    ("Über den Wolken: grenzenlose Freiheit", "den Wolk"),
    ("Segments of text can appear at any position.", "text can"),
]


@pytest.fixture(params=["bpe", "smollm2"])
def tokenizer(request):
    return request.getfixturevalue(
        "bpe_tokenizer" if request.param == "bpe" else "smollm_tokenizer"
    )


@pytest.mark.parametrize("text, seg", CASES)
def test_segment_tokens_equal_standalone_tokens(tokenizer, text, seg):
    pt = PiecewiseTokenizer(tokenizer)
    start = text.index(seg)
    ids, spans = pt.encode(text, [Span(start, start + len(seg))])
    ((a, b),) = spans
    assert ids[a:b] == tokenizer.encode(seg, add_special_tokens=False) == pt.segment_tokens(seg)
    assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_several_segments_and_specials(bpe_tokenizer):
    pt = PiecewiseTokenizer(bpe_tokenizer)
    assert pt.specials() == ([bpe_tokenizer.bos_token_id], [])
    assert pt.specials(False) == ([], [])
    text = "Paris is the capital of France; Berlin is the capital of Germany."
    segs = ["Paris is", "capital of France", "Germany"]
    spans = [Span(text.index(s), text.index(s) + len(s)) for s in segs]
    ids, tspans = pt.encode(text, spans)
    assert ids[0] == bpe_tokenizer.bos_token_id
    for s, (a, b) in zip(segs, tspans, strict=True):
        assert ids[a:b] == pt.segment_tokens(s)
    assert pt.encode(text, []) == (bpe_tokenizer.encode(text), [])


def test_smollm2_adds_no_specials(smollm_tokenizer):
    assert PiecewiseTokenizer(smollm_tokenizer).specials() == ([], [])
