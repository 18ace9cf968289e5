"""LFPS indexing kernels against their references under ``TRITON_INTERPRET=1``: scores of listed
keys and of every key (exact Top-k), and the fixed-capacity candidate list from score tables."""

from __future__ import annotations

import math

import pytest
import torch
import triton

from redknot.kernels.lfps_index import exact_topk, lfps_candidates, score_keys
from redknot.kernels.sparse_reference import exact_topk_reference, score_keys_reference
from redknot.kernels.triton.lfps_index import lfps_moments_kernel
from redknot.lfps import LfpsParams
from redknot.lfps.fixed_budget import candidates_reference, tables_by_position

from .paged_data import make_paged
from .test_sparse_decode import SINK, random_lists

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # numpy, in the interpreter

SEQ_LENS = [0, 3, 37, 150, 301]


def paged_case(grp, dim, dtype, seq_lens=SEQ_LENS, num_kv=2, device="cpu", seed=0):
    batch = make_paged(seq_lens, num_kv, dim, dtype, device=device, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(len(seq_lens), num_kv * grp, dim, generator=g).to(dtype).to(device)
    paged = (batch.req_to_token, batch.req_pool_indices, batch.seq_lens)
    return q, batch.k_buffer, paged


@pytest.mark.parametrize("group_max", [False, True])
@pytest.mark.parametrize(
    "grp,rows,dtype", [(4, 4, torch.bfloat16), (4, 1, torch.float16), (3, 3, torch.float16)]
)
def test_score_listed_keys(grp, rows, dtype, group_max):
    q, kb, paged = paged_case(grp, 32, dtype)
    idx = random_lists(SEQ_LENS, q.shape[1] // rows, 70, seed=5)
    scale = 1 / math.sqrt(32)
    got = score_keys(q, kb, *paged, idx, num_sink=SINK, sm_scale=scale, group_max=group_max)
    want = score_keys_reference(q, kb, *paged, idx, SINK, scale, group_max=group_max)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("rows", [4, 1])
def test_exact_topk_matches_reference(rows):
    q, kb, paged = paged_case(4, 16, torch.float16)
    scale = 0.25
    width = max(SEQ_LENS)
    got = exact_topk(q, kb, *paged, k=9, num_sink=SINK, sm_scale=scale, width=width, rows=rows)
    want = exact_topk_reference(q, kb, *paged, 9, SINK, scale, rows=rows)
    assert got.shape == (len(SEQ_LENS), q.shape[1] // rows, 9)
    for b in range(len(SEQ_LENS)):
        for h in range(got.shape[1]):
            assert set(got[b, h].tolist()) == set(want[b, h].tolist())
    assert (got[0] == -1).all() and (got[1] == -1).all()  # no non-sink key
    assert (got[2] >= SINK).all()


def random_tables(lens, heads, n_max, seed, power=6.0):
    """Sparse non-negative tables, zero past each row's covered keys and at the sinks."""
    g = torch.Generator().manual_seed(seed)
    B = len(lens)
    vert = torch.rand(B, heads, n_max, generator=g) ** power
    slash = torch.rand(B, heads, n_max, generator=g) ** power
    for b, n in enumerate(lens):
        vert[b, :, max(n - 1, 0) :] = 0
        slash[b, :, max(n - 1, 0) :] = 0
        vert[b, :, :SINK] = 0
    return vert, slash, torch.rand(B, heads, generator=g) + 0.5


@pytest.mark.parametrize("mark_gather", [False, True])
@pytest.mark.parametrize(
    "capacity,offsets,chunk,block",
    [(800, (-1, 0, 1, 2), 128, 32), (40, (-1, 0, 1, 2), 128, 32), (7, (-1, 0, 1, 2), 128, 32),
     (7, (0, 3), 128, 32), (40, (-3, 0, 5), 128, 16), (40, (-1, 0, 1, 2), 2048, 512),
     (7, (-1, 0, 1, 2), 2048, 512)],
)  # fmt: skip
def test_candidates_kernel_matches_rule(capacity, offsets, chunk, block, mark_gather):
    """Rows of 0 to 700 keys, in chunks of 128 (up to 6 per row, Eq. 9's shifts across chunk
    edges) or the default 2048, Eq. 9's shifts read again or gathered from overlapping windows
    (of 16 entries with a reach of 8: windows cross every chunk edge): the list and the count
    equal the PyTorch rule's, with and without overflow."""
    lens = [0, 3, 37, 301, 700]
    vert, slash, scale = random_tables(lens, 2, 720, seed=7)
    params = LfpsParams(lam=0.2, offsets=offsets)
    seq = torch.tensor(lens)
    got, count = lfps_candidates(vert, slash, scale, seq, params, capacity, chunk=chunk,
                                 block=block, mark_gather=mark_gather)  # fmt: skip
    want, want_count = candidates_reference(vert, slash, scale, seq, params, capacity)
    assert torch.equal(count, want_count)
    assert torch.equal(got, want)
    if capacity == 7:
        assert (count > capacity).any()


def test_mark_gather_needs_a_window_wider_than_the_offsets_reach():
    vert, slash, scale = random_tables([40], 2, 64, seed=1)
    params = LfpsParams(offsets=(-8, 0, 8))
    with pytest.raises(ValueError, match="reach 16"):
        lfps_candidates(vert, slash, scale, torch.tensor([40]), params, 8, chunk=16, block=16,
                        mark_gather=True)  # fmt: skip


@pytest.mark.parametrize("block", [32, 128])  # the chunk read once per pass, or once
def test_chunk_moments_match_float64(block):
    """The moments kernel (two passes in float32) against two passes in float64, per chunk of
    128: heavy-tailed tables whose stored values are large under a small scale (as between
    renormalisations), a constant chunk (central sums exactly 0), a row of zeros, a chunk cut by
    the row's end and chunks past it."""
    lens, chunk, sink = [0, 300, 700], 128, SINK
    vert, slash, _ = random_tables(lens, 2, 720, seed=11, power=8.0)
    vert, slash = vert * 1e6, slash * 1e6
    vert[2, 1, sink + 128 : sink + 256] = 3.0  # a constant chunk (entries 128-255)
    slash[2, 1, 700 - 1 - sink - 255 : 700 - sink - 128] = 7.0
    vert[1, 0], slash[1, 0] = 0.0, 0.0
    scale = torch.full((3, 2), 1e-6)
    chunks = triton.cdiv(720 - sink, chunk)
    moments = torch.empty(3, 2, chunks, 8)
    rows = torch.arange(3, dtype=torch.int32)
    seq = torch.tensor(lens)
    lfps_moments_kernel[(chunks, 2, 3)](
        vert, slash, scale, rows, seq, moments, sink, vert.stride(0), vert.stride(1),
        slash.stride(0), slash.stride(1), scale.stride(0), *moments.stride()[:3],
        CHUNK=chunk, BLOCK=block,
    )  # fmt: skip
    v, sl, _ = tables_by_position(vert, slash, scale, seq, sink)
    for b, n in enumerate(lens):
        m = max(n - sink, 0)
        for h in range(2):
            for c in range(chunks):
                lo, hi = c * chunk, min((c + 1) * chunk, m)
                for field, table in ((0, v), (4, sl)):
                    x = table[b, h, sink + lo : sink + hi].double()
                    if hi <= lo:
                        want = torch.zeros(4, dtype=torch.float64)
                    else:
                        d = x - x.mean()
                        want = torch.stack([x.mean(), *(d.pow(k).sum() for k in (2, 3, 4))])
                    got = moments[b, h, c, field : field + 4].double()
                    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-30)
    assert (moments[2, 1, 1, 1:4] == 0).all()  # the constant chunk


# ---- GPU: the 8B shape ------------------------------------------------------------------------


@pytest.mark.gpu
def test_indexing_gpu_8b_shape():
    q, kb, paged = paged_case(4, 128, torch.bfloat16, [1, 300, 4097, 32768, 20011], 8, "cuda")
    scale = 1 / math.sqrt(128)
    got = exact_topk(q, kb, *paged, k=600, num_sink=4, sm_scale=scale, width=32768, rows=4)
    want = exact_topk_reference(q, kb, *paged, 600, 4, scale, rows=4)
    same = [len(set(got[b, h].tolist()) & set(want[b, h].tolist())) for b in range(5)
            for h in range(8)]  # fmt: skip
    assert min(same[16:]) >= 590  # rows of >= 4097 keys; float near-ties may swap a few
    lens = [1, 300, 4097, 32768, 20011]
    vert, slash, tscale = random_tables(lens, 8, 32768, seed=7, power=12.0)
    vert, slash, tscale = vert.cuda(), slash.cuda(), tscale.cuda()
    params = LfpsParams()
    seq = torch.tensor(lens, device="cuda")
    for capacity in (4096, 300):
        got, count = lfps_candidates(vert, slash, tscale, seq, params, capacity)
        # the mark kernel's shifts gathered from its window: the same arithmetic, the same list
        gathered = lfps_candidates(vert, slash, tscale, seq, params, capacity, mark_gather=True)
        assert torch.equal(gathered[0], got) and torch.equal(gathered[1], count)
        want, want_count = candidates_reference(vert, slash, tscale, seq, params, capacity)
        # float sums in another order may move an entry across a threshold or a bin edge
        assert (count - want_count).abs().max() <= 2
        for b in range(len(lens)):
            for h in range(8):
                a, w = set(got[b, h].tolist()) - {-1}, set(want[b, h].tolist()) - {-1}
                assert len(a ^ w) <= 4, (b, h, len(a ^ w))
