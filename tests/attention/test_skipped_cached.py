"""``skipped="cached"`` in the server path: a toy decoder stack (RoPE, head-class attention
through the SegPaged runner, residual MLP) run through the decoder-layer and MLP hooks, against
a brute-force forward of every row that applies the rule directly: in layers from
``dense_layers`` on, the segment tokens outside the most important ones skip the FFN and from
the next layer on take the cached, re-aligned K/V in every head and are not computed. Triton
kernels under the interpreter on the CPU."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from redknot.attention.ffn_schedule import SCHEDULE, around_decoder_layer, around_mlp

from .test_ffn_schedule import brute_mass, brute_skip
from .test_segpaged_runner import SINK, WINDOW, D, World

CLASSES = ("GLLL", "LLGL", "LGLL")
GRP, HIDDEN = 2, 48
NEW, SEG, QUESTION = 3, 12, 5  # prompt = 3 new tokens, the stored segment, a question
RECENT = 4


def _norm(x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class ToyMlp:
    def __init__(self, w1, w2):
        self.w1, self.w2 = w1, w2

    def forward(self, x):
        return torch.tanh(x @ self.w1) @ self.w2


class ToyLayer:
    """A decoder layer with SGLang's signature and return convention (hidden, residual)."""

    def __init__(self, layer_id, world, rope, g):
        H, Hq = world.layout.num_kv_heads, world.layout.num_q_heads
        w = lambda *s: torch.randn(*s, generator=g) / s[0] ** 0.5
        self.wq, self.wk, self.wv = w(HIDDEN, Hq * D), w(HIDDEN, H * D), w(HIDDEN, H * D)
        self.wo = w(Hq * D, HIDDEN)
        self.mlp = ToyMlp(w(HIDDEN, 2 * HIDDEN), w(2 * HIDDEN, HIDDEN))
        self.attn = SimpleNamespace(
            layer_id=layer_id, scaling=D**-0.5, logit_cap=0, is_cross_attention=False,
            qk_head_dim=D, v_head_dim=D,
        )  # fmt: skip
        self.self_attn = SimpleNamespace(attn=self.attn)
        self.world, self.rope = world, rope

    def qkv(self, x, positions):
        """bf16 q [n, Hq, D], k, v [n, H, D] as the model hands them to attention."""
        from redknot.kernels.rope_reference import sglang_rope_keys

        n = x.shape[0]
        q = sglang_rope_keys(self.rope, (x @ self.wq).view(n, -1, D), positions)
        k = sglang_rope_keys(self.rope, (x @ self.wk).view(n, -1, D), positions)
        v = (x @ self.wv).view(n, -1, D)
        return (t.to(torch.bfloat16) for t in (q, k, v))

    def forward(self, positions, hidden, fb, residual):
        if residual is None:
            residual, x = hidden, _norm(hidden)
        else:
            residual = hidden + residual
            x = _norm(residual)
        q, k, v = self.qkv(x, positions)
        n = x.shape[0]
        run = self.world.runner.extend
        o = run(q.view(n, -1), k.view(n, -1), v.view(n, -1), self.attn, fb, True).float()
        residual = o @ self.wo + residual
        x = _norm(residual)
        return around_mlp(ToyMlp.forward, self.mlp, x), residual


def _batch(world, rpis, lens):
    """An extend of ``lens[i]`` new tokens from position 0 for request ``rpis[i]``."""
    locs = []
    for rpi, n in zip(rpis, lens):
        slots = torch.arange(world.next_slot, world.next_slot + n, dtype=torch.int32)
        world.next_slot += n
        world.req_to_token[rpi, :n] = slots
        locs.append(slots.long())
    seq = torch.tensor(lens)
    return SimpleNamespace(
        forward_mode=world.FM.EXTEND, batch_size=len(rpis),
        req_pool_indices=torch.tensor(rpis, dtype=torch.int64), seq_lens=seq,
        seq_lens_cpu=seq.clone(), extend_prefix_lens_cpu=[0] * len(rpis),
        extend_seq_lens_cpu=list(lens), out_cache_loc=torch.cat(locs),
    )  # fmt: skip


