"""The policies at their limits: equal to dense prefill, to naive reuse, to a prefix hit."""

from __future__ import annotations

import torch

from redknot.headmap import HeadMap, synthetic_map
from redknot.recovery import ReusePrompt, Segment, cache_kv, serve
from redknot.reference import LayerContext, ReferenceKV

from .conftest import compose, random_ids, serve_policy


def test_all_global_dense_ffn_fresh_kv_is_full_prefill(runner, pieces):
    prompt = compose(runner, pieces)
    dense = runner.generate(list(prompt.ids), max_new_tokens=6)
    every_global = HeadMap.every_head_global(runner.shape, window=8, sink=2)
    for local_kv in ("fresh", "cached"):  # no local head: the source does not matter
        _, out = serve_policy(
            runner, "redknot", prompt, every_global, dense_layers=3, local_kv=local_kv
        )
        assert torch.equal(out.generation.first_logits, dense.first_logits)
        assert out.generation.tokens == dense.tokens
    _, full = serve_policy(runner, "full", prompt)
    assert torch.equal(full.generation.first_logits, dense.first_logits)
    assert full.generation.tokens == dense.tokens
    assert full.fractions == {"attention": 1.0, "ffn": 1.0, "kv_heads": 1.0}


def test_restoring_every_local_head_is_full_prefill(runner, pieces):
    """restore_thresh 0 promotes every local head that puts any mass on its window edge; with
    a short window that is all of them, and each promoted head is recomputed as global."""
    prompt = compose(runner, pieces)
    dense = runner.generate(list(prompt.ids), max_new_tokens=6)
    local = synthetic_map(runner.shape, 0.0, window=8, sink=2)
    policy, out = serve_policy(
        runner, "redknot", prompt, local, dense_layers=3, restore_thresh=0.0, restore_edge=4
    )
    assert set(policy.restored.values()) == {"GG"}
    assert policy.record.restored_heads(local.classes) == 6
    torch.testing.assert_close(out.generation.first_logits, dense.first_logits)
    assert out.generation.tokens == dense.tokens
    assert out.fractions["kv_heads"] == 1.0
    # decode steps keep the promoted classes
    assert policy.head_classes(1, "LL") == "GG"
    _, none = serve_policy(runner, "redknot", prompt, local, dense_layers=3, restore_thresh=1.0)
    assert none.restored_heads == 0


def test_with_a_prefix_hit_full_and_all_global_agree(runner, pieces):
    """A system prefix served from cache (past KV) gives the dense answer."""
    prompt = compose(runner, pieces)
    prefix = cache_kv(runner, prompt.ids[:10])
    with_hit = ReusePrompt(prompt.ids, prompt.segments, prefix)
    every_global = HeadMap.every_head_global(runner.shape)
    _, out = serve_policy(
        runner, "redknot", with_hit, every_global, dense_layers=3, local_kv="fresh"
    )
    dense = runner.generate(list(prompt.ids), max_new_tokens=6)
    torch.testing.assert_close(out.generation.first_logits, dense.first_logits)
    assert out.generation.tokens == dense.tokens


def test_segments_captured_after_all_that_precedes_them_are_the_prompts_own_kv(runner, pieces):
    """``cache_kv`` with a ``context``: a segment computed after every token before it in the
    prompt (its keys moved back to positions from 0) is what dense prefill computes there, so
    naive reuse of such segments is dense prefill; an empty context is the standalone KV."""
    plain = compose(runner, pieces)
    ids = plain.ids
    assert all(
        torch.equal(a, b)
        for seg in plain.segments
        for a, b in zip(cache_kv(runner, ids[seg.start : seg.end], context=()).keys, seg.cache.keys)
    )
    in_place = ReusePrompt(
        ids,
        tuple(
            Segment(
                seg.start,
                seg.end,
                cache_kv(runner, ids[seg.start : seg.end], None, ids[: seg.start]),
            )
            for seg in plain.segments
        ),
    )
    dense = runner.generate(list(ids), max_new_tokens=6)
    _, out = serve_policy(runner, "naive", in_place)
    torch.testing.assert_close(
        out.generation.first_logits, dense.first_logits, atol=1e-4, rtol=1e-4
    )
    assert out.generation.tokens == dense.tokens
    _, alone = serve_policy(runner, "naive", plain)
    assert not torch.allclose(alone.generation.first_logits, dense.first_logits, atol=1e-3)


def _naive_by_hand(runner, pieces):
    """Chunked prefill: new chunks computed after the KV so far, segments' cached KV moved in."""
    kv, position, out = None, 0, None
    for kind, part in pieces:
        if kind == "seg":
            cached = cache_kv(runner, part).realigned(runner.model.rope, 0, position)
            kv = cached if kv is None else ReferenceKV.concat([kv, cached])
        else:
            out = runner.forward(part, past=kv)
            kv = out.kv
        position += len(part)
    return out.logits[-1]


def test_naive_is_chunked_prefill_around_cached_segments(runner, pieces):
    prompt = compose(runner, pieces)
    _policy, out = serve_policy(runner, "naive", prompt)
    torch.testing.assert_close(
        out.generation.first_logits, _naive_by_hand(runner, pieces), atol=2e-5, rtol=1e-4
    )
    assert out.fractions == {"attention": 0.0, "ffn": 0.0, "kv_heads": 0.0}
    dense = runner.forward(list(prompt.ids)).logits[-1]
    assert (out.generation.first_logits - dense).abs().max() > 1e-3  # reuse is not free


