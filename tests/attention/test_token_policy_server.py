"""Token-level policies in the server path (``naive``, ``epic``, ``cacheblend``, ``sparsex``): the
toy decoder stack of ``test_skipped_cached`` with every head global, run through the decoder-layer
hook and
the SegPaged runner, against a brute-force forward of every row that applies the policy's rule
directly: from ``sparse_from`` on the reused segment tokens the policy did not keep take their
cached, re-aligned K/V in every head and are not computed. Limits: ``epic`` keeping every token
and ``cacheblend`` with ratio 1 are the dense prefill (nothing leaves). Triton kernels under the
interpreter on the CPU."""

from __future__ import annotations

import pytest
import torch

from redknot.attention.ffn_schedule import SCHEDULE
from redknot.attention.token_policy import TokenPolicy, kept_rows
from redknot.kernels.held_rows import (
    HeldRowsAttention,
    PagedPrefillReference,
    held_rows_reference,
    merge_state_reference,
)
from redknot.recovery.cacheblend import blend_count

from .test_segpaged_runner import D
from .test_skipped_cached import (
    GRP,
    NEW,
    SEG,
    _norm,
    aligned_segment_kv,
    brute_attention,
    layer_input,
    served,
    world_with_stored_segment,
)

CLASSES = ("GG", "GG", "GG")  # every head global: token-level policies treat heads alike


def brute_force(world, layers, embed, seg_kv, policy):
    """Every row's forward with the policy's rule applied directly; returns the final states,
    per layer the rows that did not compute it (took cached K/V in every head), per layer
    the last row's keys (always computed), and per layer every row's keys and values as
    attended (what the stores must hold for decoding)."""
    n = embed.shape[0]
    seg = torch.arange(NEW, NEW + SEG)

    def leaving(kept):  # reused tokens not kept leave; the last row never does
        left = torch.zeros(n, dtype=torch.bool)
        left[seg[~kept]] = True
        left[n - 1] = False
        return left

    left = torch.zeros(n, dtype=torch.bool)
    if policy.name == "naive":
        left = leaving(torch.zeros(SEG, dtype=torch.bool))
    elif policy.name == "epic":  # the first epic_k tokens of the segment
        left = leaving(torch.arange(SEG) < policy.epic_k)
    hidden, residual = embed.clone(), None
    positions = torch.arange(n)
    history, last_keys, attended = [], [], []
    for lid, layer in enumerate(layers):
        residual, x = layer_input(hidden, residual)
        q, k, v = layer.qkv(x, positions)
        last_keys.append(k[n - 1].clone())
        cached_k, cached_v = aligned_segment_kv(world, seg_kv, lid)
        layout = world.layout
        for h in layout.local_heads(lid):  # local heads: every reused token from the cache
            k[seg, h], v[seg, h] = cached_k[:, h], cached_v[:, h]
        choose = lid == policy.select_layer
        if choose and policy.name == "sparsex":
            kept = brute_sparseq(q, k, policy, layout.global_heads(lid))
        elif choose:  # CacheBlend: KV deviation of the fresh K/V from the cached, aligned K/V
            dev = (k[seg].double() - cached_k.double()).square().sum((1, 2))
            dev += (v[seg].double() - cached_v.double()).square().sum((1, 2))
            count = blend_count(policy.blend_ratio, SEG)
            top = sorted(range(SEG), key=lambda i: (-float(dev[i]), i))[:count]
            kept = torch.zeros(SEG, dtype=torch.bool)
            kept[top] = True
        history.append(left.clone())
        rows = seg[left[seg]]
        k[rows], v[rows] = cached_k[rows - NEW], cached_v[rows - NEW]
        attended.append((k.clone(), v.clone()))
        new_residual = brute_attention(layout, lid, q, k, v) @ layer.wo + residual
        out = layer.mlp.forward(_norm(new_residual))
        hidden = torch.where(left[:, None], hidden, out)
        residual = torch.where(left[:, None], residual, new_residual)
        if choose:
            left = leaving(kept)
    return hidden + residual, history, last_keys, attended


