"""SamKV in the server path (``--redknot-policy samkv``): the toy decoder stack of
``test_skipped_cached`` with every head global, a prompt cut to each document's anchors and kept
blocks, run through the decoder-layer hook and the SegPaged runner, against a brute-force
forward that applies the served rule directly: per layer, the question's queries (rotated back
to position 0, pooled; with the other documents' local queries, Eq. 1) score every middle block
by its mean stored key, each document's best blocks fill its middle slots with their cached K/V
re-rotated to the slots' positions, the middle slots are never computed, and every other row
is. Limits: a document that is all anchor is the dense prefill; a budget of 1 keeps every block
in order. Triton kernels under the interpreter on the CPU."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from redknot.attention.ffn_schedule import SCHEDULE
from redknot.attention.token_policy import TokenPolicy
from redknot.kernels.rope_reference import delta_rotate
from redknot.recovery.samkv.query import personalized_queries
from redknot.recovery.samkv.served import (
    SamkvKnobs,
    ServedDoc,
    plan_documents,
    served_ids,
)

from .test_skipped_cached import (
    GRP,
    NEW,
    SEG,
    _norm,
    brute_attention,
    layer_input,
    served,
    world_with_stored_segment,
)

CLASSES = ("GG", "GG", "GG")
QUESTION = 4
GAP = 2  # new tokens between the two documents
DEFAULTS = {"epic_k": 16, "blend_check_layer": 1, "blend_ratio": 0.15, "sparseq_boundary": 2,
            "sparseq_k": 9, "sparseq_block": 1}  # fmt: skip


def test_plan_keeps_anchors_and_the_budgets_blocks_of_each_document():
    knobs = SamkvKnobs(block=4, budget=0.3, init_blocks=1, local_blocks=2, bias=True)
    # document A: 4 init, 6 blocks (24), 8 + 3 local; document B too short for a block
    plan = plan_documents(60, [(5, 39, "ns", "a"), (46, 10, "ns", "b")], knobs)
    a, b = plan.docs
    assert (a.init, a.num_blocks, a.local, a.kept_blocks) == (4, 6, 11, 2)
    assert (b.num_blocks, b.kept_blocks, b.served_tokens) == (0, 0, 10)
    assert a.served_tokens == 4 + 8 + 11 and a.start == 5
    assert b.start == 46 - (39 - 23) and b.source == 46
    assert plan.served_tokens == 60 - 16 and plan.note is None
    ids = list(range(100, 160))
    got = list(served_ids(ids, plan))
    want = ids[:5] + ids[5:17] + ids[5 + 28 : 44] + ids[44:]
    assert got == want and len(got) == plan.served_tokens
    assert plan.sequence_ratio == pytest.approx((23 + 10) / 49)


def test_plan_without_a_question_keeps_every_block():
    knobs = SamkvKnobs(block=2, budget=0.25, init_blocks=1, local_blocks=1, bias=True)
    plan = plan_documents(20, [(4, 16, "ns", "a")], knobs)  # the prompt ends in the document
    assert plan.served_tokens == 20 and plan.docs[0].kept_blocks == plan.docs[0].num_blocks
    assert "no question" in plan.note
    assert list(served_ids(list(range(20)), plan)) == list(range(20))


def rotate_back(x, pos, cache):
    return delta_rotate(x, pos, torch.zeros_like(pos), cache, is_neox=True)


def brute_choice(world, q, seg_k, docs, question_rows, local_rows, bias):
    """Each document's kept blocks in one layer, computed directly: ``q`` [n, Hq, D] at
    positions 0.., ``seg_k`` the stored keys [SEG, H, D] (positions 0..); ``docs``: ServedDoc;
    ``local_rows``: per document its local anchors' rows."""
    cache = world.runner.rope.cos_sin_cache
    pos = lambda rows: torch.as_tensor(rows)
    generic = rotate_back(q[question_rows].float(), pos(question_rows), cache).mean(0)
    locs = torch.stack(
        [rotate_back(q[r].float(), pos(r), cache).mean(0) for r in local_rows]
    )  # [Dn, Hq, D]
    if bias:
        queries = personalized_queries(generic[None], locs[:, None])[:, 0]
    else:
        queries = generic.expand(len(docs), *generic.shape)
    free_k = rotate_back(seg_k.float(), torch.arange(SEG), cache)
    kept = []
    for d, qd in zip(docs, queries):
        scores = []
        for blk in range(d.num_blocks):
            lo = d.init + blk * d.block
            mean = free_k[lo : lo + d.block].mean(0)  # [H, D]
            scores.append(sum(float(qd[h] @ mean[h // GRP]) for h in range(qd.shape[0])))
        best = sorted(range(d.num_blocks), key=lambda i: (-scores[i], i))[: d.kept_blocks]
        kept.append(sorted(best))
    return kept


def brute_force(world, layers, embed, seg_kv, docs, n, bias):
    """The served rule, row by row, on the served prompt ``embed`` [n, HIDDEN]."""
    layout, cache = world.layout, world.runner.rope.cos_sin_cache
    starts = [d.start for d in docs]
    middle = torch.zeros(n, dtype=torch.bool)
    for d in docs:
        middle[d.start + d.init : d.start + d.init + d.slots] = True
    q_rows = list(range(docs[-1].start + docs[-1].served_tokens, n))
    local_rows = [list(range(s + d.init + d.slots, s + d.served_tokens))
                  for s, d in zip(starts, docs)]  # fmt: skip
    hidden, residual = embed.clone(), None
    positions = torch.arange(n)
    choices = []
    for lid, layer in enumerate(layers):
        residual, x = layer_input(hidden, residual)
        q, k, v = layer.qkv(x, positions)
        kept = brute_choice(world, q, seg_kv[lid][0], docs, q_rows, local_rows, bias)
        choices.append(kept)
        for s, d, blocks in zip(starts, docs, kept):
            offs = torch.tensor([d.init + b * d.block + t for b in blocks for t in range(d.block)])
            slots = torch.arange(s + d.init, s + d.init + d.slots)
            k[slots] = delta_rotate(seg_kv[lid][0][offs], offs, slots, cache, is_neox=True).to(
                k.dtype
            )
            v[slots] = seg_kv[lid][1][offs]
        new_residual = brute_attention(layout, lid, q, k, v) @ layer.wo + residual
        out = layer.mlp.forward(_norm(new_residual))
        hidden = torch.where(middle[:, None], hidden, out)
        residual = torch.where(middle[:, None], residual, new_residual)
    return hidden + residual, choices, middle


def served_prompt(tokens, docs, n_orig):
    """The served prompt's embeddings from the original prompt's ``tokens``."""
    rows, at = [], 0
    for d in docs:
        rows += list(range(at, d.source)) + [d.source + int(o) for o in d.served_offsets()]
        at = d.source + d.num_tokens
    rows += list(range(at, n_orig))
    return tokens[rows]


def two_document_world(knobs, seed=3):
    """The stored segment marked twice (NEW and after GAP new tokens), and a question."""
    n_orig = NEW + SEG + GAP + SEG + QUESTION
    w, _, layers, tokens, entry, seg_kv = world_with_stored_segment(CLASSES, seed, n_orig)
    tokens[NEW + SEG + GAP : NEW + 2 * SEG + GAP] = tokens[NEW : NEW + SEG]  # same document
    hits = [(NEW, SEG, "kb", "seg"), (NEW + SEG + GAP, SEG, "kb", "seg")]
    plan = plan_documents(n_orig, hits, knobs)
    return w, layers, served_prompt(tokens, plan.docs, n_orig), entry, seg_kv, plan


@pytest.mark.parametrize(
    "budget, bias, init_blocks", [(0.5, True, 1), (0.5, False, 1), (0.25, True, 1), (1.0, True, 1)]
)
def test_samkv_in_the_server_matches_its_rule(budget, bias, init_blocks):
    from redknot.segcache.reuse import SegmentUse

    knobs = SamkvKnobs(block=2, budget=budget, init_blocks=init_blocks, local_blocks=1, bias=bias)
    w, layers, embed, entry, seg_kv, plan = two_document_world(knobs)
    n = plan.served_tokens
    w.runner.policy = TokenPolicy("samkv", **DEFAULTS, samkv=knobs)
    uses = []
    for d in plan.docs:
        w.pool.cache.segments.acquire(entry)
        uses.append(SegmentUse(d.start, entry, n, doc=d))
    w.pool.segment_reads[2] = uses
    got = served(w, layers, 2, embed, hooked=True)
    want, choices, middle = brute_force(w, layers, embed, seg_kv, plan.docs, n, bias)

    a = plan.docs[0]
    assert a.kept_blocks == math.ceil(budget * a.num_blocks)
    if budget < 1:  # the test needs layers that choose differently from the cut's first blocks
        assert any(c != [list(range(d.kept_blocks)) for d in plan.docs] for c in choices)
    assert SCHEDULE.held is None and SCHEDULE.full is None
    # bf16 through three layers: one element of 816 was measured 0.041 apart
    torch.testing.assert_close(got[~middle], want[~middle], atol=5e-2, rtol=3e-2)
    # what decode reads: each layer's slots hold its chosen blocks' cached K/V at slot positions
    cache = w.runner.rope.cos_sin_cache
    for lid, kept in enumerate(choices):
        for d, blocks in zip(plan.docs, kept):
            offs = torch.tensor([d.init + b * d.block + t for b in blocks for t in range(d.block)])
            slots = torch.arange(d.start + d.init, d.start + d.init + d.slots)
            stored = w.pool.k_global[lid][w.req_to_token[2, slots].long()]
            want_k = delta_rotate(seg_kv[lid][0][offs], offs, slots, cache, is_neox=True)
            torch.testing.assert_close(stored.float(), want_k.to(torch.bfloat16).float(),
                                       atol=2e-2, rtol=2e-2)  # fmt: skip
            assert torch.equal(w.pool.v_global[lid][w.req_to_token[2, slots].long()],
                               seg_kv[lid][1][offs])  # fmt: skip


def test_documents_that_are_all_anchor_are_the_dense_prefill():
    """The exact limit: with anchors covering every document token nothing is cut, nothing
    leaves recovery and the served forward equals the same prompt computed without reuse."""
    from redknot.segcache.reuse import SegmentUse

    knobs = SamkvKnobs(block=2, budget=0.5, init_blocks=SEG, local_blocks=1, bias=True)
    w, layers, embed, entry, _, plan = two_document_world(knobs)
    assert plan.served_tokens == plan.prompt_tokens and plan.dropped == 0
    plain = served(w, layers, 5, embed, hooked=True)
    w.runner.policy = TokenPolicy("samkv", **DEFAULTS, samkv=knobs)
    for d in plan.docs:
        w.pool.cache.segments.acquire(entry)
    w.pool.segment_reads[2] = [SegmentUse(d.start, entry, plan.served_tokens, doc=d)
                               for d in plan.docs]  # fmt: skip
    got = served(w, layers, 2, embed, hooked=True)
    assert torch.equal(got, plain)


def _layer_inputs(device="cpu"):
    """A choice's inputs written out: two requests, one of them with two documents, the bias
    on; ``q`` rows 12, region rows 40, 8 blocks of 2 (and their positions, and the rope)."""
    from redknot.kernels.rope_reference import sglang_rope
    from redknot.recovery.samkv.served import LayerInputs, turn_back

    g = torch.Generator().manual_seed(0)
    hq, h, d, block = 4, 2, 8, 2
    cache = sglang_rope(d, d, 256, 10000.0, True).cos_sin_cache
    # docs: 0 (req 0, 3 blocks, keeps 1), 1 (req 0, 2 blocks, keeps 1), 2 (req 1, 3 blocks, 2)
    block_rows = torch.randperm(40, generator=g)[:16].view(8, block)
    block_pos = torch.tensor([2, 4, 6, 2, 4, 3, 5, 7])
    t = lambda x: torch.tensor(x, device=device)
    inputs = LayerInputs(
        question=t([9, 10, 11, 7]), question_req=t([0, 0, 0, 1]),
        local=t([1, 2, 4, 5]), local_doc=t([0, 0, 1, 2]),
        q_turn=turn_back(t([30, 31, 32, 20, 8, 9, 15, 12]), cache.to(device)),
        block_rows=block_rows.to(device),
        k_turn=turn_back((block_pos[:, None] + torch.arange(block)).flatten().to(device),
                         cache.to(device)),
        block_doc=t([0, 0, 0, 1, 1, 2, 2, 2]),
        doc_request=t([0, 0, 1]), doc_request_cpu=[0, 0, 1],
        block_first=[0, 3, 5, 8], kept_cpu=[1, 1, 2], num_requests=2, bias=True,
        question_count=t([3.0, 1.0]), local_count=t([2.0, 1.0, 1.0]),
        block_first_gpu=t([0, 3, 5]), kept_gpu=t([1, 1, 2]), is_neox=True,
    )  # fmt: skip
    return inputs, block_rows, block_pos, cache, (hq, h, d, block)


def test_layer_choice_matches_a_direct_computation():
    """``layer_choice`` on random tensors against the scores written out (two requests, one of
    them with two documents, the bias on)."""
    from redknot.recovery.samkv.served import layer_choice

    inputs, block_rows, block_pos, cache, (hq, h, d, block) = _layer_inputs()
    g = torch.Generator().manual_seed(1)
    q = torch.randn(12, hq, d, generator=g)
    region = torch.randn(40, h, d, generator=g)
    got = layer_choice(q, region, inputs)

    free = lambda x, p: rotate_back(x, torch.as_tensor(p), cache)
    generic = [free(q[[9, 10, 11]], [30, 31, 32]).mean(0), free(q[[7]], [20]).mean(0)]
    local = [free(q[[1, 2]], [8, 9]).mean(0), free(q[[4]], [15]).mean(0),
             free(q[[5]], [12]).mean(0)]  # fmt: skip
    pq = personalized_queries(generic[0][None], torch.stack(local[:2])[:, None])[:, 0]
    queries = [pq[0], pq[1], generic[1]]  # request 1 has one document: no bias
    want = []
    for doc, (first, end, kept) in enumerate([(0, 3, 1), (3, 5, 1), (5, 8, 2)]):
        scores = []
        for b in range(first, end):
            offs = int(block_pos[b]) + torch.arange(block)
            mean = free(region[block_rows[b]], offs).mean(0)
            scores.append(sum(float(queries[doc][i] @ mean[i // (hq // h)]) for i in range(hq)))
        best = sorted(range(end - first), key=lambda i: (-scores[i], i))[:kept]
        want += [(first + b) * block + t for b in sorted(best) for t in range(block)]
    assert got.tolist() == want


@pytest.mark.gpu
def test_the_choice_replayed_as_a_cuda_graph_equals_the_eager_choice_in_every_layer():
    """``ChoiceReplay``: captured at the first layer, replayed with each later layer's queries
    and keys; every layer's chosen rows and offsets equal :func:`layer_choice`'s."""
    from redknot.recovery.samkv.served import BatchChoice, ChoiceReplay, layer_choice

    inputs, _, _, _, (hq, h, d, _) = _layer_inputs("cuda")
    flat_rows = torch.arange(100, 116, device="cuda")
    flat_pos = torch.arange(16, device="cuda") * 3
    choice = BatchChoice(inputs, torch.arange(6, device="cuda"), flat_rows, flat_pos)
    replay = ChoiceReplay(choice)
    g = torch.Generator(device="cuda").manual_seed(2)
    seen = set()
    for _ in range(6):  # layers
        q = torch.randn(12, hq, d, generator=g, device="cuda", dtype=torch.bfloat16)
        region = torch.randn(40, h, d, generator=g, device="cuda", dtype=torch.bfloat16)
        rows, pos = replay(q, region)
        idx = layer_choice(q, region, inputs)
        assert torch.equal(rows, flat_rows[idx]) and torch.equal(pos, flat_pos[idx])
        seen.add(tuple(idx.tolist()))
    assert replay.graph is not None and len(seen) > 1  # the layers chose differently


def test_plan_batch_maps_each_documents_slots_among_the_reads_that_left():
    from types import SimpleNamespace

    from redknot.kernels.rope_reference import sglang_rope
    from redknot.recovery.samkv.served import plan_batch

    rope = sglang_rope(8, 8, 64, 10000.0, True).cos_sin_cache, True
    knobs = SamkvKnobs(block=2, budget=0.5, init_blocks=1, local_blocks=1, bias=True)
    plan = plan_documents(22, [(2, 12, "ns", "a")], knobs)  # 2 new, doc, 8 question
    (d,) = plan.docs
    entry = SimpleNamespace(rows_of=lambda offs: np.asarray(offs) + 100)
    use = SimpleNamespace(start=d.start, entry=entry, prompt_len=plan.served_tokens, doc=d)
    n = plan.served_tokens
    rows = np.arange(d.start, d.start + d.served_tokens)
    middle = torch.from_numpy((rows >= d.start + d.init) & (rows < d.start + d.init + d.slots))
    keep = torch.ones(n, dtype=torch.bool)
    keep[torch.from_numpy(rows)[middle]] = False
    read_tokens = torch.from_numpy(rows)
    choice, skipped = plan_batch([[use]], [0], [n], keep, read_tokens, middle, True, *rope, "cpu")
    assert skipped == [] and choice.slot_index.tolist() == list(range(d.slots))
    assert choice.inputs.kept_cpu == [d.kept_blocks] and choice.inputs.block_first == [0, 4]
    assert choice.flat_pos.tolist() == list(range(d.init, d.init + 8))
    held = torch.cumsum(keep.long(), 0) - 1
    q_rows = torch.arange(d.start + d.served_tokens, n)
    assert choice.inputs.question.tolist() == held[q_rows].tolist()
    # a retracted request's prefill again (two output tokens after its prompt) chooses too
    again, skipped = plan_batch(
        [[use]], [0], [n + 2], torch.cat([keep, torch.ones(2, dtype=torch.bool)]), read_tokens,
        middle, True, *rope, "cpu",
    )  # fmt: skip
    assert skipped == [] and again.inputs.question.numel() == q_rows.numel() + 2
    # an extend that starts inside the document keeps the cut's first blocks
    split, skipped = plan_batch([[use]], [d.start + 1], [n - d.start - 1], keep[d.start + 1 :],
                                read_tokens - d.start - 1, middle, True, *rope, "cpu")  # fmt: skip
    assert split is None and skipped == [0]
    assert isinstance(d, ServedDoc)
