"""benchmarks/auto_chunk_coverage.py's stream replay (the server's chunking, with and without
``cdc-edges``)."""

from __future__ import annotations

from benchmarks.auto_chunk_coverage import stream_coverage


def test_learned_edges_serve_more_of_a_reordered_stream():
    args = ((300, 600), 64, 12, 4, 60, 20)
    plain = stream_coverage(*args, edges=False)
    learned = stream_coverage(*args, edges=True)
    assert 0.3 < plain < learned <= 1.0
