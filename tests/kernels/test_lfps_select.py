"""LFPS's Top-K of the candidates' rank (``lfps_topk``, a radix select) against its PyTorch
reference ``rank_topk_in_list_order`` under ``TRITON_INTERPRET=1``: padding, each row's own
budget below K, ties at the cut, signed zeros, rows without a finite rank, rows in one block
(held in registers) or several, radix widths that divide 32 or not."""

from __future__ import annotations

import pytest
import torch

from redknot.kernels.lfps_step import lfps_topk
from redknot.lfps import LfpsParams
from redknot.lfps.batched import rank_topk_in_list_order, row_budgets

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # numpy, in the interpreter

SEQ_LENS = [0, 3, 40, 150, 700, 2000]


def ranks(B, Hs, C, seed):
    """Logit-like ranks with ``-inf`` tails (list padding), a row of equal values, a row of few
    distinct ones (ties at the cut), signed zeros, values far apart (every byte of the key
    matters) and one all ``-inf`` row."""
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(B, Hs, C, generator=g) * 3.0
    fill = torch.randint(0, C + 1, (B, Hs), generator=g)
    r = torch.where(torch.arange(C) < fill[..., None], r, float("-inf"))
    r[1, 0] = 0.5
    r[2, 0] = torch.randint(0, 4, (C,), generator=g).float() - 1.5
    r[2, 1, ::2] = 0.0
    r[2, 1, 1::4] = -0.0
    r[3, 0] = torch.ldexp(torch.ones(C), torch.randint(-60, 60, (C,), generator=g))
    r[3, 0, ::3] *= -1
    r[3, 1] = 1.0 + torch.randint(0, 3, (C,), generator=g) * 2.0**-23  # last byte only differs
    r[4, 1] = float("-inf")
    return r


@pytest.mark.parametrize("early_exit", [False, True])
@pytest.mark.parametrize("budget", [0.02, 0.1, 7, 1000])
@pytest.mark.parametrize(
    "C,K,block,bits", [(60, 12, 16, 6), (60, 12, None, 8), (50, 50, 64, 5), (300, 40, 128, 3)]
)  # one block (None: the default, 64 >= C), or several; 3 bits: the last pass overlaps
def test_topk_matches_reference(budget, C, K, block, bits, early_exit):
    B, Hs = len(SEQ_LENS), 2
    rank = ranks(B, Hs, C, seed=C + K)
    seq = torch.tensor(SEQ_LENS)
    params = LfpsParams(budget=budget)
    val, at = lfps_topk(rank, seq, params, K, block=block, radix_bits=bits, early_exit=early_exit)
    want_val, want_at = rank_topk_in_list_order(rank, row_budgets(seq, params), K)
    assert torch.equal(val, want_val) and torch.equal(at, want_at)
    kept = torch.isfinite(val).sum(-1)
    finite = torch.isfinite(rank).sum(-1)
    budgets = row_budgets(seq, params).clamp_max(K)[:, None]
    assert torch.equal(kept, torch.minimum(budgets, finite))  # each row's own budget
    assert (kept < K).any() and (kept[4, 1] == 0)


def test_reference_is_topk_without_ties():
    """Distinct ranks: the reference keeps ``torch.topk``'s set cut to each row's budget, by
    ascending index; with ties it keeps the lowest indices."""
    B, Hs, C, K = len(SEQ_LENS), 3, 80, 20
    g = torch.Generator().manual_seed(1)
    rank = torch.randperm(B * Hs * C, generator=g).float().view(B, Hs, C)
    rank[:, 1, 50:] = float("-inf")
    seq = torch.tensor(SEQ_LENS)
    params = LfpsParams(budget=0.01)
    budget = row_budgets(seq, params)
    val, at = rank_topk_in_list_order(rank, budget, K)
    top_val, top_at = torch.topk(rank, K, dim=-1)
    for b in range(B):
        for h in range(Hs):
            k = int(min(budget[b], K))
            want = sorted(int(i) for i, v in zip(top_at[b, h, :k], top_val[b, h, :k]) if v > -1)
            assert at[b, h, : len(want)].tolist() == want
            assert (val[b, h, len(want) :] == float("-inf")).all()
    ties = torch.zeros(1, 1, 10)
    ties[0, 0, 7] = 1.0
    _, at = rank_topk_in_list_order(ties, torch.tensor([4]), 4)
    assert at.tolist() == [[[0, 1, 2, 7]]]


# ---- GPU: the 8B shape ------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("early_exit", [False, True])
def test_topk_gpu_8b_shape(early_exit):
    """C = 10,484 candidates and K = 2,621 per selection head (128K keys, 2%), 8 requests of
    which some are shorter (smaller budgets), logits with ties: equal to the reference."""
    B, Hs, C, K = 8, 8, 10484, 2621
    rank = ranks(B, Hs, C, seed=3)
    rank[5] = torch.round(rank[5] * 4) / 4  # many ties at every cut
    seq = torch.tensor([131072, 4000, 100000, 131072, 20000, 131072, 7, 60000])
    params = LfpsParams(budget=0.02)
    val, at = lfps_topk(rank.cuda(), seq.cuda(), params, K, early_exit=early_exit)
    want_val, want_at = rank_topk_in_list_order(rank, row_budgets(seq, params), K)
    assert torch.equal(val.cpu(), want_val) and torch.equal(at.cpu(), want_at)


@pytest.mark.parametrize("C, width, block", [(50, 12, 16), (50, 50, 64), (300, 40, 32)])
def test_union_lists_every_marked_entry_in_list_order(C, width, block):
    """``lfps_union`` (interpreter) against ``rank_topk_in_list_order`` with a budget of
    ``width`` (what ``lfps_topk`` gives for it): rows with no, some, exactly ``width`` marked
    entries, marks in several blocks and after the last block's padding."""
    from redknot.kernels.lfps_step import lfps_union

    g = torch.Generator().manual_seed(C + width)
    B, Hs = 2, 3
    marks = torch.full((B, Hs, C), float("-inf"))
    for b in range(B):
        for h in range(Hs):
            n = [0, width // 2, width][(b * Hs + h) % 3]
            marks[b, h, torch.randperm(C, generator=g)[:n]] = 0.0
    val, at, filled = lfps_union(marks, width, block=block)
    want_val, want_at = rank_topk_in_list_order(marks, torch.full((B,), width), width)
    assert torch.equal(val, want_val) and torch.equal(at, want_at)
    assert torch.equal(filled, torch.isfinite(marks).sum(-1).int())
    assert int(torch.isfinite(val).sum()) == int(torch.isfinite(marks).sum())
