"""Content-defined chunks of token ids (``redknot.api.chunking``) against a brute-force reference
that follows the module docstring's definitions with plain Python integers."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from redknot.api.chunking import SEED, WINDOW, Chunker, rolling_hash

M64, M32 = (1 << 64) - 1, (1 << 32) - 1


def ref_mix(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def ref_gear(t: int) -> int:
    return ref_mix((t + SEED + 0x9E3779B97F4A7C15) & M64) >> 32


def ref_cuts(ids: list[int], chunker: Chunker) -> list[int]:
    """Token by token: hash the last WINDOW tokens, mix, cut at a candidate past the minimum or
    at the maximum."""
    cuts, start = [], 0
    for i in range(len(ids)):
        h = sum(ref_gear(ids[i - k]) << k for k in range(WINDOW) if i - k >= 0) & M32
        n = i + 1 - start
        if n >= chunker.max_tokens or (
            n >= chunker.min_tokens and ref_mix(h) >> (64 - chunker.bits) == 0
        ):
            cuts.append(i + 1)
            start = i + 1
    if start < len(ids):
        cuts.append(len(ids))
    return cuts


def tokens(n: int, seed: int, vocab: int = 50_000) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()


# A known input and its cuts, as the reference computes them (pinned: a change of the hash or
# of the cut rule changes every stored chunk's address).
KNOWN_IDS = [(7 * i * i + 3 * i) % 1000 for i in range(300)]
KNOWN_CUTS = [
    7,
    13,
    19,
    47,
    61,
    65,
    99,
    127,
    134,
    166,
    180,
    188,
    198,
    225,
    229,
    234,
    239,
    252,
    278,
    300,
]


def test_known_input_cuts_equal_the_reference_and_the_pinned_values():
    chunker = Chunker(4, 16, 48)
    assert ref_cuts(KNOWN_IDS, chunker) == KNOWN_CUTS
    assert chunker.cuts(KNOWN_IDS) == KNOWN_CUTS


def test_rolling_hash_is_its_definition_at_every_short_length():
    """Lengths below, at and just above each doubling step of the hash (1 .. 2 * WINDOW + 1)."""
    for n in range(2 * WINDOW + 2):
        ids = tokens(n, n)
        want = [
            sum(ref_gear(ids[i - k]) << k for k in range(WINDOW) if i - k >= 0) & M32
            for i in range(n)
        ]
        assert rolling_hash(ids).tolist() == want, n


@pytest.mark.parametrize("avg", [16, 64, 256])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cuts_equal_the_reference(avg, seed):
    chunker = Chunker.of_average(avg)
    ids = tokens(6 * avg + seed * 37, seed)
    assert chunker.cuts(ids) == ref_cuts(ids, chunker)
    # as the automatic segments call it: an int32 array and its rolling hash given
    array = np.asarray(ids, dtype=np.int32)
    assert chunker.cuts(array, rolling_hash(array)) == ref_cuts(ids, chunker)


@pytest.mark.parametrize(
    "ids",
    [
        tokens(3000, 3),
        [42] * 3000,  # one token repeated: every position a candidate, or none
        [7] * 3000,
        list(range(3000)),
        tokens(40, 4),  # shorter than one chunk
        [],
    ],
    ids=["random", "repeat42", "repeat7", "ramp", "short", "empty"],
)
def test_chunk_lengths_respect_min_and_max(ids):
    chunker = Chunker.of_average(64)
    spans = chunker.spans(ids)
    assert [a for a, _ in spans] == [0, *[b for _, b in spans]][: len(spans)]  # contiguous
    assert (spans[-1][1] if spans else 0) == len(ids)
    assert all(chunker.min_tokens <= b - a <= chunker.max_tokens for a, b in spans[:-1])
    assert all(0 < b - a <= chunker.max_tokens for a, b in spans[-1:])
    assert chunker.cuts(ids) == ref_cuts(ids, chunker)


def test_a_document_yields_the_same_chunks_under_any_prefix():
    chunker = Chunker.of_average(64)
    doc = tokens(2000, 10)
    placed = []
    for prefix in ([], tokens(13, 11), tokens(500, 12), [1] * 77):
        cuts = [c - len(prefix) for c in chunker.cuts(prefix + doc) if c > len(prefix)]
        placed.append(cuts)
    first_shared = max(min(set(cuts) & set(placed[0])) for cuts in placed)
    assert first_shared <= 2 * chunker.max_tokens  # in sync within the document's first chunks
    tails = [[c for c in cuts if c >= first_shared] for cuts in placed]
    assert all(tail == tails[0] for tail in tails) and len(tails[0]) > 10


def test_a_one_token_edit_changes_only_the_chunks_around_it():
    chunker = Chunker.of_average(64)
    doc = tokens(3000, 20)
    for at in (700, 1500, 2200):
        edited = doc[:at] + [doc[at] + 1] + doc[at + 1 :]
        changed = set(chunker.cuts(doc)) ^ set(chunker.cuts(edited))
        assert all(at <= c <= at + WINDOW + 2 * chunker.max_tokens for c in changed)
        old = {tuple(doc[a:b]) for a, b in chunker.spans(doc)}
        new = [tuple(edited[a:b]) for a, b in chunker.spans(edited)]
        assert len(new) - 3 <= sum(chunk in old for chunk in new) < len(new)


def test_cuts_are_the_same_in_another_process():
    code = (
        "from redknot.api.chunking import Chunker; from tests.api.test_chunking import tokens; "
        "print(Chunker.of_average(32).cuts(tokens(2000, 5)))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    assert out.stdout.strip() == str(Chunker.of_average(32).cuts(tokens(2000, 5)))


@pytest.mark.parametrize("sizes", [(0, 4, 8), (4, 4, 8), (4, 16, 8)])
def test_bad_chunk_sizes_are_refused(sizes):
    with pytest.raises(ValueError, match="1 <= min < avg <= max"):
        Chunker(*sizes)
