"""``redknot.kernels.host_stage``: the listed rows gathered into a staging store, and kernels over
the staged store reading exactly what they read over the original (interpreter on the CPU)."""

from __future__ import annotations

import math

import pytest
import torch

from redknot.kernels.host_stage import HostStage, stage_rows, stage_rows_reference
from redknot.kernels.lfps_index import score_and_rank
from redknot.kernels.sparse_decode import plan_sparse_decode, run_sparse_decode

from .paged_data import make_paged

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # numpy, in the interpreter

S, HKV, HQ, D = 4, 2, 4, 16


def _lists(lens: list[int], width: int, seed: int) -> torch.Tensor:
    """Per KV head: valid positions, padding (-1), sink positions and positions past the row."""
    g = torch.Generator().manual_seed(seed)
    out = torch.empty(len(lens), HKV, width, dtype=torch.int32)
    for b, n in enumerate(lens):
        for h in range(HKV):
            pos = torch.randperm(max(n - S, 0), generator=g)[:width] + S
            row = torch.full((width,), -1, dtype=torch.int32)
            row[: pos.numel()] = pos.to(torch.int32)
            out[b, h] = row
        out[b, 0, -1] = 1  # a sink position listed: skipped
        out[b, 1, -2] = n + 3  # past the row: skipped
    return out


@pytest.mark.parametrize("values", [True, False])
def test_staged_rows_equal_the_reference_row_by_row(values):
    lens = [40, 3, 25]  # the second request is shorter than its sinks
    batch = make_paged(lens, HKV, D, torch.float16, seed=1)
    idx = _lists(lens, 12, seed=2)
    args = (batch.k_buffer, batch.v_buffer if values else None, batch.req_to_token,
            batch.req_pool_indices, batch.seq_lens, idx)  # fmt: skip
    got = stage_rows(HostStage.empty(3, HKV, D, num_sink=S, width=12, dtype=torch.float16,
                                     device="cpu", values=values), *args)  # fmt: skip
    want = stage_rows_reference(HostStage.empty(3, HKV, D, num_sink=S, width=12,
                                                dtype=torch.float16, device="cpu",
                                                values=values), *args)  # fmt: skip
    assert torch.equal(got.indices, want.indices) and torch.equal(got.seq_lens, want.seq_lens)
    assert torch.equal(got.k, want.k)
    assert got.v is None if not values else torch.equal(got.v, want.v)
    assert got.seq_lens.tolist() == [S + 12, 3, S + 12]
    assert (got.indices[1] == -1).all()  # nothing of a request shorter than its sinks is listed
    assert got.indices[0, 0, -1] == -1 and got.indices[0, 1, -2] == -1


def test_kernels_over_the_staged_rows_compute_what_they_compute_over_the_store():
    lens = [60, 33, 2]
    K, C = 10, 24
    batch = make_paged(lens, HKV, D, torch.float16, seed=3)
    q = torch.randn(3, HQ, D, generator=torch.Generator().manual_seed(4)).half()
    paged = (batch.req_to_token, batch.req_pool_indices, batch.seq_lens)
    scale = 1 / math.sqrt(D)
    sel = _lists(lens, K, seed=5)
    plan = plan_sparse_decode(batch_size=3, num_q_heads=HQ, head_dim=D, rows=HQ // HKV,
                              width=K, num_sink=S, device="cpu")  # fmt: skip
    want = run_sparse_decode(plan, q, batch.k_buffer, batch.v_buffer, *paged, sel, scale).clone()
    stage = HostStage.empty(3, HKV, D, num_sink=S, width=K, dtype=torch.float16, device="cpu")
    st = stage_rows(stage, batch.k_buffer, batch.v_buffer, *paged, sel)
    got = run_sparse_decode(plan, q, st.k, st.v, st.req_to_token, st.req_pool_indices,
                            st.seq_lens, st.indices, scale)  # fmt: skip
    assert not torch.isnan(want).any() and torch.equal(got, want)

    cand = _lists(lens, C, seed=6)
    bypass = torch.zeros(3, HQ, dtype=torch.bool)
    bypass[0, 1] = True
    want_logits, want_rank = score_and_rank(q, batch.k_buffer, *paged, cand, bypass,
                                            num_sink=S, sm_scale=scale)  # fmt: skip
    cs = stage_rows(HostStage.empty(3, HKV, D, num_sink=S, width=C, dtype=torch.float16,
                                    device="cpu", values=False), batch.k_buffer, None, *paged,
                    cand, sinks=False)  # fmt: skip
    logits, rank = score_and_rank(q, cs.k, cs.req_to_token, cs.req_pool_indices, cs.seq_lens,
                                  cs.indices, bypass, num_sink=S, sm_scale=scale)  # fmt: skip
    assert torch.equal(logits, want_logits) and torch.equal(rank, want_rank)
    assert torch.isfinite(want_logits).any() and torch.isinf(want_logits).any()
