"""The token-level policies and the hybrid at their limits: recomputing everything is dense
prefill, recomputing nothing is naive reuse."""

from __future__ import annotations

import pytest
import torch

from redknot.headmap import HeadMap, synthetic_map

from .conftest import compose, random_ids, serve_policy

ROWS = 118  # the `pieces` prompt: new 10, segment 40, new 6, segment 50, question 12


@pytest.fixture(scope="module")
def naive(runner, prompt):
    return serve_policy(runner, "naive", prompt)[1]


def _same(out, want):
    assert torch.equal(out.generation.first_logits, want.generation.first_logits)
    assert out.generation.tokens == want.generation.tokens


EVERYTHING = [
    ("cacheblend", {"blend_ratio": 1.0}),
    ("cacheblend", {"blend_check_layer": 2, "blend_ratio": 0.0}),  # no layer after the check
    ("epic", {"epic_k": 50}),  # the longest segment
    ("sparsex", {"sparseq_boundary": 3, "sparseq_k": 0, "sparseq_block": 0}),
    ("sparsex", {"sparseq_boundary": 0, "sparseq_k": ROWS, "sparseq_block": 0}),
    ("sparsex", {"sparseq_boundary": 1, "sparseq_k": ROWS}),
]


@pytest.mark.parametrize("name,knobs", EVERYTHING)
def test_recomputing_everything_is_full_prefill(runner, prompt, full, name, knobs):
    _, out = serve_policy(runner, name, prompt, **knobs)
    _same(out, full)
    assert out.fractions == {"attention": 1.0, "ffn": 1.0, "kv_heads": 1.0}
    got, want = out.flops.to_json(), full.flops.to_json()
    for term in ("q_proj", "kv_proj", "o_proj", "attention_global", "ffn", "lm_head"):
        assert got[term] == want[term], term  # the same work, plus the selection's cost


def test_recomputing_nothing_is_naive_reuse(runner, prompt, naive):
    _, epic = serve_policy(runner, "epic", prompt, epic_k=0)
    _same(epic, naive)
    assert epic.flops == naive.flops
    policy, sparsex = serve_policy(
        runner, "sparsex", prompt, sparseq_boundary=0, sparseq_k=0, sparseq_block=0
    )
    _same(sparsex, naive)
    assert policy.selection.key.numel() == 0 and policy.selected.numel() == 0
    got, want = sparsex.flops.to_json(), naive.flops.to_json()
    assert got["probe"] > 0 and want["probe"] == 0  # the selection is paid for
    assert got["total"] - got["probe"] == want["total"]
    assert sparsex.fractions == naive.fractions == {"attention": 0.0, "ffn": 0.0, "kv_heads": 0.0}


def test_cacheblend_checking_layer_0_for_nothing_is_naive_up_to_rounding(runner, prompt, naive):
    """Layer-0 KV depends on token and position only: recomputing it changes nothing but
    rounding, and no token is recomputed above it."""
    policy, out = serve_policy(runner, "cacheblend", prompt, blend_check_layer=0, blend_ratio=0.0)
    assert policy.selected.numel() == 0
    torch.testing.assert_close(
        out.generation.first_logits, naive.generation.first_logits, atol=2e-5, rtol=1e-4
    )
    assert out.generation.tokens == naive.generation.tokens
    assert out.fractions["ffn"] == pytest.approx(1 / 3)  # layer 0 of 3


@pytest.mark.parametrize("name", ["cacheblend", "epic", "sparsex"])
def test_in_between_recomputes_a_part(runner, prompt, full, naive, name):
    knobs = {"blend_ratio": 0.3, "epic_k": 8, "sparseq_boundary": 1, "sparseq_k": 20}
    policy, out = serve_policy(runner, name, prompt, **knobs)
    assert 0.0 < out.fractions["ffn"] < 1.0
    assert out.fractions["ffn"] == out.fractions["attention"] == out.fractions["kv_heads"]
    assert naive.flops.total < out.flops.total < full.flops.total
    assert policy.keep[-1] and policy.keep[:10].all()  # new rows and the last row


def test_epic_recomputes_the_first_tokens_of_each_segment(runner, prompt):
    policy, out = serve_policy(runner, "epic", prompt, epic_k=3)
    assert policy.selected.tolist() == [10, 11, 12, 56, 57, 58]
    assert out.fractions["ffn"] == pytest.approx(6 / 90)


