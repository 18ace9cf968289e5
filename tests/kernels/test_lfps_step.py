"""The per-head kernels of the LFPS step against their PyTorch references (``redknot.lfps
.batched``) under ``TRITON_INTERPRET=1``: Eq. 5-6 with the bypass output; the selection from
Top-k with Eq. 10; the rank written by ``score_and_rank``."""

from __future__ import annotations

import pytest
import torch

from redknot.kernels.lfps_index import score_and_rank
from redknot.kernels.lfps_step import (
    SelectedValues,
    lfps_select,
    lfps_sparsity,
    lfps_update,
)
from redknot.kernels.sparse_reference import score_keys_reference, sparse_decode_reference
from redknot.lfps import LfpsParams
from redknot.lfps.batched import head_sparsity, row_budgets, select_topk, update_tables_

from .paged_data import make_paged, random_lfps_state
from .test_sparse_decode import random_lists

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # numpy, in the interpreter

SEQ_LENS = [0, 3, 9, 40, 150]


@pytest.mark.parametrize("grp,dim,dtype", [(4, 32, torch.bfloat16), (3, 16, torch.float16)])
def test_sparsity_kernel_matches_reference(grp, dim, dtype):
    """Rows without keys, with fewer keys than sinks and longer ones; some with strong sinks;
    the threshold set so that both branches of Eq. 6 occur."""
    Hkv = 2
    batch = make_paged(SEQ_LENS, Hkv, dim, dtype, seed=3)
    for b, n in enumerate(SEQ_LENS):  # strong sinks in every other request
        if b % 2:
            slots = batch.req_to_token[int(batch.req_pool_indices[b]), : min(n, 4)].long()
            batch.k_buffer[slots] *= 3
    state = random_lfps_state(len(SEQ_LENS), Hkv * grp, Hkv, dim, 1, 160, seed=4)
    q = torch.randn(len(SEQ_LENS), Hkv * grp, dim, generator=torch.Generator().manual_seed(5))
    q = q.to(dtype)
    paged = (batch.req_to_token, batch.req_pool_indices, batch.seq_lens)
    want, want_out = head_sparsity(q, batch.k_buffer, batch.v_buffer, *paged, state,
                                   LfpsParams(), 1 / dim**0.5)  # fmt: skip
    # halfway between the two middle ratios: the median itself is one of them, and the kernel's
    # value of it, equal within rounding, fell on either side of it from one CPU to another
    middle = want[2:].flatten().sort().values
    tau = float(middle[len(middle) // 2 - 1 : len(middle) // 2 + 1].mean())
    assert middle[len(middle) // 2] - middle[len(middle) // 2 - 1] > 1e-3  # clear of rounding
    params = LfpsParams(sparsity_threshold=tau)
    got, bypass, got_out = lfps_sparsity(q, batch.k_buffer, batch.v_buffer, *paged, state,
                                         params, 1 / dim**0.5)  # fmt: skip
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    assert torch.equal(bypass, want > tau) and bypass.any() and not bypass.all()
    assert (got[:2] == 0).all()  # no non-sink key
    torch.testing.assert_close(got_out, want_out, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("block", [2, 8])
@pytest.mark.parametrize("budget", [0.1, 3])
@pytest.mark.parametrize("rows", [1, 4])
def test_select_update_kernel_matches_reference(rows, budget, block):
    """Lists with padding, query heads bypassing alone or as a whole group, per-row budgets
    below the width, the Top-K in one segment or in three (each head's softmax merged across
    them): the selection, the tables, the scales and the emptied lists agree."""
    B, Hq, Hkv, D, C, K, n_max = len(SEQ_LENS), 8, 2, 16, 24, 6, 160
    batch = make_paged(SEQ_LENS, Hkv, D, torch.float16, seed=6)
    q = torch.randn(B, Hq, D, generator=torch.Generator().manual_seed(7)).half()
    cand = random_lists(SEQ_LENS, Hq // rows, C, seed=8)
    paged = (batch.req_to_token, batch.req_pool_indices, batch.seq_lens)
    g = torch.Generator().manual_seed(9)
    bypass = torch.rand(B, Hq, generator=g) < 0.3
    bypass[3, :rows] = True  # a whole selection head off
    logits = score_keys_reference(q, batch.k_buffer, *paged, cand, 4, 0.25)
    rank = logits.masked_fill(bypass[..., None], float("-inf")).view(B, Hq // rows, rows, C)
    val, at = torch.topk(rank.amax(2), K, dim=-1)
    params = LfpsParams(budget=budget)
    state = random_lfps_state(B, Hq, Hkv, D, rows, n_max, seed=10)
    mine, ref = state.clone(), state.clone()
    cand_k, count_k = cand.clone(), torch.full((B, Hq // rows), 7, dtype=torch.int32)
    sel = lfps_select(val, at, cand_k, count_k, logits, bypass, batch.seq_lens, mine, params,
                      block=block)  # fmt: skip
    lfps_update(sel)
    selected = sel.selected
    want, want_logits = select_topk(logits, cand, bypass, row_budgets(batch.seq_lens, params), K)
    update_tables_(ref, want, want_logits, bypass, batch.seq_lens, params.decay)
    assert torch.equal(selected, want)
    torch.testing.assert_close(mine.scale, ref.scale)
    torch.testing.assert_close(mine.vertical, ref.vertical, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(mine.slash, ref.slash, atol=1e-6, rtol=1e-5)
    off = bypass.view(B, Hq // rows, rows).all(-1)
    assert off[3, 0] and (cand_k[off] == -1).all() and (count_k[off] == 0).all()
    assert torch.equal(cand_k[~off], cand[~off]) and (count_k[~off] == 7).all()
    assert (mine.vertical != state.vertical).any()


def attend_case(lens, rows, dtype, block, *, Hq=8, Hkv=2, D=32, C=24, K=6, device="cpu",
                direct=False):  # fmt: skip
    """The selection's attention through ``lfps_update`` (``direct``: values found through the
    selection's own positions, else through a list of them) and the reference of it; the tables
    after it and after the launch without values: ``(out, want, bypass, tables, plain)``.
    Query heads bypass alone and as a whole group (request 3's first selection head)."""
    B = len(lens)
    batch = make_paged(lens, Hkv, D, dtype, device=device, seed=21)
    q = torch.randn(B, Hq, D, generator=torch.Generator().manual_seed(22)).to(dtype).to(device)
    cand = random_lists(lens, Hq // rows, C, seed=23, device=device)
    paged = (batch.req_to_token, batch.req_pool_indices, batch.seq_lens)
    g = torch.Generator().manual_seed(24)
    bypass = torch.rand(B, Hq, generator=g) < 0.3
    bypass[3, :rows] = True
    bypass_out = torch.randn(B, Hq, D, generator=g).to(device)
    bypass = bypass.to(device)
    scale = 1 / D**0.5
    logits, rank = score_and_rank(q, batch.k_buffer, *paged, cand, bypass, num_sink=4,
                                  sm_scale=scale)  # fmt: skip
    val, at = torch.topk(rank, K, dim=-1)
    params = LfpsParams(budget=0.1)
    state = random_lfps_state(B, Hq, Hkv, D, rows, max(lens) + 10, seed=25).to(device)
    tables, plain = state.clone(), state.clone()
    count = torch.full((B, Hq // rows), 7, dtype=torch.int32, device=device)
    sel = lfps_select(val, at, cand.clone(), count.clone(), logits, bypass, batch.seq_lens,
                      tables, params, block=block)  # fmt: skip
    values = SelectedValues(q, batch.k_buffer, batch.v_buffer, *paged,
                            None if direct else sel.selected, scale, bypass_out)  # fmt: skip
    out = lfps_update(sel, values)
    want, _ = sparse_decode_reference(q, batch.k_buffer, batch.v_buffer, *paged, sel.selected,
                                      4, scale)  # fmt: skip
    want = torch.where(bypass[..., None], bypass_out.to(dtype), want)
    assert out.dtype == dtype and (sel.selected >= 0).any() and (~bypass).any()
    again = lfps_select(val, at, cand.clone(), count.clone(), logits, bypass, batch.seq_lens,
                        plain, params, block=block)  # fmt: skip
    assert lfps_update(again) is None
    return out, want, bypass, tables, plain


def same_adds(tables, plain) -> None:
    """The adds of the launch with values are those without (its head rows are padded to 16 for
    the product with the values, so the mean over them may round otherwise on a GPU)."""
    for a, b in ((tables.vertical, plain.vertical), (tables.slash, plain.slash)):
        torch.testing.assert_close(a, b, atol=1e-7, rtol=1e-6)
    assert torch.equal(tables.scale, plain.scale)


@pytest.mark.parametrize("block, direct", [(2, False), (16, True)])  # 3 segments (no tl.dot), 1
@pytest.mark.parametrize("rows, dtype", [(1, torch.float16), (4, torch.bfloat16)])
def test_update_attends_the_selection_as_the_sparse_attention(rows, dtype, block, direct):
    """``lfps_update`` with values: every head's output is the attention over its sinks and the
    selection (``sparse_decode_reference`` over ``sel.selected``), from the scoring's logits
    and the values alone; a bypassed head gets its bypass output, a row without keys 0; the
    tables get the same adds as without values. Rows without keys, shorter than the sinks,
    longer; query heads bypassing alone and as a whole group; one segment or several."""
    out, want, bypass, tables, plain = attend_case(SEQ_LENS, rows, dtype, block, direct=direct)
    # outputs near 2 in magnitude: 2 units in the last place of bf16 (the weights are rounded
    # to bf16 before the product, as the sparse attention rounds its own), 2 of fp16
    atol = 2e-2 if dtype == torch.bfloat16 else 2e-3
    torch.testing.assert_close(out.float(), want.float(), atol=atol, rtol=0)
    assert (out[0][~bypass[0]] == 0).all()  # no key: 0
    same_adds(tables, plain)


@pytest.mark.gpu
@pytest.mark.parametrize("rows, direct", [(1, False), (4, True)])
def test_update_attends_the_selection_gpu_8b_shape(rows, direct):
    """The same at the 8B head shape on the GPU: 32 query / 8 KV heads, D 128, bf16, Top-600
    of 4,096 candidates in segments of 256 (the step's launch)."""
    lens = [1, 300, 4097, 32768, 20011]
    out, want, _, tables, plain = attend_case(lens, rows, torch.bfloat16, 256, Hq=32, Hkv=8,
                                              D=128, C=4096, K=600, device="cuda",
                                              direct=direct)  # fmt: skip
    torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=0)
    same_adds(tables, plain)


@pytest.mark.parametrize("rows", [1, 4])
def test_score_and_rank(rows):
    B, Hq, Hkv, D = len(SEQ_LENS), 8, 2, 32
    batch = make_paged(SEQ_LENS, Hkv, D, torch.bfloat16, seed=11)
    q = torch.randn(B, Hq, D, generator=torch.Generator().manual_seed(12)).bfloat16()
    cand = random_lists(SEQ_LENS, Hq // rows, 40, seed=13)
    bypass = torch.rand(B, Hq, generator=torch.Generator().manual_seed(14)) < 0.4
    paged = (batch.req_to_token, batch.req_pool_indices, batch.seq_lens)
    logits, rank = score_and_rank(q, batch.k_buffer, *paged, cand, bypass, num_sink=4,
                                  sm_scale=0.2)  # fmt: skip
    want = score_keys_reference(q, batch.k_buffer, *paged, cand, 4, 0.2)
    want_rank = want.masked_fill(bypass[..., None], float("-inf"))
    want_rank = want_rank.view(B, Hq // rows, rows, -1).amax(2)
    torch.testing.assert_close(logits, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(rank, want_rank, atol=1e-4, rtol=1e-4)
