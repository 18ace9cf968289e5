"""The token policies' rows in runs (``redknot.kernels.flashinfer_runs``): the runs of a batch
against a brute-force walk over its rows, the PyTorch reference against dense causal attention
of the whole request, FlashInfer's slot index built by SGLang's kernel (Triton interpreter on
the CPU), and FlashInfer itself against the reference at the 8B shape (GPU)."""

from __future__ import annotations

import math

import pytest
import torch

from redknot.kernels.flashinfer_runs import (
    FEW_RUNS,
    MIN_ROWS_PER_RUN,
    ReferenceRuns,
    RowRuns,
    kv_indices_of,
    kv_indptr_of,
    row_runs,
    runs_attention_reference,
    worth_runs,
)


def brute_runs(computed, lens, prefix, rpis):
    """(first computed row, last position + 1, request slot) of each run, row by row."""
    out, row, k = [], 0, 0
    for b, (n, p) in enumerate(zip(lens, prefix)):
        prev = None
        for i in range(n):
            if computed is None or computed[row]:
                if prev is None or prev != i - 1:
                    out.append([k, 0, rpis[b]])
                out[-1][1] = p + i + 1
                prev = i
                k += 1
            row += 1
    return out


@pytest.mark.parametrize("seed", range(6))
def test_runs_of_a_batch_are_its_consecutive_computed_positions(seed):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 40, (4,), generator=g).tolist()
    prefix = torch.randint(0, 30, (4,), generator=g).tolist()
    rpis = [7, 2, 9, 4]
    qo = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    for computed in (None, torch.rand(sum(lens), generator=g) > 0.5):
        runs = row_runs(computed, qo, torch.tensor(prefix), rpis)
        want = brute_runs(computed, lens, prefix, rpis)
        assert runs.qo_indptr[:-1].tolist() == [w[0] for w in want]
        assert runs.kv_lens.tolist() == [w[1] for w in want]
        assert runs.req_pool_indices.tolist() == [w[2] for w in want]
        assert runs.num_rows == (sum(lens) if computed is None else int(computed.sum()))
    every = row_runs(None, qo, torch.tensor(prefix), rpis)  # a run per request
    assert every.num_runs == 4 and every.kv_lens.tolist() == [p + n for p, n in zip(prefix, lens)]


def test_no_computed_row_makes_no_run():
    runs = row_runs(torch.zeros(5, dtype=torch.bool), torch.tensor([0, 5]), torch.tensor([3]), [1])
    assert runs.num_runs == 0 and runs.qo_indptr.tolist() == [0]


def test_runs_are_worth_while_few_or_long():
    def runs(n, rows):
        indptr = torch.linspace(0, rows, n + 1).round().to(torch.int32)
        return RowRuns(indptr, torch.full((n,), 1000, dtype=torch.int32), torch.zeros(n).long())

    assert worth_runs(runs(FEW_RUNS, FEW_RUNS))  # few: one row each
    assert not worth_runs(runs(FEW_RUNS + 1, FEW_RUNS + 1))  # more, one row each
    assert worth_runs(runs(1000, 1000 * MIN_ROWS_PER_RUN))  # many, a tile's worth each
    assert not worth_runs(runs(1000, 1000 * MIN_ROWS_PER_RUN - 1))


def dense_causal(q, k, v, scale):
    """Every query position of a request over its keys (GQA), causal, float64."""
    hq, hk = q.shape[1], k.shape[1]
    kf = k.double().repeat_interleave(hq // hk, 1)
    vf = v.double().repeat_interleave(hq // hk, 1)
    s = torch.einsum("qhd,khd->hqk", q.double(), kf) * scale
    n = q.shape[0]
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -math.inf)
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), vf)


def batch_of_runs(g, dtype, device, hq=8, hk=2, d=64, lengths=(70, 45)):
    """Two requests stored at random slots of a pool, their queries at every position, and
    a computed-row mask (runs of 1-9 rows, the last row always)."""
    total = sum(lengths)
    pool_slots = torch.randperm(total + 50, generator=g)[:total] + 1
    req_to_token = torch.zeros(6, 256, dtype=torch.int32)
    req_to_token[3, : lengths[0]] = pool_slots[: lengths[0]].int()
    req_to_token[5, : lengths[1]] = pool_slots[lengths[0] :].int()
    k_buf = torch.randn(total + 51, hk, d, generator=g).to(dtype)
    v_buf = torch.randn(total + 51, hk, d, generator=g).to(dtype)
    q = [torch.randn(n, hq, d, generator=g).to(dtype) for n in lengths]
    prefix = [lengths[0] - 30, lengths[1] - 20]  # the extend: the last 30 / 20 positions
    computed = torch.rand(50, generator=g) > 0.5
    computed[29] = computed[49] = True
    return req_to_token.to(device), k_buf.to(device), v_buf.to(device), q, prefix, computed


