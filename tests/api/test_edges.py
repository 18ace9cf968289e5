"""Documents' edges learned from missed chunks (``redknot.api.edges``), against the tokens
written out."""

from __future__ import annotations

import numpy as np

from redknot.api.chunking import rolling_hash
from redknot.api.edges import KEPT_PER_KEY, EdgeIndex, common_suffix


def test_common_suffix_counts_equal_tokens_from_the_end():
    a = np.asarray
    assert common_suffix(a([1, 2, 3, 4]), a([9, 3, 4])) == 2
    assert common_suffix(a([1, 2]), a([3])) == 0
    assert common_suffix(a([5, 6]), a([5, 6])) == 2
    assert common_suffix(a([7, 5, 6]), a([5, 6])) == 2


def _split(index: EdgeIndex, ids, start: int, end: int, min_tokens: int) -> list[tuple[int, int]]:
    """The pieces' ranges."""
    return [(a, b) for a, b, _ in index.pieces(ids, start, end, min_tokens)]


def _run(start: int, n: int) -> tuple[int, ...]:
    return tuple(range(start, start + n))


def test_a_head_is_learned_from_two_contexts_and_cut_out_of_a_third():
    """Chunks [tail of X | head of B] with different X: the second miss teaches B's head (their
    longest common suffix); a third such chunk is cut so that the head is a piece of its own."""
    head_b = _run(1000, 100)
    index = EdgeIndex()
    assert index.learn(_run(10, 50) + head_b, 64) == []  # first sight: nothing to compare
    assert index.learn(_run(20, 50) + head_b, 64) == [list(head_b)]
    assert index.learn(_run(30, 50) + head_b, 64) == []  # known already
    ids = _run(30, 50) + head_b
    assert _split(index, ids, 0, len(ids), 16) == [(0, 50), (50, 150)]
    assert _split(index, ids, 0, len(ids), 64) == [(50, 150)]  # the short rest is dropped


def test_a_tail_is_learned_from_chunks_that_start_alike():
    tail_a = _run(5000, 70)
    index = EdgeIndex()
    index.learn(tail_a + _run(7100, 40), 64)
    assert index.learn(tail_a + _run(7200, 40), 64) == [list(tail_a)]
    ids = (9, 9) + tail_a + _run(7300, 40)  # the chunk starts at offset 2 of the prompt
    assert _split(index, ids, 2, len(ids), 16) == [(2, 72), (72, 112)]


def test_both_edges_and_overlap_and_nothing_below_the_minimum():
    index = EdgeIndex()
    head_b, tail_a = _run(1000, 100), _run(5000, 70)
    for k in (1, 2):
        index.learn(_run(100 * k, 50) + head_b, 64)
        index.learn(tail_a + _run(3000 + 100 * k, 40), 64)
    both = tail_a + _run(8000, 30) + head_b
    assert _split(index, both, 0, len(both), 16) == [(0, 70), (70, 100), (100, 200)]
    # a chunk that starts with only part of the learned tail: the head alone is cut out
    short = tail_a[:60] + head_b
    assert _split(index, short, 0, len(short), 16) == [(0, 60), (60, 160)]
    # common runs shorter than the minimum are not edges
    index2 = EdgeIndex()
    for k in (1, 2, 3):
        assert index2.learn(_run(100 * k, 80) + _run(1000, 30), 64) == []


def test_memory_is_bounded_per_key():
    index = EdgeIndex()
    head = _run(1000, 40)
    for k in range(3 * KEPT_PER_KEY):
        index.learn(_run(10_000 + 100 * k, 50) + head, 64)  # common suffix 40 < 64: no edge
    assert all(len(seen) <= KEPT_PER_KEY for seen in index.heads.seen.values())


