"""The ``samkv`` policy end to end on the tiny model: its exact limits (every block kept and
every token recomputed is the dense prefill; nothing recomputed is naive reuse), what its KV
holds, its ratios, and its fallbacks on bad input."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from redknot.recovery import ReusePrompt

from .conftest import compose, random_ids, serve_policy

BLOCK = {"samkv_block": 4, "samkv_stable_layers": 2}  # segments of 40 and 50: 7 and 9 blocks


def _close(out, want, atol=1e-4):
    torch.testing.assert_close(
        out.generation.first_logits, want.generation.first_logits, rtol=0, atol=atol
    )
    assert out.generation.tokens == want.generation.tokens


def test_every_block_kept_and_recomputed_is_full_prefill(runner, prompt, full):
    knobs = {**BLOCK, "samkv_budget": 1.0, "samkv_recompute": "all"}
    policy, out = serve_policy(runner, "samkv", prompt, **knobs)
    _close(out, full)
    assert out.fractions["sequence_ratio"] == 1.0 and out.fractions["recompute_ratio"] == 1.0
    dense = runner.forward(list(prompt.ids[: prompt.question_start]), logits_rows="none").kv
    ids, kv = policy.prepare(runner)  # a second preparation gives the same KV
    assert ids == list(prompt.ids[prompt.question_start :])
    for n in range(runner.shape.num_layers):
        torch.testing.assert_close(kv.keys[n], dense.keys[n], rtol=0, atol=1e-5)
        torch.testing.assert_close(kv.values[n], dense.values[n], rtol=0, atol=1e-5)
    # fusion (Eq. 4) mixes in the stale cache: the same work, not the dense result
    _, fused = serve_policy(runner, "samkv", prompt, **knobs, samkv_update="fusion")
    assert fused.fractions == out.fractions
    assert fused.flops.deviation > 0 and out.flops.deviation == 0  # the cosines are paid for
    assert not torch.equal(fused.generation.first_logits, full.generation.first_logits)


def test_token_max_scores_rank_blocks_by_their_best_token(runner, prompt, full):
    """``samkv_block_score="token-max"``: the policy's block scores are each block's best
    token's score under the document's query, and its exact limit is still the dense prefill."""
    from redknot.recovery.samkv import position_free, scores

    policy, _ = serve_policy(
        runner, "samkv", prompt, **BLOCK, samkv_budget=0.25, samkv_block_score="token-max"
    )
    mean_policy, _ = serve_policy(runner, "samkv", prompt, **BLOCK, samkv_budget=0.25)
    queries = policy.report.queries  # [D, N, Hq, d], personalized
    for d in policy.report.docs:
        if not d.sparsifiable:
            continue
        cache = prompt.segments[d.index].cache
        for n in range(runner.shape.num_layers):
            free = position_free(runner.model.rope, cache.keys[n], torch.arange(d.length))
            per_token = scores(queries[d.index, n], free)
            want = per_token[d.init : d.middle_end].view(d.num_blocks, d.block).amax(dim=1)
            got = policy.report.block_scores[d.index][n]
            torch.testing.assert_close(got, want.cpu(), rtol=1e-5, atol=1e-6)
    assert any(not torch.equal(a, b) for a, b in zip(policy.report.block_scores,
                                                     mean_policy.report.block_scores))  # fmt: skip
    knobs = {**BLOCK, "samkv_budget": 1.0, "samkv_recompute": "all"}
    _, out = serve_policy(runner, "samkv", prompt, **knobs, samkv_block_score="token-max")
    _close(out, full)


def test_attention_scores_are_the_questions_attention_written_out(runner, prompt, full):
    """``samkv_block_score="attention"``: per layer, each query head's softmax of each question
    token (at its prompt position) over every document's cached keys (at theirs), looped; a
    block's score is its tokens' mean attention summed over heads and question tokens, the
    anchors' likewise. Its exact limit is still the dense prefill."""
    policy, _ = serve_policy(
        runner, "samkv", prompt, **BLOCK, samkv_budget=0.25, samkv_block_score="attention"
    )
    rope, docs = runner.model.rope, policy.report.docs
    group = runner.shape.num_attention_heads // runner.shape.num_kv_heads
    for n in range(runner.shape.num_layers):
        q_prompt = policy._question_q[n]  # [Hq, T, d] at the question's prompt positions
        keys = []
        for d in docs:
            k = prompt.segments[d.index].cache.keys[n].float()
            keys += [rope.realign(k[:, j : j + 1], torch.tensor([j]), torch.tensor([d.start + j]))
                     for j in range(d.length)]  # fmt: skip
        keys = torch.cat(keys, dim=1)  # [Hkv, sum n, d]
        mass = torch.zeros(keys.shape[1])
        for h in range(q_prompt.shape[0]):
            for t in range(q_prompt.shape[1]):
                q = q_prompt[h, t]
                logits = keys[h // group] @ q / q.shape[0] ** 0.5
                mass += torch.softmax(logits, dim=0)
        for d, part in zip(docs, torch.split(mass, [d.length for d in docs])):
            if not d.sparsifiable:
                continue
            want = part[d.init : d.middle_end].view(d.num_blocks, d.block).mean(dim=1)
            got = policy.report.block_scores[d.index][n]
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    knobs = {**BLOCK, "samkv_budget": 1.0, "samkv_recompute": "all"}
    _, out = serve_policy(runner, "samkv", prompt, **knobs, samkv_block_score="attention")
    _close(out, full)


def test_documents_all_anchor_and_selective_recompute_is_full_prefill(runner, prompt, full):
    policy, out = serve_policy(runner, "samkv", prompt, samkv_block=64)  # no middle block anywhere
    _close(out, full)
    assert len(policy.notes) == 2 and "too short" in policy.notes[0]
    assert out.fractions["sequence_ratio"] == 1.0


def test_nothing_recomputed_with_every_block_is_naive_reuse(runner, prompt):
    _, naive = serve_policy(runner, "naive", prompt)
    for update in ("overwrite", "fusion"):
        _, out = serve_policy(
            runner, "samkv", prompt, **BLOCK, samkv_budget=1.0, samkv_recompute="none",
            samkv_update=update,
        )  # fmt: skip
        _close(out, naive)
        assert out.fractions["recompute_ratio"] == 0.0


def test_kv_holds_anchors_and_kept_blocks_at_dense_positions(runner, prompt):
    policy, out = serve_policy(
        runner, "samkv", prompt, **BLOCK, samkv_recompute="none", samkv_budget=0.25
    )
    _, kv = policy.prepare(runner)
    sel = policy.report.selection
    docs = policy.report.docs
    anchors = sum(int(d.anchor_mask().sum()) for d in docs)
    kept_blocks = sel.per_layer
    assert kept_blocks == 4  # ceil(0.25 * 16 middle blocks)
    new_rows = prompt.question_start - sum(d.length for d in docs)
    assert kv.length == new_rows + anchors + 4 * kept_blocks
    seq = (anchors + 4 * kept_blocks) / 90
    assert out.fractions["sequence_ratio"] == pytest.approx(seq)
    rope = runner.model.rope
    for n in range(runner.shape.num_layers):
        rows = []  # the prompt rows this layer keeps, in order
        for r in range(prompt.question_start):
            doc = next((d for d in docs if d.start <= r < d.end), None)
            if (
                doc is None
                or doc.anchor_mask()[r - doc.start]
                or sel.kept[doc.index][n, doc.block_of()[r - doc.start]]
            ):
                rows.append((r, doc))
        assert len(rows) == kv.length
        for j, (r, doc) in enumerate(rows):
            if doc is None:
                continue  # new text: computed
            cache = prompt.segments[doc.index].cache
            off = torch.tensor([r - doc.start])
            want = rope.realign(cache.keys[n][:, off], off, torch.tensor([j]))
            torch.testing.assert_close(kv.keys[n][:, j : j + 1], want, rtol=0, atol=1e-5)
            torch.testing.assert_close(kv.values[n][:, j], cache.values[n][:, r - doc.start])


def test_adaptive_selection_costs_less_and_reports_its_ratios(runner, prompt, full):
    policy, out = serve_policy(runner, "samkv", prompt, **BLOCK)
    sel = policy.report.selection
    assert 0.0 <= float(sel.ratios.min()) and float(sel.ratios.max()) <= 1.0
    f = out.fractions
    assert 0.0 < f["sequence_ratio"] < 1.0 and 0.0 < f["recompute_ratio"] < f["sequence_ratio"]
    assert out.flops.total < full.flops.total
    assert out.flops.probe > 0  # block scores are paid for
    assert len(out.generation.tokens) == 6
    # the personalized bias changes the queries, hence (here) the choice or the ratios
    p2, _ = serve_policy(runner, "samkv", prompt, **BLOCK, samkv_bias=False)
    changed = not torch.equal(p2.report.selection.layer_ratios, sel.layer_ratios)
    assert changed or any(not torch.equal(a, b) for a, b in zip(p2.report.selection.kept, sel.kept))


def test_one_document_degrades_to_single_context_selection(runner, caplog):
    prompt = compose(
        runner, [("new", random_ids(5, 7)), ("seg", random_ids(60, 8)), ("new", random_ids(9, 9))]
    )
    with caplog.at_level(logging.INFO, logger="redknot.recovery.samkv.policy"):
        policy, out = serve_policy(runner, "samkv", prompt, **BLOCK)
    assert any("one document" in r.getMessage() for r in caplog.records)
    sel = policy.report.selection
    assert sel.per_layer == sel.retrieved[0]  # keeps all it retrieves
    assert len(out.generation.tokens) == 6


@pytest.mark.parametrize(
    "pieces,reason",
    [
        ([("new", [5, 6, 7, 8])], "no cached document"),
        ([("new", [5, 6]), ("seg", list(range(10, 40)))], "nothing follows the last document"),
    ],
)
def test_prompts_it_cannot_sparsify_get_a_dense_prefill(runner, pieces, reason, caplog):
    prompt = compose(runner, pieces)
    with caplog.at_level(logging.INFO, logger="redknot.recovery.samkv.policy"):
        policy, out = serve_policy(runner, "samkv", prompt, **BLOCK)
    assert reason in policy.notes[0] and any(reason in r.getMessage() for r in caplog.records)
    _, full = serve_policy(runner, "full", prompt)
    assert torch.equal(out.generation.first_logits, full.generation.first_logits)


def test_a_prefix_hit_and_an_uncached_document_are_kept_whole(runner, prompt, full):
    """The first rows served as an exact-prefix hit; the first document left uncached (new
    text to the policy): the exact limit still holds."""
    prefix = runner.forward(list(prompt.ids[:4]), logits_rows="none").kv
    mixed = ReusePrompt(prompt.ids, prompt.segments[1:], prefix)  # document 1 uncached
    knobs = {**BLOCK, "samkv_budget": 1.0, "samkv_recompute": "all"}
    _, out = serve_policy(runner, "samkv", mixed, **knobs)
    _close(out, full)
    policy, out = serve_policy(runner, "samkv", mixed, **BLOCK, samkv_budget=0.0)
    assert out.fractions["sequence_ratio"] == pytest.approx(
        int(policy.report.docs[0].anchor_mask().sum()) / 50
    )


def test_the_server_rules_on_the_reference_path_keep_each_documents_share(runner, prompt):
    """``samkv_spread document`` with ``samkv_recompute anchors`` (the server's rules): every
    layer keeps each document's own ``ceil(budget * M_i)`` blocks and recomputes its anchors
    only; with the whole budget nothing is dropped."""
    policy, _ = serve_policy(runner, "samkv", prompt, **BLOCK, samkv_budget=0.25,
                             samkv_spread="document", samkv_recompute="anchors")  # fmt: skip
    report = policy.report
    for d, kept in zip(report.docs, policy.report.selection.kept):
        if d.num_blocks:
            assert (kept.sum(dim=1) == math.ceil(0.25 * d.num_blocks)).all()
    anchors = sum(int(d.anchor_mask().sum()) for d in report.docs)
    assert all(r == anchors for r in report.recomputed)  # every layer: the anchors only


def test_stable_from_chooses_the_layers_eq3_averages(runner, prompt):
    """``samkv_stable_from`` places ``N*``; not given, the last layers; the report keeps every
    layer's block scores (what appendix A.2's calibration reads)."""
    n = runner.shape.num_layers
    for start, rows in ((0, slice(0, 2)), (None, slice(n - 2, n))):
        policy, _ = serve_policy(runner, "samkv", prompt, **BLOCK, samkv_stable_from=start)
        sel = policy.report.selection
        torch.testing.assert_close(sel.ratios, sel.layer_ratios[rows].mean(dim=0))
        assert len(policy.report.block_scores) == len(policy.report.docs)
        assert all(s.shape[0] == n for s in policy.report.block_scores)
    with pytest.raises(ValueError, match="exceeds the model's"):
        serve_policy(runner, "samkv", prompt, **BLOCK, samkv_stable_from=n - 1)
