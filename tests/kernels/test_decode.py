"""SegPagedAttention decode against the PyTorch reference.

On the CPU the kernels run under ``TRITON_INTERPRET=1`` (see conftest.py) at small shapes with
small blocks, so that splits, partial blocks and sink/window edges all occur. GPU tests use the
Llama-3.1-8B attention shape and the default tuning.
"""

from __future__ import annotations

import pytest
import torch

from redknot.kernels.decode import (
    DecodeConfig,
    DecodeWorkspace,
    choose_num_splits,
    plan_decode,
    run_decode,
)
from redknot.kernels.reference import decode_reference

from .segpaged_data import make_batch, make_geometry, with_restore

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # numpy, in the interpreter

SMALL = DecodeConfig(block_n=16, min_chunk=16)
SINK, WINDOW = 4, 19
# key counts: a padded row (0), a single key, < sink + window, just above it, not a multiple
# of the block, long enough for several splits
SEQ_LENS = [0, 1, 9, 24, 45, 150]

CASES = [  # classes, group size, head_dim, dtype, local mode
    ("GLLG", 1, 64, torch.float16, "token_table"),
    ("LGLL", 4, 128, torch.bfloat16, "ring"),
    ("LLLL", 8, 64, torch.bfloat16, "token_table"),  # no global head
    ("GGGG", 4, 64, torch.float16, "token_table"),  # no local head
    ("LLLG", 8, 128, torch.float16, "ring"),
    ("LLGL", 1, 128, torch.bfloat16, "ring"),
    ("LGL", 3, 64, torch.bfloat16, "ring"),  # a group that is not a power of two (SmolLM2)
]


def _close(out: torch.Tensor, ref: torch.Tensor) -> None:
    tol = 2e-2 if out.dtype == torch.bfloat16 else 4e-3
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


def _run_case(classes, grp, dim, dtype, mode, seq_lens, num_splits, device, config, seed=0):
    geo, layout = make_geometry(classes, grp, dim, SINK, WINDOW, mode)
    batch, _, _ = make_batch(geo, layout, seq_lens, dtype, device, seed=seed)
    B = len(seq_lens)
    g = torch.Generator().manual_seed(seed + 1)
    # q as a strided view of a wider projection output, as SGLang passes it
    qkv = torch.randn(B, geo.num_q_heads + 2, dim, generator=g).to(dtype).to(device)
    q = qkv[:, : geo.num_q_heads]
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int64)
    ws = DecodeWorkspace(geo, max_batch_size=B + 3, max_splits=16, device=device)
    plan = plan_decode(
        geo, ws, seq_lens_t.to(device), batch.req_pool_indices, seq_lens_cpu=seq_lens_t,
        num_splits=num_splits, config=config,
    )  # fmt: skip
    lse = torch.empty(B, geo.num_q_heads, device=device)
    out = run_decode(
        plan, q, batch.k_global, batch.v_global, batch.k_local, batch.v_local,
        batch.req_to_token, batch.heads, 0.125, lse=lse,
    )  # fmt: skip
    ref_out, ref_lse = decode_reference(
        q, batch.k_global, batch.v_global, batch.k_local, batch.v_local, batch.req_to_token,
        batch.req_pool_indices, seq_lens_t, batch.heads, geo, 0.125,
    )  # fmt: skip
    return out, lse, ref_out, ref_lse


@pytest.mark.parametrize("num_splits", [1, 5])
@pytest.mark.parametrize("classes,grp,dim,dtype,mode", CASES)
def test_decode_matches_reference(classes, grp, dim, dtype, mode, num_splits):
    out, lse, ref_out, ref_lse = _run_case(
        classes, grp, dim, dtype, mode, SEQ_LENS, num_splits, "cpu", SMALL
    )
    assert torch.isfinite(out.float()).all()
    _close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse, atol=1e-3, rtol=1e-3)
    assert (out[0] == 0).all() and torch.isneginf(lse[0]).all()  # the padded row


def test_decode_split_count_from_lengths():
    """With ``num_splits`` chosen from the lengths (as outside CUDA graphs)."""
    out, lse, ref_out, ref_lse = _run_case(
        "GLLL", 4, 64, torch.float16, "ring", [3, 200, 77], None, "cpu", SMALL
    )
    _close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse, atol=1e-3, rtol=1e-3)


def test_decode_default_blocks():
    """The default block of 128 keys, with rows shorter and longer than one block."""
    out, lse, ref_out, ref_lse = _run_case(
        "LGLL", 4, 64, torch.bfloat16, "ring", [1, 100, 300, 700], 3, "cpu",
        DecodeConfig(min_chunk=128),
    )  # fmt: skip
    _close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse, atol=1e-3, rtol=1e-3)