DEFAULTS = {"epic_k": 16, "blend_check_layer": 1, "blend_ratio": 0.15, "sparseq_boundary": 2,
            "sparseq_k": 9, "sparseq_block": 1}  # fmt: skip
def brute_sparseq(q, k, policy, heads):
    """SparseX's set among the segment rows, computed directly: the attention probability
    each key gets from the non-reused rows (and the tail rows when the prompt ends inside the
    segment), summed over the query heads of the KV ``heads`` (global heads: every key up to
    the query); the top ``sparseq_k`` segment rows (ties: the lower row),
    ``sparseq_block`` rows at each segment edge facing non-reused rows, the tail."""
    n = q.shape[0]
    ends_inside = n == NEW + SEG
    tail = set(range(max(NEW + SEG - 64, NEW), NEW + SEG)) if ends_inside else set()
    probed = [i for i in range(n) if not NEW <= i < NEW + SEG or i in tail]
    score = [0.0] * n
    for i in probed:
        for hq in [h * GRP + j for h in heads for j in range(GRP)]:
            s = (k[: i + 1, hq // GRP].float() @ q[i, hq].float()) * D**-0.5
            for j, p in enumerate(torch.softmax(s.double(), 0).tolist()):
                score[j] += p
    segment = range(NEW, NEW + SEG)  # the top-k ranks the reused rows only
    top = sorted(segment, key=lambda j: (-score[j], j))[: policy.sparseq_k]
    block = policy.sparseq_block
    edges = set(range(NEW, min(NEW + block, NEW + SEG)))  # new text before the segment
    if not ends_inside:  # the question after it
        edges |= set(range(max(NEW + SEG - block, NEW), NEW + SEG))
    chosen = set(top) | edges | tail
    return torch.tensor([NEW + i in chosen for i in range(SEG)])


POLICIES = [
    ("naive", {}),
    ("epic", {"epic_k": 4}),
    ("epic", {"epic_k": 100}),  # every token kept: the dense prefill
    ("cacheblend", {"blend_check_layer": 0, "blend_ratio": 0.25}),
    ("cacheblend", {"blend_check_layer": 1, "blend_ratio": 0.5}),
    ("cacheblend", {"blend_check_layer": 0, "blend_ratio": 1.0}),  # the dense prefill
    ("sparsex", {}),  # chooses in layer 1, from layer 2 on only the chosen rows
    ("sparsex", {"sparseq_boundary": 1, "sparseq_k": 0, "sparseq_block": 0}),
    ("sparsex", {"sparseq_boundary": 1, "sparseq_k": 100}),  # every row: the dense prefill
]


class FlashInferStandIn:
    """SGLang's FlashInfer backend as the runner uses it (``init_forward_metadata``, then
    ``forward_extend`` storing the K/V and attending every row), in PyTorch."""

    def __init__(self, world):
        self.world, self.planned, self.fb = world, 0, None

    def init_forward_metadata(self, fb):
        self.planned += 1
        self.fb = fb

    def forward_extend(self, q, k, v, layer, fb, save_kv_cache=True):
        assert fb is self.fb and save_kv_cache
        w, lid = self.world, layer.layer_id
        H, Hq = w.layout.num_kv_heads, w.layout.num_q_heads
        w.pool.set_kv_buffer(layer, fb.out_cache_loc, k.view(-1, H, D), v.view(-1, H, D))
        qo = torch.zeros(fb.batch_size + 1, dtype=torch.int32)
        qo[1:] = torch.cumsum(torch.tensor(fb.extend_seq_lens_cpu), 0)
        out = held_rows_reference(
            q.view(-1, Hq, D), w.pool.k_global[lid], w.pool.v_global[lid],
            torch.ones(int(qo[-1]), dtype=torch.bool), qo,
            torch.tensor(fb.extend_prefix_lens_cpu), fb.req_pool_indices, w.req_to_token,
            layer.scaling,
        )  # fmt: skip
        return out.view(-1, Hq * D)


@pytest.mark.parametrize("name, knobs", POLICIES)
@pytest.mark.parametrize("question", [5, 0])  # 0: the prompt ends inside the segment
@pytest.mark.parametrize("on_flashinfer", [None, "auto", "runs", "blocks", "runs per layer"])
def test_token_policy_in_the_server_matches_its_rule(name, knobs, question, on_flashinfer,
                                                     caplog):  # fmt: skip
    """The policy's rule, served on redknot's Triton kernel (None) or on FlashInfer, the held
    rows in runs or blocks as they pay ("auto") or always one of them; the rows that left
    written to the pool in one launch over the layers, or ("runs per layer") a launch per
    layer, as where the layers' buffers differ. FlashInfer's wrapper is
    stood in for by its semantics in PyTorch (``redknot.kernels.held_rows``): the runner's
    planning, pool writes, runs, blocks and merge are what is checked here, FlashInfer's
    kernels against the reference in tests/kernels/test_held_rows.py."""
    from redknot.kernels.rope_reference import delta_rotate
    from redknot.segcache.reuse import SegmentUse

    policy = TokenPolicy(name, **{**DEFAULTS, **knobs})
    n = NEW + SEG + question
    w, rope, layers, tokens, entry, seg_kv = world_with_stored_segment(CLASSES, 5, n)

    w.runner.policy = policy
    if on_flashinfer:
        fi = FlashInferStandIn(w)
        held = HeldRowsAttention(
            PagedPrefillReference, merge_state_reference, w.layout.num_q_heads,
            w.layout.num_kv_heads, D, torch.bfloat16,
            force=None if on_flashinfer == "auto" else on_flashinfer.split()[0],
        )  # fmt: skip
        w.runner.use_flashinfer(fi, held)
        if on_flashinfer == "runs per layer":
            w.runner._left_stacks = None  # as where the layers' buffers differ
    w.pool.cache.segments.acquire(entry)
    w.pool.segment_reads[2] = [SegmentUse(NEW, entry, prompt_len=n)]
    with caplog.at_level("INFO", logger="redknot.attention.segpaged_runner"):
        got = served(w, layers, 2, tokens, hooked=True)
    want, history, last_keys, attended = brute_force(w, layers, tokens, seg_kv, policy)
    from benchmarks.ttft import POLICY_LOG  # the TTFT benchmark reads the log line

    (logged,) = [m for m in map(POLICY_LOG.search, caplog.messages) if m]
    assert int(logged.group(1)) == SCHEDULE.left
    line = next(m for m in caplog.messages if POLICY_LOG.search(m))
    if not on_flashinfer:
        assert line.endswith("attention on redknot's Triton kernel")
    elif not history[-1].any():  # nothing left: every layer on SGLang's FlashInfer extend
        assert line.endswith("attention on FlashInfer") and fi.planned == 1
        assert held.plan_of is None
    elif held.plan_of is None:  # runs do not pay: the held layers on the Triton kernel
        assert on_flashinfer == "auto" and "rows in recovery (as runs they would read" in line
    else:  # planned once, when rows left, as forced or as it pays
        assert line.endswith(f"attention on FlashInfer ({held.plan_of.describe()})")
        kind = {"runs": "RowRuns", "blocks": "RowBlocks"}.get(on_flashinfer.split()[0])
        assert kind is None or type(held.plan_of).__name__ == kind
        first = 0 if policy.chooses_at_plan else policy.select_layer + 1
        per_layer = on_flashinfer == "runs per layer"
        assert w.runner.extend_state.left_from == (None if per_layer else first)
        # FlashInfer's extend planned only where a layer computes every row (CacheBlend and
        # SparseX below their choice)
        assert fi.planned == (name in ("cacheblend", "sparsex"))

    dense = {  # the policy keeps every row
        "naive": False,
        "epic": policy.epic_k >= SEG,
        "cacheblend": policy.blend_ratio == 1.0,
        "sparsex": question == 0 or policy.sparseq_k >= n,  # no question: the tail is all
    }[name]
    assert bool(history[-1].any()) != dense  # rows leave unless the policy keeps them all
    assert SCHEDULE.held is None and SCHEDULE.full is None
    assert SCHEDULE.left == sum(int(h.sum()) for h in history)
    kept = ~history[-1]  # rows that computed the last layer, the last row among them
    torch.testing.assert_close(got[kept], want[kept], atol=3e-2, rtol=3e-2)
    for lid, fresh in enumerate(last_keys):  # the last row keeps its own keys, even when reused
        glob = w.layout.global_heads(lid)
        stored = w.pool.k_global[lid][w.req_to_token[2, n - 1].long()]
        torch.testing.assert_close(stored.float(), fresh[glob].float(), atol=2e-2, rtol=2e-2)
    for lid in range(len(CLASSES)):  # rows that left hold their cached K/V in every head
        gone = torch.nonzero(history[lid]).flatten()
        glob = w.layout.global_heads(lid)  # the global store (every head when all global)
        if gone.numel() and glob:
            slots = w.req_to_token[2, gone].long()
            cached = delta_rotate(
                seg_kv[lid][0][gone - NEW], gone - NEW, gone, rope.cos_sin_cache, is_neox=True
            ).to(torch.bfloat16)
            torch.testing.assert_close(
                w.pool.k_global[lid][slots].float(), cached[:, glob].float(), atol=2e-2, rtol=2e-2
            )
            stored_v = w.pool.v_global[lid][slots]
            assert torch.equal(stored_v, seg_kv[lid][1][gone - NEW][:, glob])
    # what a decode step reads: every row's K/V as attended, in the global store (every head)
    slots = w.req_to_token[2, :n].long()
    for lid, (k, v) in enumerate(attended):
        for store, want_kv in ((w.pool.k_global, k), (w.pool.v_global, v)):
            torch.testing.assert_close(store[lid][slots].float(), want_kv.float(), atol=2e-2,
                                       rtol=2e-2)  # fmt: skip


def test_kept_rows_keep_new_text_and_each_requests_last_row():
    tokens = torch.tensor([1, 2, 3, 6, 7])  # reused tokens of two requests (rows 0-3, 4-7)
    kept = torch.tensor([False, True, False, False, False])
    keep = kept_rows(8, tokens, kept, torch.tensor([0, 4, 8]))
    assert keep.tolist() == [True, False, True, True, True, True, False, True]


def test_cacheblend_keeps_the_largest_deviations_per_request():
    policy = TokenPolicy("cacheblend", **{**DEFAULTS, "blend_ratio": 0.5})
    tokens = torch.tensor([0, 1, 2, 3, 5, 6])  # request 0: rows 0-3, request 1: rows 4-7
    deviation = torch.tensor([0.1, 0.9, 0.5, 0.5, 0.2, 0.3], dtype=torch.float64)
    kept = policy.blend_kept(deviation, tokens, tokens, torch.tensor([0, 4, 8]))
    # request 0: 2 of 4 (0.9, then the tie 0.5/0.5 goes to the lower row); request 1: 1 of 2
    assert kept.tolist() == [False, True, True, False, False, True]


def blend_kept_brute_force(ratio, deviation, tokens, qo_indptr) -> list[bool]:
    """CacheBlend's choice one request at a time: its reads ordered by deviation (largest
    first), then row, and the first ``blend_count`` of them kept."""
    kept = [False] * len(tokens)
    for b in range(len(qo_indptr) - 1):
        mine = [i for i, t in enumerate(tokens) if qo_indptr[b] <= t < qo_indptr[b + 1]]
        mine.sort(key=lambda i: (-deviation[i], tokens[i]))
        for i in mine[: blend_count(ratio, len(mine))]:
            kept[i] = True
    return kept


@pytest.mark.parametrize("seed", range(6))
def test_cacheblend_choice_equals_a_per_request_brute_force(seed):
    """Reads in any order over several requests (one with none), deviations with many ties:
    the device-side sorts keep exactly what choosing request by request keeps."""
    g = torch.Generator().manual_seed(seed)
    policy = TokenPolicy("cacheblend", **{**DEFAULTS, "blend_ratio": [0.15, 0.5, 1.0][seed % 3]})
    qo = torch.tensor([0, 40, 41, 41, 120, 200])  # request 2 has no rows, request 1 no reads
    rows = torch.cat([torch.arange(0, 38), torch.arange(45, 118), torch.arange(121, 199)])
    tokens = rows[torch.randperm(rows.numel(), generator=g)]
    deviation = torch.randint(0, 6, (tokens.numel(),), generator=g).to(torch.float64) / 4
    kept = policy.blend_kept(deviation, tokens, tokens, qo)
    expected = blend_kept_brute_force(policy.blend_ratio, deviation.tolist(), tokens.tolist(),
                                      qo.tolist())  # fmt: skip
    assert kept.tolist() == expected
    assert sum(expected) == sum(blend_count(policy.blend_ratio, n) for n in (38, 0, 0, 73, 78))


def test_segment_spans_split_adjacent_segments_and_gaps():
    from redknot.attention.token_policy import segment_spans

    rows = torch.tensor([2, 3, 4, 5, 6, 9, 10])
    pos_off = torch.tensor([0, 1, 2, 0, 1, 7, 8])  # a second segment starts at row 5
    assert segment_spans(rows, pos_off) == [(2, 5), (5, 7), (9, 11)]
    assert segment_spans(rows[:0], pos_off[:0]) == []


def test_a_failed_flashinfer_plan_leaves_the_rows_in_recovery_to_the_triton_kernel(caplog):
    """A plan that raises (FlashInfer out of workspace, say) is said once, and this batch and
    every later one attend their rows in recovery on the Triton kernel, with the right result."""
    from benchmarks.ttft import POLICY_LOG
    from redknot.segcache.reuse import SegmentUse

    policy = TokenPolicy("epic", **{**DEFAULTS, "epic_k": 4})
    n = NEW + SEG + 5
    w, _, layers, tokens, entry, seg_kv = world_with_stored_segment(CLASSES, 5, n)
    w.runner.policy = policy

    class Failing(HeldRowsAttention):
        def plan(self, *args, **kwargs):
            raise RuntimeError("out of workspace")

    held = Failing(PagedPrefillReference, merge_state_reference, w.layout.num_q_heads,
                   w.layout.num_kv_heads, D, torch.bfloat16)  # fmt: skip
    w.runner.use_flashinfer(FlashInferStandIn(w), held)
    w.pool.cache.segments.acquire(entry)
    w.pool.segment_reads[2] = [SegmentUse(NEW, entry, prompt_len=n)]
    with caplog.at_level("INFO", logger="redknot.attention.segpaged_runner"):
        got = served(w, layers, 2, tokens, hooked=True)
    want, history, _, _ = brute_force(w, layers, tokens, seg_kv, policy)
    assert w.runner.held_attention is None
    assert (
        sum("planning the rows in recovery on FlashInfer failed" in m for m in caplog.messages) == 1
    )
    line = next(m for m in caplog.messages if POLICY_LOG.search(m))
    assert line.endswith("on redknot's Triton kernel for the rows in recovery (its plan on "
                         "FlashInfer failed)")  # fmt: skip
    kept = ~history[-1]
    torch.testing.assert_close(got[kept], want[kept], atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
def test_cacheblend_choice_on_the_gpu_equals_the_host_at_a_32k_prompt():
    """A 32K-token prompt's reads in any order over two requests, deviations with ties, as the
    server chooses them (on the GPU): the same rows as the same sorts on the host."""
    g = torch.Generator().manual_seed(0)
    policy = TokenPolicy("cacheblend", **DEFAULTS)
    qo = torch.tensor([0, 20000, 32833])
    rows = torch.cat([torch.arange(1, 19990), torch.arange(20001, 32768)])
    tokens = rows[torch.randperm(rows.numel(), generator=g)]
    deviation = torch.randint(0, 50, (tokens.numel(),), generator=g).to(torch.float64)
    host = policy.blend_kept(deviation, tokens, tokens, qo)
    cuda = policy.blend_kept(deviation.cuda(), tokens.cuda(), tokens, qo)
    assert torch.equal(cuda.cpu(), host)
    per_request = [int(host[tokens < 20000].sum()), int(host[tokens >= 20000].sum())]
    assert per_request == [blend_count(policy.blend_ratio, n) for n in (19989, 12767)]
