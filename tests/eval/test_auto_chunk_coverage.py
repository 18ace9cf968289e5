"""benchmarks/auto_chunk_coverage.py's stream replay and its document-edge learning."""

from __future__ import annotations

from benchmarks.auto_chunk_coverage import EdgeStore, common_suffix, stream_coverage


def test_common_suffix_counts_equal_tokens_from_the_end():
    assert common_suffix((1, 2, 3, 4), (9, 3, 4)) == 2
    assert common_suffix((1, 2), (3,)) == 0
    assert common_suffix((5, 6), (5, 6)) == 2


def test_edges_are_learned_from_two_contexts_and_served_to_a_third():
    """Chunks [tail of X | head of B] with three different X: the second teaches B's head (their
    longest common suffix), the third is served it; tails likewise from [tail of A | Y]."""
    head_b = tuple(range(1000, 1100))  # 100 tokens
    store = EdgeStore(window=8, min_tokens=64)
    tails = [tuple(range(k * 10, k * 10 + 50)) for k in (1, 2, 3)]  # distinct 50-token tails
    assert store.serve(tails[0] + head_b) == 0  # first sight: nothing known
    assert store.serve(tails[1] + head_b) == 0  # learns head_b now, serves it from the next
    assert store.serve(tails[2] + head_b) == len(head_b)
    tail_a = tuple(range(5000, 5070))  # 70 tokens
    heads = [tuple(range(k * 100 + 7000, k * 100 + 7030)) for k in (1, 2, 3)]
    store.serve(tail_a + heads[0])
    store.serve(tail_a + heads[1])
    assert store.serve(tail_a + heads[2]) == len(tail_a)
    # both edges known: a chunk made of them is served whole, never more than its length
    assert store.serve(tail_a + head_b) == len(tail_a) + len(head_b)


def test_an_edge_shorter_than_the_minimum_is_not_learned():
    store = EdgeStore(window=8, min_tokens=64)
    short = tuple(range(1000, 1030))  # 30 tokens
    for k in (1, 2, 3):
        assert store.serve(tuple(range(k * 100, k * 100 + 80)) + short) == 0


def test_learned_edges_serve_more_of_a_reordered_stream():
    args = ((300, 600), 64, 12, 4, 60, 20)
    plain = stream_coverage(*args, edges=False)
    learned = stream_coverage(*args, edges=True)
    assert 0.3 < plain < learned <= 1.0