def test_decode_ring_and_token_table_agree():
    """The same keys stored in a ring or in a token table give the same attention."""
    outs = [
        _run_case("LGLL", 4, 64, torch.float16, mode, [1, 30, 61], 3, "cpu", SMALL)[0]
        for mode in ("token_table", "ring")
    ]
    torch.testing.assert_close(outs[0], outs[1], atol=0, rtol=0)


def test_decode_plan_checks_workspace():
    geo, _ = make_geometry("GL", 4, 64, SINK, WINDOW, "token_table")
    ws = DecodeWorkspace(geo, max_batch_size=2, max_splits=4, device="cpu")
    lens = torch.tensor([5, 6, 7])
    with pytest.raises(AssertionError):
        plan_decode(geo, ws, lens, torch.arange(3), num_splits=2)
    with pytest.raises(AssertionError):
        plan_decode(geo, ws, lens[:2], torch.arange(2), num_splits=8)
    small = DecodeWorkspace(geo, max_batch_size=8, max_splits=8, device="cpu", max_request_splits=8)
    plan = plan_decode(geo, small, lens[:2], torch.arange(2), num_splits=4)
    assert plan.part_o_gpu.shape == (2, geo.num_q_heads, 4, geo.head_dim)
    with pytest.raises(AssertionError):
        plan_decode(geo, small, lens, torch.arange(3), num_splits=4)


def test_decode_workspace_sized_for_every_batch():
    """A workspace from ``sized_for`` holds every plan ``choose_num_splits`` makes."""
    geo, _ = make_geometry("GLLLLLLL", 4, 128, 64, 256, "ring")
    ws = DecodeWorkspace.sized_for(geo, max_batch_size=64, num_sms=132, device="cpu")
    for B in (1, 2, 5, 31, 64):
        for max_len in (1, 320, 4097, 131072):
            for heavy in (0, 1, 4, 8):
                splits = choose_num_splits(B, max_len, heavy, num_sms=132, max_splits=ws.max_splits)
                part_o, _ = ws.views(B, splits)
                assert part_o.shape == (B, geo.num_q_heads, splits, geo.head_dim)


# ---- GPU: real shapes -------------------------------------------------------------------------

LLAMA = "GLLLLLLL"  # 8 KV heads, 1 global; 32 query heads


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["token_table", "ring"])
@pytest.mark.parametrize("classes", [LLAMA, "GLGLGGLL", "LLLLLLLL", "GGGGGGGG"])
def test_decode_gpu_llama_shape(classes, mode):
    lens = [1, 300, 4097, 32768, 20011]
    out, lse, ref_out, ref_lse = _run_case(
        classes, 4, 128, torch.bfloat16, mode, lens, None, "cuda", DecodeConfig()
    )
    _close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse, atol=2e-3, rtol=2e-3)


@pytest.mark.gpu
def test_decode_gpu_cuda_graph_replay():
    """Capture once for a batch size with fixed splits; replay with other lengths, including
    padded rows, by refilling the static buffers."""
    geo, layout = make_geometry(LLAMA, 4, 128, 64, 256, "ring", ring_extra=64)
    B, dev = 8, "cuda"
    full = [9000, 17, 1, 320, 321, 4000, 12000, 65]  # replays never exceed these
    batch, _, _ = make_batch(geo, layout, full, torch.bfloat16, dev, seed=3)
    ws = DecodeWorkspace(geo, max_batch_size=B, max_splits=64, device=dev)
    seq_lens = torch.tensor(full, dtype=torch.int64, device=dev)
    rows = batch.req_pool_indices.clone()
    q = torch.randn(B, geo.num_q_heads, 128, device=dev, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    plan = plan_decode(geo, ws, seq_lens, rows, num_splits=16)
    args = (batch.k_global, batch.v_global, batch.k_local, batch.v_local, batch.req_to_token)

    def step():
        run_decode(plan, q, *args, batch.heads, 0.088, out=out)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for lens in (full, [5000, 17, 0, 0, 300, 1, 12000, 64], [1] * B):
        seq_lens.copy_(torch.tensor(lens, device=dev))
        q.copy_(torch.randn_like(q))
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        ref, _ = decode_reference(
            q, *args, rows, torch.tensor(lens), batch.heads, geo, 0.088
        )  # fmt: skip
        _close(out, ref)


@pytest.mark.parametrize("num_splits", [1, 2, 5])
@pytest.mark.parametrize("classes", ["GLLG", "LLLL"])
def test_decode_local_rows_split_and_merge(classes, num_splits):
    """Local rows split too when ``local_min_chunk`` is below sink + window (here 23 keys in
    pieces of >= 8: up to 3 local splits, never more than ``num_splits``) and merge like
    global ones; the plan launches no program for a local split that cannot exist."""
    cfg = DecodeConfig(block_n=16, min_chunk=16, local_min_chunk=8)
    geo, _ = make_geometry(classes, 4, 64, SINK, WINDOW, "ring")
    ws = DecodeWorkspace(geo, max_batch_size=8, max_splits=16, device="cpu")
    lens = torch.tensor(SEQ_LENS)
    plan = plan_decode(geo, ws, lens, torch.arange(len(SEQ_LENS)), num_splits=num_splits,
                       config=cfg)  # fmt: skip
    assert plan.local_splits == min(num_splits, 3)
    assert plan_decode(geo, ws, lens, torch.arange(len(SEQ_LENS)), num_splits=num_splits,
                       config=SMALL).local_splits == 1  # fmt: skip
    out, lse, ref_out, ref_lse = _run_case(
        classes, 4, 64, torch.bfloat16, "ring", SEQ_LENS, num_splits, "cpu", cfg
    )
    _close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse, atol=1e-3, rtol=1e-3)