def test_prompt_ending_inside_a_segment_recomputes_its_last_row(runner):
    """The logits row is always computed; sparse-Q falls back to the tail of the segment."""
    pieces = [("new", random_ids(7, 21)), ("seg", random_ids(30, 22))]
    prompt = compose(runner, pieces)
    for name, knobs in [("epic", {"epic_k": 2}), ("cacheblend", {"blend_ratio": 0.0})]:
        policy, _ = serve_policy(runner, name, prompt, **knobs)
        assert bool(policy.keep[-1]), name
    policy, _ = serve_policy(runner, "sparsex", prompt, sparseq_boundary=1, sparseq_k=0)
    assert policy.selection.tail.tolist() == [False] * 7 + [True] * 30  # segment < 64 rows
    assert policy.selection.probed.tolist() == list(range(37))


# ---- redknot+sparseq ----------------------------------------------------------------------


def test_hybrid_limits_with_every_head_global(runner, prompt, full, naive):
    every_global = HeadMap.every_head_global(runner.shape)
    for knobs in (
        {"sparseq_boundary": 0, "sparseq_k": ROWS},
        {"sparseq_boundary": 3, "sparseq_k": 0},
    ):
        _, out = serve_policy(runner, "redknot+sparseq", prompt, every_global, **knobs)
        _same(out, full)
    _, out = serve_policy(
        runner,
        "redknot+sparseq",
        prompt,
        every_global,
        sparseq_boundary=0,
        sparseq_k=0,
        sparseq_block=0,
    )
    _same(out, naive)


def test_hybrid_with_every_head_global_is_sparsex(runner, prompt):
    """The same selection code, the same heads: the same prefill."""
    every_global = HeadMap.every_head_global(runner.shape)
    knobs = {"sparseq_boundary": 1, "sparseq_k": 10, "sparseq_block": 2}
    hybrid, h = serve_policy(runner, "redknot+sparseq", prompt, every_global, **knobs)
    sparsex, s = serve_policy(runner, "sparsex", prompt, **knobs)
    assert torch.equal(hybrid.selection.recompute, sparsex.selection.recompute)
    _same(h, s)
    assert h.flops == s.flops and h.fractions == s.fractions


def test_hybrid_selecting_every_token_is_redknot_without_sparse_ffn(runner, pieces):
    """Sparse-Q selecting everything leaves the head-class part: local heads cached, global
    heads recomputed, dense FFN, as redknot with every layer dense."""
    hm = synthetic_map(runner.shape, 0.5, window=16, sink=2, seed=3)
    prompt = compose(runner, pieces, hm)
    _, hybrid = serve_policy(
        runner,
        "redknot+sparseq",
        prompt,
        hm,
        sparseq_boundary=0,
        sparseq_k=ROWS,
        restore_thresh=None,
    )
    _, redknot = serve_policy(runner, "redknot", prompt, hm, dense_layers=3, restore_thresh=None)
    _same(hybrid, redknot)
    assert hybrid.fractions == redknot.fractions
    assert hybrid.fractions["kv_heads"] == pytest.approx(0.5)


def test_hybrid_freezes_the_unselected_rows_above_the_boundary(runner, pieces):
    hm = synthetic_map(runner.shape, 0.5, window=16, sink=2, seed=3)
    prompt = compose(runner, pieces, hm)
    policy, out = serve_policy(
        runner,
        "redknot+sparseq",
        prompt,
        hm,
        sparseq_boundary=1,
        sparseq_k=12,
        sparseq_block=4,
        restore_thresh=None,
    )
    segment = prompt.is_segment_row()
    want = segment & ~policy.selection.recompute
    assert torch.equal(policy.frozen, want)
    layers = policy.record.layers
    assert layers[0].attention_rows == ROWS and layers[0].ffn_rows == ROWS
    computed = ROWS - int(want.sum())
    assert [r.attention_rows for r in layers[1:]] == [computed, computed]
    assert [r.ffn_rows for r in layers[1:]] == [computed, computed]
    assert layers[0].probe_pairs > 0 and layers[1].probe_pairs == 0
    assert 0.0 < out.fractions["ffn"] < 1.0