def test_boundaries_shorter_than_a_segment_are_learned_but_not_returned():
    """``cdc-docs``: an edge from the hash window up bounds documents, found by content
    wherever it lies; only edges from the shortest segment up are returned (stored)."""
    from redknot.api.chunking import WINDOW

    head_b = _run(1000, WINDOW + 8)  # longer than the window, shorter than a segment (64)
    index = EdgeIndex()
    index.learn(_run(10, 50) + head_b, 64, boundary_tokens=WINDOW)
    assert index.learn(_run(20, 50) + head_b, 64, boundary_tokens=WINDOW) == []
    ids = _run(30, 50) + head_b + _run(9000, 20)  # B's head inside, not at a chunk's end
    assert index.boundaries(ids) == ([50], [])
    assert _split(index, ids, 0, len(ids), 64) == [(0, len(ids))]  # no piece under a segment
    plain = EdgeIndex()  # without boundaries (cdc-edges) nothing under the minimum is learned
    plain.learn(_run(10, 50) + head_b, 64)
    plain.learn(_run(20, 50) + head_b, 64)
    assert plain.boundaries(ids) == ([], [])


def test_tails_are_found_by_their_last_window():
    tail_a = _run(5000, 70)
    index = EdgeIndex()
    index.learn(tail_a + _run(7100, 40), 64)
    index.learn(tail_a + _run(7200, 40), 64)
    ids = _run(1, 10) + tail_a + _run(7300, 40)
    assert index.boundaries(ids) == ([], [10 + 70])
    array = np.asarray(ids, dtype=np.int32)  # as the automatic segments call it
    assert index.boundaries(array, rolling_hash(array)) == ([], [10 + 70])


def test_what_a_capture_is_computed_after():
    """``--redknot-auto-capture-context K``: a chunk's capture follows the K tokens before it;
    a learned head (the end of a missed chunk) follows the chunk's tokens before it, a tail
    (its start) what the chunk followed; a document what preceded it at its last sighting."""
    from types import SimpleNamespace

    from redknot.api.auto import AutoSegments
    from redknot.api.options import AutoSegmentsOption

    auto = AutoSegments(AutoSegmentsOption.parse("cdc-docs", 64, capture_context=8))
    ids = list(range(100, 140))
    marks = [SimpleNamespace(start=3), SimpleNamespace(start=20)]
    assert auto.contexts(ids, marks) == [ids[:3], ids[12:20]]
    chunk, context = list(range(50)), list(range(900, 908))
    assert auto.edge_context(chunk, context, chunk[30:]) == chunk[22:30]
    assert auto.edge_context(chunk, context, chunk[:20]) == context
    assert auto.edge_context(chunk, context, chunk) == context
    doc = list(range(300, 340))
    auto._document_sighted(doc, [], 0, list(range(7)))
    assert auto.document_context(doc) == list(range(7))
    assert auto.document_context(list(range(5))) == []
    alone = AutoSegments(AutoSegmentsOption.parse("cdc-docs", 64, capture_context=0))
    assert alone.contexts(ids, marks) == [[], []]
    assert alone.edge_context(chunk, [], chunk[30:]) == []


def test_boundaries_equal_a_scan_of_every_window():
    """Many learned edges and a long prompt holding some of them: the starts and ends found
    through the hashes' low bits equal a scan comparing every window's tokens."""
    from redknot.api.chunking import WINDOW

    rng = np.random.default_rng(5)
    index = EdgeIndex()
    heads = [tuple(rng.integers(1000, 40000, 80).tolist()) for _ in range(40)]
    tails = [tuple(rng.integers(1000, 40000, 80).tolist()) for _ in range(40)]
    for k, (head, tail) in enumerate(zip(heads, tails, strict=True)):
        for ctx in (_run(50_000 + 100 * k, 30), _run(60_000 + 100 * k, 30)):
            index.learn(ctx + head, 64)
            index.learn(tail + ctx, 64)
    parts = [tuple(rng.integers(1000, 40000, 20_000).tolist())]
    for k in range(0, 40, 3):
        parts += [heads[k], tuple(rng.integers(1000, 40000, 300).tolist()), tails[k]]
    ids = np.asarray(sum(parts, ()), dtype=np.int32)

    def scan(table):
        known = set().union(*table.values())
        return [e for e in range(WINDOW, len(ids) + 1) if ids[e - WINDOW : e].tobytes() in known]

    starts, ends = index.boundaries(ids.tolist())
    assert starts == [e - WINDOW for e in scan(index.starts)] and len(starts) >= 14
    assert ends == scan(index.ends) and len(ends) >= 14