def served(world, layers, rpi, embed, hooked):
    """The toy model's forward of one prompt through the runner; returns every row's final
    ``hidden + residual``."""
    return served_batch(world, layers, [rpi], [embed], hooked)


def served_batch(world, layers, rpis, embeds, hooked):
    """The toy model's forward of several prompts in one extend batch (rows concatenated)."""
    fb = _batch(world, rpis, [e.shape[0] for e in embeds])
    world.runner.plan(fb)
    positions = torch.cat([torch.arange(e.shape[0]) for e in embeds])
    hidden, residual = torch.cat(embeds), None
    for layer in layers:
        if hooked:
            hidden, residual = around_decoder_layer(
                ToyLayer.forward, layer, positions, hidden, fb, residual
            )
        else:
            hidden, residual = layer.forward(positions, hidden, fb, residual)
    return hidden + residual


def visible(layout, layer, h, pos):
    j = torch.arange(pos + 1)
    if layout.classes[layer][h] == "L":
        j = j[(j < SINK) | (pos - j < WINDOW)]
    return j


def layer_input(hidden, residual):
    """``(residual, normed input)`` of a decoder layer, formed as ``ToyLayer.forward`` does."""
    if residual is None:
        return hidden.clone(), _norm(hidden)
    residual = hidden + residual
    return residual, _norm(residual)


