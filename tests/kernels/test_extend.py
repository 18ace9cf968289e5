"""SegPagedAttention extend (chunked prefill over a cached prefix) against the PyTorch reference.

On the CPU the kernel runs under ``TRITON_INTERPRET=1`` (see conftest.py) at small shapes with
small tiles, so that prefix tails, causal edges and sink/window edges all occur.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from redknot.kernels import extend as extend_mod
from redknot.kernels.extend import (
    ExtendConfig,
    choose_extend_splits,
    gather_tiles,
    plan_extend,
    run_extend,
)
from redknot.kernels.geometry import num_sms
from redknot.kernels.reference import extend_reference

from .segpaged_data import make_batch, make_geometry, with_restore

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # numpy, in the interpreter

SMALL = ExtendConfig(block_m=16, block_n=16)
SINK, WINDOW = 3, 13
# (prefix, new tokens) per request: no prefix, a request with nothing new, one token, prefixes
# shorter and longer than sink + window (and past a ring's wrap-around), odd lengths
REQUESTS = [(0, 21), (7, 0), (30, 1), (5, 9), (61, 18), (16, 33)]

CASES = [  # classes, group size, head_dim, dtype, local mode
    ("GLLG", 1, 64, torch.float16, "token_table"),
    ("LGLL", 4, 128, torch.bfloat16, "ring"),
    ("LLLL", 8, 64, torch.bfloat16, "token_table"),  # no global head
    ("GGGG", 4, 64, torch.float16, "ring"),  # no local head
    ("LLLG", 8, 128, torch.float16, "ring"),
    ("LLGL", 1, 128, torch.bfloat16, "token_table"),
    ("LGL", 3, 64, torch.bfloat16, "ring"),  # a group that does not divide the tile (SmolLM2)
]


def _close(out: torch.Tensor, ref: torch.Tensor) -> None:
    tol = 2e-2 if out.dtype == torch.bfloat16 else 4e-3
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


def _run_case(classes, grp, dim, dtype, mode, requests, device, config, sink=SINK,
              window=WINDOW, seed=0, ring_extra=3, rows=None, num_splits=None):  # fmt: skip
    """Kernel and reference outputs and LSEs; with ``rows`` (batch rows) the kernel runs a
    gathered plan over them only (queries and outputs of those rows) and the outputs are placed
    at their batch rows, the other rows holding 7.0."""
    geo, layout = make_geometry(classes, grp, dim, sink, window, mode, ring_extra=ring_extra)
    prefix = [p for p, _ in requests]
    lens = [e for _, e in requests]
    batch, _, _ = make_batch(geo, layout, prefix, dtype, device, seed=seed)
    T, H = sum(lens), geo.num_kv_heads
    g = torch.Generator().manual_seed(seed + 1)
    # q, k, v as strided views of one projection output, as SGLang passes them
    qkv = torch.randn(T, geo.num_q_heads + 2 * H, dim, generator=g).to(dtype).to(device)
    q, k_new, v_new = qkv.split([geo.num_q_heads, H, H], dim=1)
    plan = plan_extend(geo, batch.req_pool_indices, prefix, lens, config=config)
    q_in = q
    if rows is not None:
        plan = gather_tiles(plan, rows.to(device), _counts(rows, lens))
        q_in = q[rows.to(device)]
    lse = torch.full((q_in.shape[0], geo.num_q_heads), 7.0, device=device)
    out = run_extend(
        plan, q_in, k_new, v_new, batch.k_global, batch.v_global, batch.k_local, batch.v_local,
        batch.req_to_token, batch.heads, 0.125, lse=lse, out=torch.full_like(q_in, 7.0),
        num_splits=num_splits,
    )  # fmt: skip
    if rows is not None:
        assert (out != 7.0).any(-1).all() and (lse != 7.0).all(), "a listed row was not written"
        out, lse = _place(out, rows, T), _place(lse, rows, T)
    ref_out, ref_lse = extend_reference(
        q, k_new, v_new, batch.k_global, batch.v_global, batch.k_local, batch.v_local,
        batch.req_to_token, batch.req_pool_indices, torch.tensor(prefix), plan.qo_indptr_cpu,
        batch.heads, geo, 0.125,
    )  # fmt: skip
    return out, lse, ref_out, ref_lse


def _counts(rows: torch.Tensor, lens: list[int]) -> list[int]:
    """Rows of each request among the batch rows ``rows``."""
    ends = torch.tensor(lens).cumsum(0)
    return torch.bincount(torch.searchsorted(ends, rows.cpu(), right=True),
                          minlength=len(lens)).tolist()  # fmt: skip


def _place(x: torch.Tensor, rows: torch.Tensor, T: int) -> torch.Tensor:
    """The listed rows ``x`` at their batch rows of a ``[T, ...]`` tensor of 7.0."""
    full = torch.full((T, *x.shape[1:]), 7.0, dtype=x.dtype, device=x.device)
    full[rows.to(x.device)] = x
    return full


@pytest.mark.parametrize("classes,grp,dim,dtype,mode", CASES)
def test_extend_matches_reference(classes, grp, dim, dtype, mode):
    out, lse, ref_out, ref_lse = _run_case(classes, grp, dim, dtype, mode, REQUESTS, "cpu", SMALL)
    assert torch.isfinite(out.float()).all()
    _close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse, atol=1e-3, rtol=1e-3)


def test_extend_prefill_without_prefix_and_empty_requests():
    """Plain prefill (every prefix 0), requests with no new token first and last."""
    requests = [(0, 0), (0, 37), (0, 1), (0, 16), (0, 0)]
    out, lse, ref_out, ref_lse = _run_case(
        "GLLL", 4, 64, torch.float16, "ring", requests, "cpu", SMALL
    )
    _close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse, atol=1e-3, rtol=1e-3)


def test_extend_no_sink():
    out, _, ref_out, _ = _run_case(
        "LGLL", 4, 64, torch.float16, "ring", REQUESTS, "cpu", SMALL, sink=0, window=8
    )
    _close(out, ref_out)


def test_extend_larger_tiles():
    """Tiles larger than the window, as the GPU tuning uses."""
    out, _, ref_out, _ = _run_case(
        "LGLG", 4, 64, torch.bfloat16, "token_table", REQUESTS, "cpu",
        ExtendConfig(block_m=64, block_n=32),
    )  # fmt: skip
    _close(out, ref_out)


@pytest.mark.parametrize("mode", ["token_table", "ring"])
def test_extend_window_spanning_several_blocks(mode):
    """A window of several key blocks: local rows also take the unmasked path."""
    requests = [(0, 70), (50, 31), (9, 44), (100, 5)]
    out, lse, ref_out, ref_lse = _run_case(
        "LGLL", 4, 64, torch.float16, mode, requests, "cpu", ExtendConfig(block_m=16, block_n=8),
        sink=5, window=37,
    )  # fmt: skip
    _close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse, atol=1e-3, rtol=1e-3)


def _two_group_batch(dtype, seed):
    """REQUESTS over "GLLG" with groups of 2 (ring mode), random q/k/v and the SMALL plan:
    (q, k_new, v_new, plan, stores, heads)."""
    geo, layout = make_geometry("GLLG", 2, 64, SINK, WINDOW, "ring")
    prefix, lens = [p for p, _ in REQUESTS], [e for _, e in REQUESTS]
    batch, _, _ = make_batch(geo, layout, prefix, dtype, "cpu", seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    q, k_new, v_new = (torch.randn(sum(lens), n, 64, generator=g).to(dtype) for n in (8, 4, 4))
    plan = plan_extend(geo, batch.req_pool_indices, prefix, lens, config=SMALL)
    stores = (batch.k_global, batch.v_global, batch.k_local, batch.v_local, batch.req_to_token)
    return q, k_new, v_new, plan, stores, batch.heads


def test_extend_skip_global_writes_only_local_rows():
    """``skip_global`` (FlashInfer fills the global rows) leaves the global query heads as they
    were and computes the local ones exactly as a full run does."""
    q, k_new, v_new, plan, stores, heads = _two_group_batch(torch.float16, seed=3)
    full = run_extend(plan, q, k_new, v_new, *stores, heads, 0.125)
    out = torch.full_like(q, 7.0)
    run_extend(plan, q, k_new, v_new, *stores, heads, 0.125, out=out, skip_global=True)
    q_of = lambda hs: [h * 2 + i for h in hs for i in range(2)]
    assert (out[:, q_of([0, 3])] == 7.0).all()
    torch.testing.assert_close(out[:, q_of([1, 2])], full[:, q_of([1, 2])], atol=0, rtol=0)


def test_extend_plan_orders_heavy_tiles_first():
    geo, _ = make_geometry("GL", 4, 64, SINK, WINDOW, "token_table")
    plan = plan_extend(geo, torch.arange(3), [0, 100, 5], [9, 3, 0], config=SMALL)
    bq = SMALL.block_q(4)
    work = [
        int(plan.prefix_lens_cpu[b]) + int(t0) + bq
        for b, t0 in zip(plan.tile_req_cpu.tolist(), plan.tile_start_cpu.tolist())
    ]
    assert work == sorted(work, reverse=True)
    assert plan.num_tiles == 3 + 1  # ceil(9 / 4) + ceil(3 / 4)
    assert plan.qo_indptr_cpu.tolist() == [0, 9, 12, 12]


def _scattered_rows(lens: list[int], seed: int) -> torch.Tensor:
    """Batch rows in recovery as the runner holds them: a random third of the rows, every
    request's last row, a run of consecutive rows (a question) and rows far apart."""
    g = torch.Generator().manual_seed(seed)
    T = sum(lens)
    keep = torch.rand(T, generator=g) < 0.3
    ends = torch.tensor(lens).cumsum(0)
    keep[ends[torch.tensor(lens) > 0] - 1] = True
    keep[T // 2 : T // 2 + 11] = True
    keep[1] = False
    return keep.nonzero().squeeze(1)


@pytest.mark.parametrize("classes,grp,dim,dtype,mode", CASES)
def test_extend_gathered_rows_match_reference(classes, grp, dim, dtype, mode):
    """A plan over scattered rows (packed into tiles whatever their distance) computes every
    one of those rows as the reference does."""
    rows = _scattered_rows([e for _, e in REQUESTS], seed=len(classes) * grp + dim)
    out, lse, ref_out, ref_lse = _run_case(
        classes, grp, dim, dtype, mode, REQUESTS, "cpu", SMALL, rows=rows
    )
    _close(out[rows], ref_out[rows])
    torch.testing.assert_close(lse[rows], ref_lse[rows], atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("mode", ["token_table", "ring"])
def test_extend_gathered_rows_window_spanning_several_blocks(mode):
    """Gathered tiles whose rows lie further apart than the window: local rows take the sink,
    edge, unmasked and diagonal loops from the tile's first and last row."""
    requests = [(0, 70), (50, 31), (9, 44), (100, 5)]
    rows = torch.tensor([0, 2, 3, 40, 69, 70, 71, 100, 101, 110, 140, 144, 145, 149])
    out, lse, ref_out, ref_lse = _run_case(
        "LGLL", 4, 64, torch.float16, mode, requests, "cpu", ExtendConfig(block_m=16, block_n=8),
        sink=5, window=37, rows=rows,
    )  # fmt: skip
    _close(out[rows], ref_out[rows])
    torch.testing.assert_close(lse[rows], ref_lse[rows], atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("num_splits", [2, 3, 7])
@pytest.mark.parametrize("classes,grp,dim,dtype,mode", CASES[:3] + CASES[4:5])
def test_extend_split_keys_match_reference(classes, grp, dim, dtype, mode, num_splits):
    """Global rows' keys split into runs (some runs empty: a row of a few blocks, more runs
    than blocks), merged: the same output and LSE as the reference, also over gathered rows."""
    out, lse, ref_out, ref_lse = _run_case(
        classes, grp, dim, dtype, mode, REQUESTS, "cpu", SMALL, num_splits=num_splits
    )
    _close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse, atol=1e-3, rtol=1e-3)
    rows = _scattered_rows([e for _, e in REQUESTS], seed=num_splits)
    out, lse, ref_out, ref_lse = _run_case(
        classes, grp, dim, dtype, mode, REQUESTS, "cpu", SMALL, rows=rows, num_splits=num_splits
    )
    _close(out[rows], ref_out[rows])
    torch.testing.assert_close(lse[rows], ref_lse[rows], atol=1e-3, rtol=1e-3)


def test_extend_split_keys_without_lse_and_window_blocks():
    """Split runs merged without an LSE output, with windows of several blocks and a long
    prefix (cache, new and diagonal blocks each cut by a run boundary); then over gathered rows
    further apart than the window, with the LSE (also the lowering test's gathered launch)."""
    requests = [(0, 70), (150, 31), (9, 44), (100, 5)]
    geo, layout = make_geometry("LGLG", 4, 64, 5, 37, "ring", ring_extra=3)
    cfg = ExtendConfig(block_m=16, block_n=16)  # blocks a GPU compiles (the lowering test)
    prefix, lens = [p for p, _ in requests], [e for _, e in requests]
    batch, _, _ = make_batch(geo, layout, prefix, torch.float16, "cpu", seed=3)
    T, H = sum(lens), geo.num_kv_heads
    qkv = torch.randn(T, geo.num_q_heads + 2 * H, 64, generator=torch.Generator().manual_seed(4))
    q, k_new, v_new = qkv.half().split([geo.num_q_heads, H, H], dim=1)
    plan = plan_extend(geo, batch.req_pool_indices, prefix, lens, config=cfg)
    stores = (batch.k_global, batch.v_global, batch.k_local, batch.v_local, batch.req_to_token)
    whole = run_extend(plan, q, k_new, v_new, *stores, batch.heads, 0.125, num_splits=1)
    for splits in (4, 5):
        split = run_extend(plan, q, k_new, v_new, *stores, batch.heads, 0.125, num_splits=splits)
        _close(split, whole)
    ref_out, ref_lse = extend_reference(
        q, k_new, v_new, *stores, batch.req_pool_indices, torch.tensor(prefix),
        plan.qo_indptr_cpu, batch.heads, geo, 0.125,
    )  # fmt: skip
    _close(whole, ref_out)
    # rows further apart than the window, gathered: local heads skip the blocks between them
    rows = torch.tensor([0, 1, 40, 69, 70, 100, 101, 110, 140, 144, 145, 149])
    gathered = gather_tiles(plan, rows, _counts(rows, lens))
    lse = torch.empty(rows.numel(), geo.num_q_heads)
    out = run_extend(gathered, q[rows], k_new, v_new, *stores, batch.heads, 0.125, lse=lse,
                     num_splits=3)  # fmt: skip
    _close(out, ref_out[rows])
    torch.testing.assert_close(lse, ref_lse[rows], atol=1e-3, rtol=1e-3)
    # each tile's last run zeroed its counter again: the next launch starts from zero
    assert all(int(c.abs().sum()) == 0 for c in extend_mod._COUNTERS.values())


def test_choose_extend_splits():
    """No split while the global tiles fill the GPU, without global heads, or for short rows;
    otherwise enough runs to fill it, each of min_split_keys keys at least, within the caps,
    rounded down to a power of two."""
    plan = _two_group_batch(torch.bfloat16, seed=5)[3]  # 2 global heads, max keys 79
    cfg = ExtendConfig(block_m=16, block_n=16, min_split_keys=8)
    plan = replace(plan, config=cfg)
    tiles = plan.num_tiles
    assert choose_extend_splits(plan, 0, 132) == 1
    assert choose_extend_splits(plan, 2, tiles) == 1  # 2 * tiles programs: twice the SMs
    assert choose_extend_splits(plan, 2, 8 * tiles) == 4  # 1 program per SM wanted
    assert choose_extend_splits(plan, 2, 1000) == 8  # 79 // 8 keys of the longest row, to 2^k
    assert choose_extend_splits(replace(plan, config=replace(cfg, max_splits=3)), 2, 1000) == 2
    small = replace(cfg, max_split_bytes=4 * plan.num_rows * 2 * 2 * 65 * 2)
    assert choose_extend_splits(replace(plan, config=small), 2, 1000) == 2
    assert (
        choose_extend_splits(replace(plan, config=replace(cfg, min_split_keys=512)), 2, 1000) == 1
    )


def test_gather_tiles_packs_each_requests_rows():
    """Brute force: each request's rows in order, ``block_q`` per tile, no tile for a request
    without rows; a request's later tiles before its earlier ones, and the tiles of the request
    with the most keys (prefix + new tokens) before those of the others."""
    plan = _two_group_batch(torch.bfloat16, seed=5)[3]
    lens = [e for _, e in REQUESTS]
    rows = torch.tensor([0, 5, 21, 23, 40, 41, 42, 43, 44, 45, 79, sum(lens) - 1])
    counts = _counts(rows, lens)
    gathered = gather_tiles(plan, rows, counts)
    bq = SMALL.block_q(2)
    indptr = plan.qo_indptr_cpu.tolist()
    per_req = [[r for r in rows.tolist() if indptr[b] <= r < indptr[b + 1]]
               for b in range(len(lens))]  # fmt: skip
    want = {(b, t0) for b, toks in enumerate(per_req) for t0 in range(0, len(toks), bq)}
    tiles = list(zip(gathered.tile_req_cpu.tolist(), gathered.tile_start_cpu.tolist()))
    assert set(tiles) == want and len(tiles) == len(want)
    assert gathered.num_tiles < plan.num_tiles and gathered.num_rows == rows.numel()
    assert gathered.rows_gpu is rows
    starts = gathered.rows_indptr_gpu.tolist()
    assert starts == gathered.rows_indptr_cpu.tolist() == [0, *torch.tensor(counts).cumsum(0)]
    assert [rows[starts[b] : starts[b + 1]].tolist() for b in range(len(lens))] == per_req
    for b in range(len(lens)):  # a request's tiles: later ones first
        mine = [t0 for r, t0 in tiles if r == b]
        assert mine == sorted(mine, reverse=True)
    keys = [REQUESTS[b][0] + REQUESTS[b][1] for b, _ in tiles]
    firsts = [keys[i] for i, (b, t0) in enumerate(tiles) if t0 + bq >= len(per_req[b])]
    assert firsts == sorted(firsts, reverse=True)  # each request's last tile, heaviest first
    with pytest.raises(AssertionError):
        gather_tiles(plan, rows, counts[:-1])


@pytest.mark.parametrize("num_rows", [1, 5, 9, 13, 17, 30])  # 1 to 4 tiles and more
def test_gather_tiles_device_tables_start_16_byte_aligned(num_rows):
    """Triton specialises on each pointer's 16-byte alignment: every table of a gathered plan
    starts aligned whatever the tile count, so one compiled variant serves every batch."""
    plan = _two_group_batch(torch.bfloat16, seed=5)[3]
    rows = torch.arange(num_rows)  # the first request's rows
    counts = [num_rows] + [0] * (plan.batch_size - 1)
    gathered = gather_tiles(plan, rows, counts)
    tables = (gathered.tile_req_gpu, gathered.tile_start_gpu, gathered.rows_indptr_gpu)
    assert all(t.data_ptr() % 16 == 0 for t in tables), [t.data_ptr() % 16 for t in tables]
    assert gathered.tile_start_cpu.tolist() == sorted(range(0, num_rows, SMALL.block_q(2)))[::-1]


# ---- GPU: real shapes -------------------------------------------------------------------------

LLAMA = "GLLLLLLL"  # 8 KV heads, 1 global; 32 query heads


def _llama_case(classes, mode, requests, rows=None):
    """:func:`_run_case` on the GPU at the Llama-3.1-8B attention shape (groups of 4, head_dim
    128, bf16, sink 64 + window 256) with the tuned launch settings."""
    return _run_case(classes, 4, 128, torch.bfloat16, mode, requests, "cuda", ExtendConfig(),
                     sink=64, window=256, ring_extra=64, rows=rows)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["token_table", "ring"])
@pytest.mark.parametrize("classes", [LLAMA, "GLGLGGLL", "LLLLLLLL", "GGGGGGGG"])
def test_extend_gpu_llama_shape(classes, mode):
    requests = [(0, 4099), (20000, 1000), (300, 0), (5, 700), (321, 1)]
    out, lse, ref_out, ref_lse = _llama_case(classes, mode, requests)
    _close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse, atol=2e-3, rtol=2e-3)