def test_recompute_nothing_is_naive(runner, pieces):
    """The base policy machinery with every head reused and no row recomputed is naive."""
    from redknot.recovery import ElasticRecovery

    class Nothing(ElasticRecovery):
        def reused_heads(self, ctx):
            return [0, 1]

        def choose_attention_rows(self, ctx):
            return self.new_rows(ctx)

        def choose_ffn_rows(self, ctx, probe):
            return self.new_rows(ctx)

    prompt = compose(runner, pieces)
    every_global = HeadMap.every_head_global(runner.shape)
    nothing = Nothing(prompt, shape=runner.shape, head_map=every_global)
    got = serve(runner, nothing, max_new_tokens=6)
    _, naive = serve_policy(runner, "naive", prompt)
    assert torch.equal(got.generation.first_logits, naive.generation.first_logits)
    assert got.flops == naive.flops


def test_segment_at_its_original_position_is_a_prefix_hit(runner):
    segment, question = random_ids(60, 7), random_ids(9, 8)
    hm = synthetic_map(runner.shape, 0.5, window=8, sink=2, seed=1)
    prompt = compose(runner, [("seg", segment), ("new", question)], hm)
    policy, out = serve_policy(runner, "redknot", prompt, hm, dense_layers=1, restore_thresh=0.05)
    assert policy.served.prefix_len == 60 and not policy.served.segments
    hit = runner.generate(
        question, head_map=hm, past=cache_kv(runner, segment, hm), max_new_tokens=6
    )
    assert torch.equal(out.generation.first_logits, hit.first_logits)
    assert out.generation.tokens == hit.tokens
    assert out.fractions == {"attention": 0.0, "ffn": 0.0, "kv_heads": 0.0}


def test_requests_without_segments_are_unchanged(runner):
    ids = random_ids(90, 9)
    hm = synthetic_map(runner.shape, 0.5, window=8, sink=2, seed=2)
    plain = runner.generate(ids, head_map=hm, max_new_tokens=6)
    for name in ("redknot", "naive", "full"):
        _, out = serve_policy(
            runner, name, ReusePrompt(tuple(ids)), hm, dense_layers=0, restore_thresh=0.0
        )
        want = plain if name == "redknot" else runner.generate(ids, max_new_tokens=6)
        assert torch.equal(out.generation.first_logits, want.first_logits), name
        assert out.generation.tokens == want.tokens
        assert out.fractions["ffn"] is None


def test_headclass_is_the_plain_head_class_forward_and_redknot_recomputing_all_of_it(
    runner, pieces
):
    """``headclass`` prefills every token under the map; ``redknot`` with fresh local KV, every
    FFN and no restore recomputes exactly that, so it equals ``headclass``; with cached local
    KV it does not (the cached K/V of a local head differ from the in-context ones)."""
    prompt = compose(runner, pieces)
    local = synthetic_map(runner.shape, 0.5, window=8, sink=2)
    plain = runner.generate(list(prompt.ids), head_map=local, max_new_tokens=6)
    _, head = serve_policy(runner, "headclass", prompt, local)
    assert torch.equal(head.generation.first_logits, plain.first_logits)
    assert head.generation.tokens == plain.tokens
    assert head.fractions == {"attention": 1.0, "ffn": 1.0, "kv_heads": 1.0}
    dense = runner.generate(list(prompt.ids), max_new_tokens=6)
    assert not torch.equal(head.generation.first_logits, dense.first_logits)
    knobs = {"dense_layers": 99, "restore_thresh": None}
    _, fresh = serve_policy(runner, "redknot", prompt, local, local_kv="fresh", **knobs)
    torch.testing.assert_close(fresh.generation.first_logits, plain.first_logits)
    _, cached = serve_policy(runner, "redknot", prompt, local, local_kv="cached", **knobs)
    assert not torch.allclose(cached.generation.first_logits, plain.first_logits)


def test_repairing_every_segment_token_is_the_head_class_forward(runner, pieces):
    """``repair_k`` at or above every segment's length computes every segment token as new
    text (fresh K/V in every head, every FFN, none left to the cache): the plain head-class
    forward, even with the layer schedule and cached local K/V on. A shorter repair differs
    and repairs only the first rows of each segment."""
    prompt = compose(runner, pieces, synthetic_map(runner.shape, 0.5, window=8, sink=2))
    local = synthetic_map(runner.shape, 0.5, window=8, sink=2)
    plain = runner.generate(list(prompt.ids), head_map=local, max_new_tokens=6)
    knobs = {"dense_layers": 1, "mass_thresh": 0.3, "recent_n": 4, "restore_thresh": None}
    policy, whole = serve_policy(runner, "redknot", prompt, local, repair_k=50, **knobs)
    torch.testing.assert_close(whole.generation.first_logits, plain.first_logits)
    assert whole.generation.tokens == plain.tokens
    assert whole.fractions == {"attention": 1.0, "ffn": 1.0, "kv_heads": 1.0}
    policy, part = serve_policy(runner, "redknot", prompt, local, repair_k=4, **knobs)
    assert not torch.allclose(part.generation.first_logits, plain.first_logits)
    spans = [(s.start, s.end) for s in prompt.segments]
    assert spans == [(10, 50), (56, 106)]
    ctx = LayerContext(0, torch.arange(118), 0, "LL", 8, 2, runner.model)
    assert torch.nonzero(policy.repaired(ctx)).flatten().tolist() == [
        10,
        11,
        12,
        13,
        56,
        57,
        58,
        59,
    ]
    _, off = serve_policy(runner, "redknot", prompt, local, repair_k=0, **knobs)
    assert part.fractions["kv_heads"] > off.fractions["kv_heads"]
    assert part.fractions["ffn"] > off.fractions["ffn"]
