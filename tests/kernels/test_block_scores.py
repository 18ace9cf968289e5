"""SamKV's block-score kernel against its PyTorch reference
(``redknot.kernels.block_scores.block_scores_reference``) and the reference against the scores
written out, on the CPU under the Triton interpreter and at the 8B shape on the GPU."""

from __future__ import annotations

import pytest
import torch

from redknot.kernels.block_scores import block_scores, block_scores_reference
from redknot.kernels.rope_reference import delta_rotate, sglang_rope
from redknot.recovery.samkv.served import turn_back

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # numpy, in the interpreter


def _case(heads, dim, rotary, block, blocks, docs, dtype, is_neox, device, seed=0):
    """Keys at scattered rows of a region, each block at its own offset in its segment."""
    g = torch.Generator().manual_seed(seed)
    cache = sglang_rope(dim, rotary, 4096, 10000.0, is_neox).cos_sin_cache
    region = torch.randn(blocks * block + 50, heads, dim, generator=g).to(dtype)
    rows = torch.randperm(region.shape[0], generator=g)[: blocks * block]
    first = torch.randint(0, 3000, (blocks,), generator=g)  # each block's first offset
    positions = (first[:, None] + torch.arange(block)).flatten()
    cos, sin = turn_back(positions, cache)
    queries = torch.randn(docs, heads, dim, generator=g)
    block_doc = torch.randint(0, docs, (blocks,), generator=g)
    args = [t.to(device) for t in (region, rows, cos, sin, queries, block_doc)]
    return args, cache, positions


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize(
    "heads,dim,rotary,block,dtype",
    [(2, 16, 16, 4, torch.float32), (3, 16, 8, 5, torch.bfloat16), (1, 8, 8, 1, torch.float16)],
)
def test_block_scores_match_the_reference(heads, dim, rotary, block, dtype, is_neox):
    args, _, _ = _case(heads, dim, rotary, block, 6, 3, dtype, is_neox, "cpu")
    got = block_scores(*args, block, is_neox=is_neox)
    want = block_scores_reference(*args, block, is_neox=is_neox)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def test_the_reference_is_the_scores_written_out():
    args, cache, positions = _case(2, 8, 8, 3, 4, 2, torch.float32, True, "cpu", seed=1)
    region, rows, cos, sin, queries, block_doc = args
    want = []
    for c in range(4):
        toks = range(c * 3, c * 3 + 3)
        at = lambda t: positions[t : t + 1]
        keys = torch.stack([delta_rotate(region[rows[t]][None], at(t), 0 * at(t), cache,
                                         is_neox=True)[0] for t in toks])  # fmt: skip
        mean = keys.mean(0)  # [H, D]: the block's keys before RoPE, averaged
        want.append(sum(float(queries[block_doc[c], h] @ mean[h]) for h in range(2)))
    got = block_scores_reference(region, rows, cos, sin, queries, block_doc, 3, is_neox=True)
    torch.testing.assert_close(got, torch.tensor(want), rtol=1e-5, atol=1e-5)


def test_no_block_gives_no_score():
    args, _, _ = _case(2, 8, 8, 2, 1, 1, torch.float32, True, "cpu")
    region, _, cos, sin, queries, _ = args
    empty = torch.zeros(0, dtype=torch.int64)
    out = block_scores(region, empty, cos[:0], sin[:0], queries, empty, 2, is_neox=True)
    assert out.shape == (0,)


@pytest.mark.gpu
def test_block_scores_at_the_8b_shape_on_the_gpu():
    """8 KV heads of 128, blocks of 64, 480 middle blocks of 8 documents (32K x 8)."""
    args, _, _ = _case(8, 128, 128, 64, 480, 8, torch.bfloat16, True, "cuda")
    got = block_scores(*args, 64, is_neox=True)
    want = block_scores_reference(*args, 64, is_neox=True)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