def _promoted_case(classes, grp, dim, dtype, mode, seq_lens, promote, num_splits, device,
                   config, sink=SINK, window=WINDOW, ring_extra=3):  # fmt: skip
    """Kernel output and LSE of requests promoting ``promote`` into 2 restore columns, the
    reference's, and the reference without the promotions."""
    geo, layout = make_geometry(classes, grp, dim, sink, window, mode, ring_extra=ring_extra)
    batch, keys, values = make_batch(geo, layout, seq_lens, dtype, device, seed=7)
    batch, promoted = with_restore(batch, keys, values, promote, restore=2)
    B = len(seq_lens)
    q = torch.randn(B, geo.num_q_heads, dim, generator=torch.Generator().manual_seed(8))
    q = q.to(dtype).to(device)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int64)
    ws = DecodeWorkspace(geo, max_batch_size=B, max_splits=64, device=device)
    plan = plan_decode(geo, ws, seq_lens_t.to(device), batch.req_pool_indices,
                       seq_lens_cpu=seq_lens_t, num_splits=num_splits, config=config)  # fmt: skip
    stores = (batch.k_global, batch.v_global, batch.k_local, batch.v_local, batch.req_to_token)
    lse = torch.empty(B, geo.num_q_heads, device=device)
    out = run_decode(plan, q, *stores, batch.heads, 0.125, lse=lse, promoted=promoted)
    args = (q, *stores, batch.req_pool_indices, seq_lens_t, batch.heads, geo, 0.125)
    ref_out, ref_lse = decode_reference(*args, promoted=promoted)
    return out, lse, ref_out, ref_lse, decode_reference(*args)[0]


@pytest.mark.parametrize("num_splits", [1, 5])
@pytest.mark.parametrize(
    "classes,grp,dtype,mode,promote",
    [("GLLG", 2, torch.float16, "ring", {2: [1], 4: [2, 1], 5: [2]}),
     ("LLLL", 4, torch.bfloat16, "token_table", {3: [3], 5: [0, 2]})],
)  # fmt: skip
def test_decode_promoted_heads_match_reference(classes, grp, dtype, mode, promote, num_splits):
    """Adaptive restore in decode: a request's promoted local heads attend every key from its
    restore columns, with the splits of a global row (merged by the merge kernel); against the
    reference, and different from the unpromoted attention."""
    out, lse, ref_out, ref_lse, plain = _promoted_case(
        classes, grp, 64, dtype, mode, SEQ_LENS, promote, num_splits, "cpu", SMALL
    )
    _close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse, atol=1e-3, rtol=1e-3)
    assert not torch.allclose(ref_out.float(), plain.float(), atol=1e-2)


@pytest.mark.gpu
def test_decode_gpu_promoted_heads_llama_shape():
    """Adaptive restore at the Llama shape, splits chosen from the lengths as served."""
    out, lse, ref_out, ref_lse, plain = _promoted_case(
        LLAMA, 4, 128, torch.bfloat16, "ring", [1, 300, 4097, 32768, 20011],
        {2: [3], 3: [1, 6], 4: [7]}, None, "cuda", DecodeConfig(), sink=64, window=256,
        ring_extra=64,
    )  # fmt: skip
    _close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse, atol=2e-3, rtol=2e-3)
    assert not torch.allclose(ref_out.float(), plain.float(), atol=1e-2)