def test_reference_runs_equal_dense_causal_attention_of_their_rows():
    g = torch.Generator().manual_seed(0)
    req_to_token, k_buf, v_buf, q, prefix, computed = batch_of_runs(g, torch.float32, "cpu")
    scale = 64**-0.5
    runs = row_runs(computed, torch.tensor([0, 30, 50]), torch.tensor(prefix), [3, 5])
    rows = computed.nonzero().squeeze(1)
    q_rows = torch.cat([q[0][prefix[0] :], q[1][prefix[1] :]])[rows]
    ref = ReferenceRuns()
    ref.plan(runs, req_to_token, torch.float32, scale)
    got = ref.run(q_rows, k_buf, v_buf, torch.empty_like(q_rows))
    want = []
    for b, (rpi, lo) in enumerate(((3, 0), (5, 30))):
        n = prefix[b] + (30 if b == 0 else 20)
        slots = req_to_token[rpi, :n].long()
        dense = dense_causal(q[b], k_buf[slots], v_buf[slots], scale)[prefix[b] :]
        want.append(dense[computed[lo : lo + n - prefix[b]]])
    torch.testing.assert_close(got.double(), torch.cat(want), atol=1e-5, rtol=1e-5)


def test_one_run_of_every_position_is_dense_causal_attention():
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(9, 4, 16, generator=g), torch.randn(9, 2, 16, generator=g)
    v = torch.randn(9, 2, 16, generator=g)
    got = runs_attention_reference(q, k, v, 0.25)
    torch.testing.assert_close(got.double(), dense_causal(q, k, v, 0.25), atol=1e-5, rtol=1e-5)


def test_flashinfer_slot_index_lists_each_runs_slots():
    g = torch.Generator().manual_seed(2)
    req_to_token = torch.randint(0, 10_000, (4, 3000), generator=g, dtype=torch.int32)
    runs = RowRuns(
        torch.tensor([0, 3, 4, 9], dtype=torch.int32),
        torch.tensor([1100, 7, 2999], dtype=torch.int32),  # over the kernel's 512-slot blocks
        torch.tensor([2, 0, 3]),
    )
    indptr = kv_indptr_of(runs)
    got = kv_indices_of(runs, indptr, req_to_token)
    want = torch.cat([req_to_token[2, :1100], req_to_token[0, :7], req_to_token[3, :2999]])
    assert indptr.tolist() == [0, 1100, 1107, 4106]
    assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", ["epic_32k", "batch"])
def test_flashinfer_runs_match_the_reference_at_the_8b_shape(shape):
    """32 query / 8 KV heads, D=128, bf16, slots scattered in a pool: EPIC's rows of a 32K
    prompt of 8 segments (16 per segment and a 64-token question), and a batch of three
    requests with a cached prefix, one computed whole."""
    from redknot.kernels.flashinfer_runs import FlashInferRuns

    dev = "cuda"
    g = torch.Generator().manual_seed(3)
    hq, hk, d = 32, 8, 128
    if shape == "epic_32k":
        lens, prefix = [32768 + 64], [0]
        keep = torch.zeros(lens[0], dtype=torch.bool)
        for s in range(8):
            keep[s * 4096 : s * 4096 + 16] = True
        keep[-64:] = True
    else:
        lens, prefix = [3000, 500, 1200], [5000, 0, 300]
        keep = torch.rand(sum(lens), generator=g) > 0.9
        keep[3000:3500] = True
    total = sum(p + n for p, n in zip(prefix, lens))
    slots = (torch.randperm(total + 4096, generator=g)[:total] + 1).int()
    req_to_token = torch.zeros(len(lens), max(p + n for p, n in zip(prefix, lens)),
                               dtype=torch.int32)  # fmt: skip
    at = 0
    for b, (p, n) in enumerate(zip(prefix, lens)):
        req_to_token[b, : p + n] = slots[at : at + p + n]
        at += p + n
    k_buf = torch.randn(total + 4097, hk, d, generator=g).bfloat16().to(dev)
    v_buf = torch.randn(total + 4097, hk, d, generator=g).bfloat16().to(dev)
    qo = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    runs = row_runs(keep, qo, torch.tensor(prefix), list(range(len(lens))))
    q = torch.randn(runs.num_rows, hq, d, generator=g).bfloat16().to(dev)
    req_to_token = req_to_token.to(dev)
    workspace = torch.empty(128 << 20, dtype=torch.uint8, device=dev)
    fi = FlashInferRuns(hq, hk, d, workspace)
    fi.plan(runs, req_to_token, torch.bfloat16, d**-0.5)
    got = fi.run(q, k_buf, v_buf, torch.empty_like(q))
    ref = ReferenceRuns()
    ref.plan(runs, req_to_token, torch.bfloat16, d**-0.5)
    want = ref.run(q, k_buf, v_buf, torch.empty_like(q))
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