@pytest.mark.gpu
def test_extend_gpu_gathered_rows():
    """A gathered plan at the Llama shape: a 15% choice of scattered rows (CacheBlend's) and a
    question at the end, over a cached prefix."""
    requests = [(0, 8192), (3000, 2048), (5, 1)]
    rows = _scattered_rows([e for _, e in requests], seed=11)
    rows = rows[(torch.arange(rows.numel()) % 2 == 0) | (rows >= 8192)]
    out, lse, ref_out, ref_lse = _llama_case(LLAMA, "ring", requests, rows=rows)
    rows = rows.cuda()
    _close(out[rows], ref_out[rows])
    torch.testing.assert_close(lse[rows], ref_lse[rows], atol=2e-3, rtol=2e-3)


@pytest.mark.gpu
def test_extend_gpu_prefill_32k():
    out, _, ref_out, _ = _llama_case(LLAMA, "ring", [(0, 32768)])
    _close(out, ref_out)


@pytest.mark.gpu
@pytest.mark.parametrize("gathered", [False, True])
def test_extend_gpu_promoted_heads_llama_shape(gathered):
    """Adaptive restore at the Llama shape: requests promoting one or two local heads (restore
    columns), over a long cached prefix, every row or gathered rows, split as served."""
    requests = [(0, 4099), (20000, 1000), (5, 700), (321, 1)]
    _, out, lse, ref_out, ref_lse, plain = _promoted_case(
        LLAMA, 4, 128, torch.bfloat16, "ring", requests, {0: [3], 1: [5, 2], 3: [7]}, "cuda",
        ExtendConfig(), sink=64, window=256, ring_extra=64, gathered=gathered,
    )  # fmt: skip
    _close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse, atol=2e-3, rtol=2e-3)
    assert not torch.allclose(ref_out.float(), plain.float(), atol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("classes", [LLAMA, "GLGLGGLL", "LLLLLLLL"])
def test_extend_gpu_flashinfer_global_rows(classes):
    """The FlashInfer path for global heads computes what the Triton kernel computes."""
    from redknot.kernels.flashinfer_global import FlashInferGlobalRows, run_extend_flashinfer_global

    requests = [(0, 2049), (9000, 700), (300, 0), (5, 333)]
    geo, layout = make_geometry(classes, 4, 128, 64, 256, "ring", ring_extra=64)
    prefix, lens = [p for p, _ in requests], [e for _, e in requests]
    batch, _, _ = make_batch(geo, layout, prefix, torch.bfloat16, "cuda", seed=5)
    T = sum(lens)
    q, k_new, v_new = (
        torch.randn(T, n, 128, device="cuda", dtype=torch.bfloat16) for n in (32, 8, 8)
    )
    plan = plan_extend(geo, batch.req_pool_indices, prefix, lens)
    fi = FlashInferGlobalRows(geo, "cuda")
    fi.plan(plan, batch.req_to_token, {batch.heads.num_global}, torch.bfloat16, 0.088)
    # the global store of the FlashInfer path holds exactly the layer's global heads
    kg, vg = batch.k_global[:, : max(1, batch.heads.num_global)], batch.v_global
    vg = vg[:, : kg.shape[1]]
    lse = torch.empty(T, 32, device="cuda")
    out = run_extend_flashinfer_global(
        fi, plan, q, k_new, v_new, kg, vg, batch.k_local, batch.v_local, batch.req_to_token,
        batch.heads, 0.088, lse=lse,
    )  # fmt: skip
    ref_out, ref_lse = extend_reference(
        q, k_new, v_new, kg, vg, batch.k_local, batch.v_local, batch.req_to_token,
        batch.req_pool_indices, torch.tensor(prefix), plan.qo_indptr_cpu, batch.heads, geo, 0.088,
    )  # fmt: skip
    _close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse, atol=2e-3, rtol=2e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("classes", [LLAMA, "GLGLGGLL"])
def test_extend_gpu_split_keys_short_question_over_long_prefix(classes):
    """A follow-up turn: few new tokens over a long cached prefix, so the launch splits the
    global rows' keys (checked to be the chosen launch) and merges them, at the Llama shape."""
    requests = [(30000, 64), (4000, 1), (100, 7)]
    geo, _ = make_geometry(classes, 4, 128, 64, 256, "ring", ring_extra=64)
    plan = plan_extend(geo, torch.zeros(3, dtype=torch.int64, device="cuda"),
                       [p for p, _ in requests], [e for _, e in requests])  # fmt: skip
    assert choose_extend_splits(plan, classes.count("G"), num_sms("cuda")) > 1
    out, lse, ref_out, ref_lse = _llama_case(classes, "ring", requests)
    _close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse, atol=2e-3, rtol=2e-3)