def brute_attention(layout, lid, q, k, v):
    """Every row's attention output ``[n, Hq * D]``, each query head over the keys its KV head's
    class sees, rounded to bf16 as the kernel returns it."""
    n = q.shape[0]
    o = torch.zeros(n, layout.num_q_heads, D)
    for i in range(n):
        for hq in range(layout.num_q_heads):
            j = visible(layout, lid, hq // GRP, i)
            s = (k[j, hq // GRP].float() @ q[i, hq].float()) * D**-0.5
            o[i, hq] = torch.softmax(s, 0) @ v[j, hq // GRP].float()
    return o.to(torch.bfloat16).float().view(n, -1)


def aligned_segment_kv(world, seg_kv, lid):
    """Layer ``lid``'s K/V of the stored segment re-aligned to its place in the prompt (rows
    ``NEW ..``), computed directly (RoPE delta of the reference), as every reusing head reads it."""
    from redknot.kernels.rope_reference import delta_rotate

    seg = torch.arange(NEW, NEW + SEG)
    cache = world.runner.rope.cos_sin_cache
    k = delta_rotate(seg_kv[lid][0], torch.arange(SEG), seg, cache, is_neox=True)
    return k.to(torch.bfloat16), seg_kv[lid][1]


def take_cached(world, seg_kv, lid, k, v, left, local_kv):
    """The rule for the segment rows' K/V in layer ``lid`` (``k``, ``v``: every row, in place):
    local heads take the cached, re-aligned K/V under ``local_kv="cached"``, and every head of
    the rows that left recovery (``left``: ``[n]`` bool) does."""
    layout, seg = world.layout, torch.arange(NEW, NEW + SEG)
    cached_k, cached_v = aligned_segment_kv(world, seg_kv, lid)
    for h in range(layout.num_kv_heads):
        reused = layout.classes[lid][h] == "L" and local_kv == "cached"
        rows = seg if reused else seg[left[seg]]
        k[rows, h] = cached_k[rows - NEW, h]
        v[rows, h] = cached_v[rows - NEW, h]


def brute_force(world, layers, embed, seg_kv, dense_layers, thresh, local_kv="cached"):
    """Every row's forward, with the rule applied directly (no compaction, no kernels): local
    heads of segment rows take the cached K/V under ``local_kv="cached"``, and every head of the
    rows that left recovery does."""
    layout = world.layout
    n, seg = embed.shape[0], torch.arange(NEW, NEW + SEG)
    probe = torch.arange(min(NEW + SEG, n - RECENT), n)  # the question, at least RECENT rows
    left = torch.zeros(n, dtype=torch.bool)
    hidden, residual = embed.clone(), None
    positions = torch.arange(n)
    history = []
    for lid, layer in enumerate(layers):
        residual, x = layer_input(hidden, residual)
        q, k, v = layer.qkv(x, positions)
        take_cached(world, seg_kv, lid, k, v, left, local_kv)
        new_residual = brute_attention(layout, lid, q, k, v) @ layer.wo + residual
        x = _norm(new_residual)
        ffn = ~left
        if lid >= dense_layers:
            glob = layout.global_heads(lid)
            qh = [h * GRP + j for h in glob for j in range(GRP)]
            mass = brute_mass(
                q[probe][:, qh].float().view(len(probe), len(glob), GRP, D),
                k[:, glob].float(), probe, D**-0.5,
            )  # fmt: skip
            candidates = [int(t) for t in seg if not left[t] and t < probe[0]]
            skip = brute_skip(mass, candidates, thresh)
            ffn[skip] = False
        out = torch.where(ffn[:, None], layer.mlp.forward(x), torch.zeros_like(x))
        hidden = torch.where(left[:, None], hidden, out)
        residual = torch.where(left[:, None], residual, new_residual)
        left = ~ffn
        history.append(left.clone())
    return hidden + residual, history


def world_with_stored_segment(classes, seed, num_tokens, segment_fraction=0.1, restore=0):
    """A World over ``classes`` whose segments keep every head, its toy layers, ``num_tokens``
    embeddings, and the segment (embeddings ``NEW .. NEW + SEG``) registered standalone (the
    region takes ``segment_fraction`` of the World's KV budget).
    Returns ``(world, rope, layers, embeddings, entry, the segment's stored K/V per layer)``."""
    from redknot.kernels.rope_align import alignable_rope
    from redknot.kernels.rope_reference import sglang_rope
    from redknot.segcache.registration import WriteJob
    from redknot.segcache.store import SegmentStore

    w = World(classes, GRP, torch.bfloat16, seed=1, segment_fraction=segment_fraction,
              segment_heads="all", restore=restore)  # fmt: skip
    rope = sglang_rope(D, D, 512, 10000.0, True)
    w.runner.rope = alignable_rope(rope)
    g = torch.Generator().manual_seed(seed)
    layers = [ToyLayer(i, w, rope, g) for i in range(len(classes))]
    store = SegmentStore.for_pool(w.pool)
    w.pool.cache = SimpleNamespace(segments=store)
    tokens = torch.randn(num_tokens, HIDDEN, generator=g)
    entry = store.register("kb", list(range(SEG)), pin=False)
    w.pool.segment_jobs[4] = WriteJob([(entry, 0)])
    served(w, layers, 4, tokens[NEW : NEW + SEG], hooked=False)  # the segment alone
    w.pool.segment_jobs.clear()
    seg_kv = [w.pool.segments.read(i, entry.rows()) for i in range(len(classes))]
    return w, rope, layers, tokens, entry, seg_kv


@pytest.mark.parametrize(
    "dense_layers, thresh, local_kv",
    [(1, 0.5, "cached"), (0, 0.4, "cached"), (3, 0.5, "cached"), (1, 1.0, "cached"),
     (1, 0.5, "fresh"), (0, 0.4, "fresh")],
)  # fmt: skip
def test_rows_that_skip_a_deep_ffn_leave_recovery_and_take_cached_kv(
    dense_layers, thresh, local_kv
):
    from redknot.kernels.rope_reference import delta_rotate
    from redknot.segcache.reuse import SegmentUse

    n = NEW + SEG + QUESTION
    w, rope, layers, tokens, entry, seg_kv = world_with_stored_segment(CLASSES, 3, n)
    w.runner.dense_layers, w.runner.mass_thresh, w.runner.recent_n = dense_layers, thresh, RECENT
    w.runner.skipped, w.runner.local_kv = "cached", local_kv
    w.pool.cache.segments.acquire(entry)
    w.pool.segment_reads[2] = [SegmentUse(NEW, entry, prompt_len=n)]
    got = served(w, layers, 2, tokens, hooked=True)
    want, history = brute_force(w, layers, tokens, seg_kv, dense_layers, thresh, local_kv)

    if 0 < thresh < 1 and dense_layers < len(CLASSES) - 1:
        assert history[-2].any(), "the test needs rows that leave before the last layer"
    assert SCHEDULE.held is None and SCHEDULE.full is None  # every row is handed back
    assert SCHEDULE.left == sum(int(h.sum()) for h in history[:-1])
    # every row, those that left included (they keep the state they left with)
    torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)
    for lid in range(len(CLASSES)):  # rows that left hold their cached K/V in every head
        before = history[lid - 1] if lid else torch.zeros_like(history[0])
        gone = torch.nonzero(before).flatten()
        glob = w.layout.global_heads(lid)
        if gone.numel() and glob:
            slots = w.req_to_token[2, gone].long()
            stored = w.pool.k_global[lid][slots]
            cached = delta_rotate(
                seg_kv[lid][0][gone - NEW], gone - NEW, gone, rope.cos_sin_cache, is_neox=True
            ).to(torch.bfloat16)
            torch.testing.assert_close(
                stored.float(), cached[:, glob].float(), atol=2e-2, rtol=2e-2
            )


def test_fresh_local_kv_without_the_layer_schedule_computes_the_prompt_as_without_reuse():
    """The exact limit of ``local_kv="fresh"``: with every FFN run (no layer schedule), a
    prompt that reuses a cached segment reads nothing from the cache and computes exactly what
    the same prompt without the segment mark computes; with ``"cached"`` it differs (the test
    can fail)."""
    from redknot.segcache.reuse import SegmentUse

    n = NEW + SEG + QUESTION
    w, _, layers, tokens, entry, _ = world_with_stored_segment(CLASSES, 3, n)
    plain = served(w, layers, 5, tokens, hooked=True)
    got = {}
    for rpi, local_kv in ((2, "fresh"), (3, "cached")):
        w.runner.local_kv = local_kv
        w.pool.cache.segments.acquire(entry)
        w.pool.segment_reads[rpi] = [SegmentUse(NEW, entry, prompt_len=n)]
        got[local_kv] = served(w, layers, rpi, tokens, hooked=True)
    assert torch.equal(got["fresh"], plain)
    assert not torch.allclose(got["cached"], plain, atol=1e-2)


@pytest.mark.parametrize("reusing_first", [True, False])
def test_a_batch_of_a_reusing_and_a_plain_prompt_computes_each_as_alone(reusing_first):
    """Rows leave in one request of a batch and not in the other: the reusing request's rows
    are the brute force's, the plain request's are its forward alone (the gathered plan's rows
    of both requests, in either order)."""
    from redknot.segcache.reuse import SegmentUse

    n = NEW + SEG + QUESTION
    w, _, layers, tokens, entry, seg_kv = world_with_stored_segment(CLASSES, 3, n)
    w.runner.dense_layers, w.runner.mass_thresh, w.runner.recent_n = 1, 0.5, RECENT
    w.runner.skipped = "cached"
    plain = torch.randn(9, HIDDEN, generator=torch.Generator().manual_seed(8))
    alone = served(w, layers, 5, plain, hooked=True)
    w.pool.cache.segments.acquire(entry)
    w.pool.segment_reads[2] = [SegmentUse(NEW, entry, prompt_len=n)]
    if reusing_first:
        got = served_batch(w, layers, [2, 5], [tokens, plain], hooked=True)
        got_reuse, got_plain = got[:n], got[n:]
    else:
        got = served_batch(w, layers, [5, 2], [plain, tokens], hooked=True)
        got_plain, got_reuse = got[:9], got[9:]
    want, history = brute_force(w, layers, tokens, seg_kv, 1, 0.5)

    assert history[-2].any(), "the test needs rows that leave before the last layer"
    assert SCHEDULE.left == sum(int(h.sum()) for h in history[:-1])
    torch.testing.assert_close(got_reuse, want, atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(got_plain, alone, atol=2e-2, rtol=2e-2)