@pytest.mark.gpu
def test_extend_gpu_split_keys_held_rows_of_a_32k_prompt():
    """The rows segment reuse keeps in a deep layer of a 32K prompt (a few hundred scattered
    rows and the question), gathered, split and merged, with the LSE."""
    L = 32768
    g = torch.Generator().manual_seed(3)
    rows = torch.cat([torch.randperm(L - 128, generator=g)[:200].sort().values,
                      torch.arange(L - 128, L)])  # fmt: skip
    out, lse, ref_out, ref_lse = _llama_case(LLAMA, "ring", [(0, L)], rows=rows)
    rows = rows.cuda()
    _close(out[rows], ref_out[rows])
    torch.testing.assert_close(lse[rows], ref_lse[rows], atol=2e-3, rtol=2e-3)


PROMOTE_CASES = [  # classes, group size, dtype, local mode, request -> promoted local heads
    ("GLLG", 2, torch.float16, "ring", {0: [1], 3: [2, 1], 4: [2]}),
    ("LLLL", 4, torch.bfloat16, "token_table", {1: [3], 4: [0, 2], 5: [1]}),  # no global head
]


def _promoted_case(classes, grp, dim, dtype, mode, requests, promote, device, config, *,
                   sink=SINK, window=WINDOW, ring_extra=3, gathered=False, num_splits=None,
                   seed=11):  # fmt: skip
    """Kernel (rows of ``gathered`` scattered rows, or every row) and reference outputs and
    LSEs of requests promoting ``promote`` into 2 restore columns, and the reference without
    the promotions: ``(rows, out, lse, ref_out[rows], ref_lse[rows], plain[rows])``."""
    geo, layout = make_geometry(classes, grp, dim, sink, window, mode, ring_extra=ring_extra)
    prefix, lens = [p for p, _ in requests], [e for _, e in requests]
    batch, keys, values = make_batch(geo, layout, prefix, dtype, device, seed=seed)
    batch, promoted = with_restore(batch, keys, values, promote, restore=2)
    T, H = sum(lens), geo.num_kv_heads
    g = torch.Generator().manual_seed(seed + 1)
    q, k_new, v_new = (torch.randn(T, n, dim, generator=g).to(dtype).to(device)
                       for n in (H * grp, H, H))  # fmt: skip
    plan = plan_extend(geo, batch.req_pool_indices, prefix, lens, config=config)
    rows = _scattered_rows(lens, seed=5) if gathered else torch.arange(T)
    if gathered:
        plan = gather_tiles(plan, rows.to(device), _counts(rows, lens))
    rows = rows.to(device)
    stores = (batch.k_global, batch.v_global, batch.k_local, batch.v_local, batch.req_to_token)
    lse = torch.empty(rows.numel(), geo.num_q_heads, device=device)
    out = run_extend(plan, q[rows], k_new, v_new, *stores, batch.heads, 0.125, lse=lse,
                     num_splits=num_splits, promoted=promoted)  # fmt: skip
    args = (q, k_new, v_new, *stores, batch.req_pool_indices, torch.tensor(prefix),
            torch.tensor([0, *torch.tensor(lens).cumsum(0)]), batch.heads, geo, 0.125)  # fmt: skip
    ref_out, ref_lse = extend_reference(*args, promoted=promoted)
    plain, _ = extend_reference(*args)
    return rows, out, lse, ref_out[rows], ref_lse[rows], plain[rows]


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("gathered", [False, True])
@pytest.mark.parametrize("classes,grp,dtype,mode,promote", PROMOTE_CASES)
def test_extend_promoted_heads_match_reference(classes, grp, dtype, mode, promote, gathered,
                                               num_splits):  # fmt: skip
    """Adaptive restore: the local heads a request promoted attend every key (their cache from
    the request's restore columns), split and merged as global rows; other requests and heads
    keep their class. Against the reference, and different from the unpromoted run."""
    _, out, lse, ref_out, ref_lse, plain = _promoted_case(
        classes, grp, 64, dtype, mode, REQUESTS, promote, "cpu", SMALL, gathered=gathered,
        num_splits=num_splits,
    )  # fmt: skip
    _close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse, atol=1e-3, rtol=1e-3)
    assert not torch.allclose(ref_out.float(), plain.float(), atol=1e-2)
    assert all(int(c.abs().sum()) == 0 for c in extend_mod._COUNTERS.values())
