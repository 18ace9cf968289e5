"""``--redknot-lfps-offload-gb``: the option's checks, the host budget, the sizing hook, and (GPU)
the pinned host store that every kernel reads as a CUDA tensor."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pool.test_sizing_hooks import bare_configurator
from redknot import envs
from redknot.config import RedknotConfig, RedknotConfigError
from redknot.headmap import ModelShape, synthetic_map
from redknot.pool import host_memory, sizing
from redknot.pool.kv_pool import RedknotKVPool
from redknot.pool.layout import HeadLayout

GiB = 1 << 30
OFFLOAD = {"all_global": True, "lfps": "lfps", "segment_fraction": 0}


def test_offload_is_an_option_of_lfps_without_segments():
    assert RedknotConfig(**OFFLOAD, lfps_offload_gb=12.5).lfps_offload_gb == 12.5
    assert RedknotConfig(**OFFLOAD).lfps_offload_gb == 0  # off by default
    with pytest.raises(RedknotConfigError, match="add --redknot-lfps lfps"):
        RedknotConfig(all_global=True, segment_fraction=0, lfps_offload_gb=4)
    with pytest.raises(RedknotConfigError, match="--redknot-segment-fraction 0 to offload"):
        RedknotConfig(all_global=True, lfps="lfps", segment_fraction=0.1, lfps_offload_gb=4)
    for bad in (-1, True, "4"):
        with pytest.raises(RedknotConfigError, match="number of GiB >= 0"):
            RedknotConfig(**OFFLOAD, lfps_offload_gb=bad)


def test_host_budget_leaves_the_margin_free():
    host_memory.check_host_budget(100 * GiB, 1, 120 * GiB, available=110 * GiB, margin_gb=8)
    with pytest.raises(ValueError, match=r"pass at most 56\.0") as err:  # every rank's store
        host_memory.check_host_budget(60 * GiB, 2, 120 * GiB, available=110 * GiB, margin_gb=8)
    assert "120.0 GiB of pinned" in str(err.value) and "the host has 120.0 GiB" in str(err.value)
    # another rank pinned its store already: this rank's own must fit what is left
    host_memory.check_host_budget(50 * GiB, 2, 120 * GiB, available=60 * GiB, margin_gb=8)
    with pytest.raises(ValueError, match=r"only 40\.0 GiB are available now.*at most 32\.0"):
        host_memory.check_host_budget(50 * GiB, 2, 120 * GiB, available=40 * GiB, margin_gb=8)
    host_memory.check_host_budget(10**15, 1, None, None)  # unknown: warned, not refused


def test_meminfo_fields(tmp_path):
    path = tmp_path / "meminfo"
    path.write_text("MemTotal:  1000 kB\nMemFree:  10 kB\nMemAvailable:   2048 kB\n")
    assert host_memory.meminfo_bytes("MemAvailable", str(path)) == 2048 * 1024
    assert host_memory.meminfo_bytes("MemTotal", str(path)) == 1000 * 1024
    path.write_text("MemTotal:  1000 kB\n")
    assert host_memory.meminfo_bytes("MemAvailable", str(path)) is None
    assert host_memory.meminfo_bytes("MemTotal", str(tmp_path / "absent")) is None


@pytest.fixture
def offload_configurator(monkeypatch):
    from sglang.srt.runtime_context import get_parallel

    config = RedknotConfig(**OFFLOAD, lfps_offload_gb=2.0, lfps_max_requests=2)
    monkeypatch.setenv(envs.REDKNOT_RESOLVED_CONFIG.name, config.to_json())
    with get_parallel().override(attn_tp_size=1, attn_tp_rank=0):
        yield bare_configurator()


def test_offload_sizes_the_token_slots_from_host_memory(offload_configurator, monkeypatch):
    """The token slots get the host's bytes; LFPS's tables are still taken from the GPU's KV
    budget (and refused when they do not fit it)."""
    from redknot.integration import plugin

    monkeypatch.setattr(host_memory, "meminfo_bytes", lambda field: 64 * GiB)
    assert plugin._after_available_bytes(10**9, offload_configurator, 0) == 2 * GiB
    shape, rows = sizing.state_of(offload_configurator)["lfps"]
    assert rows == 2 and shape.max_len == 4096
    assert plugin._after_max_num_reqs(4096, offload_configurator, 10**6) == 4096
    with pytest.raises(ValueError, match="LFPS score tables"):
        sizing.reserve_local_bytes(offload_configurator, 1000)


def test_offload_larger_than_the_host_fails_at_startup(offload_configurator, monkeypatch):
    monkeypatch.setattr(host_memory, "meminfo_bytes", lambda field: 9 * GiB)
    with pytest.raises(ValueError, match="--redknot-lfps-offload-gb asks for 2.0 GiB"):
        sizing.reserve_local_bytes(offload_configurator, 10**9)


def test_dense_decode_over_host_is_warned(caplog):
    shape = SimpleNamespace(max_len=1000)
    with caplog.at_level("WARNING"):
        sizing._warn_dense_over_host(8000, shape, 4)
    assert "raise --redknot-lfps-max-requests to 8" in caplog.text
    caplog.clear()
    sizing._warn_dense_over_host(8000, shape, 8)
    assert not caplog.text


def test_host_store_needs_a_gpu():
    with pytest.raises(ValueError, match="read by GPU kernels"):
        host_memory.pinned_host_tensor((4, 2), torch.bfloat16, "cpu")


# ---- GPU -------------------------------------------------------------------------------------

SHAPE = ModelShape(
    "LlamaForCausalLM", num_layers=2, num_kv_heads=8, num_attention_heads=32, head_dim=128
)


def _need_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")


@pytest.mark.gpu
def test_host_pool_lives_in_host_memory_and_takes_the_store_kernels_writes():
    """The offloaded pool's global store takes no GPU memory, SGLang's K+V store kernel writes
    it, and what it holds equals the same writes into a pool in GPU memory."""
    _need_cuda()
    layout = HeadLayout.from_head_map(synthetic_map(SHAPE, 1.0))
    size = (1 << 30) // (2 * 8 * 128 * 2 * 2)  # 0.5 GiB a tensor, 2 GiB in all
    torch.cuda.synchronize()
    free0 = torch.cuda.mem_get_info()[0]
    host = RedknotKVPool(size, 1, torch.bfloat16, layout, 2, 0, "cuda", host_kv=True)
    torch.cuda.synchronize()
    assert free0 - torch.cuda.mem_get_info()[0] < 0.25 * GiB
    assert all(t.is_cuda for t in host.k_global + host.v_global)
    device = RedknotKVPool(4096, 1, torch.bfloat16, layout, 2, 0, "cuda")
    k = torch.randn(300, 8, 128, dtype=torch.bfloat16, device="cuda")
    v = torch.randn_like(k)
    loc = torch.randperm(4000, device="cuda")[:300] + 1
    for layer in range(2):
        host.write_global(layer, loc, k, v)
        device.write_global(layer, loc, k, v)
        assert torch.equal(host.k_global[layer][:4097].cpu(), device.k_global[layer].cpu())
        assert torch.equal(host.v_global[layer][:4097].cpu(), device.v_global[layer].cpu())
    assert host._store_widths and all(host._store_widths.values())


@pytest.mark.gpu
def test_flashinfer_and_the_lfps_step_read_the_host_store_as_device_memory():
    """FlashInfer's paged decode and LFPS's Triton step over the host store give bit for bit
    what they give over the same K/V in GPU memory."""
    _need_cuda()
    import flashinfer
    from kernels.paged_data import make_paged, random_lfps_state

    from redknot.lfps import LfpsParams
    from redknot.lfps.batched import LfpsBudgets, lfps_decode_step

    Hq, Hkv, D, lens = 32, 8, 128, [5000, 900, 3000]
    batch = make_paged([n + 1 for n in lens], Hkv, D, torch.bfloat16, device="cuda", seed=3)
    k_host = host_memory.pinned_host_tensor(tuple(batch.k_buffer.shape), torch.bfloat16, "cuda")
    v_host = host_memory.pinned_host_tensor(tuple(batch.v_buffer.shape), torch.bfloat16, "cuda")
    k_host.copy_(batch.k_buffer)
    v_host.copy_(batch.v_buffer)
    q = torch.randn(len(lens), Hq, D, device="cuda", dtype=torch.bfloat16)
    seq = torch.tensor([n + 1 for n in lens], device="cuda")
    rows = batch.req_to_token[batch.req_pool_indices]
    indices = torch.cat([rows[b, : n + 1] for b, n in enumerate(lens)]).int()
    indptr = torch.tensor([0] + list(torch.cumsum(seq, 0).tolist()), device="cuda").int()
    last = torch.ones(len(lens), dtype=torch.int32, device="cuda")
    outs = []
    for k_store, v_store in ((batch.k_buffer, batch.v_buffer), (k_host, v_host)):
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            torch.empty(128 << 20, dtype=torch.uint8, device="cuda"), "NHD"
        )
        wrapper.plan(indptr, indices, last, Hq, Hkv, D, 1, q_data_type=torch.bfloat16)
        outs.append(wrapper.run(q, (k_store.unsqueeze(1), v_store.unsqueeze(1))))
    assert torch.equal(outs[0], outs[1])

    params = LfpsParams(budget=0.02)
    top = params.budget_for(max(lens) + 2)
    budgets = LfpsBudgets(candidates=4 * top, topk=top)
    state = random_lfps_state(len(lens), Hq, Hkv, D, 4, max(lens) + 2, seed=4).to("cuda")
    paged = (batch.req_to_token, batch.req_pool_indices, seq)
    on_gpu, on_host = state.clone(), state.clone()
    want = lfps_decode_step(q, batch.k_buffer, batch.v_buffer, *paged, on_gpu, params, budgets)
    got = lfps_decode_step(q, k_host, v_host, *paged, on_host, params, budgets)
    assert torch.equal(got.output, want.output) and torch.equal(got.selected, want.selected)
    assert torch.equal(on_host.vertical, on_gpu.vertical)


def test_lfps_rows_default_to_what_the_host_store_holds(monkeypatch):
    """Without --redknot-lfps-max-requests an offloading server gets a row of LFPS state for
    every full-context request its host store holds (at least 8); in GPU memory, 8; a given
    count is kept."""
    from sglang.srt.runtime_context import get_parallel

    assert sizing.lfps_request_rows(None, 0, 4096, 4096) == 8
    assert sizing.lfps_request_rows(None, 2 * GiB, 4096, 4096) == 128
    assert sizing.lfps_request_rows(None, 16 << 20, 4096, 4096) == 8  # holds 1: still 8
    assert sizing.lfps_request_rows(3, 2 * GiB, 4096, 4096) == 3
    config = RedknotConfig(**OFFLOAD, lfps_offload_gb=2.0)
    monkeypatch.setenv(envs.REDKNOT_RESOLVED_CONFIG.name, config.to_json())
    monkeypatch.setattr(host_memory, "meminfo_bytes", lambda field: 64 * GiB)
    with get_parallel().override(attn_tp_size=1, attn_tp_rank=0):
        kvc = bare_configurator()
        assert sizing.reserve_local_bytes(kvc, 10**9) == 2 * GiB
        token = sizing.cell_size(kvc)
    _, rows = sizing.state_of(kvc)["lfps"]
    assert rows == 2 * GiB // token // 4096 and rows > 8


def test_a_tiered_store_puts_token_slots_in_the_gpu_budget_first(monkeypatch, caplog):
    """Where the driver maps both memories into one range, the GPU's KV budget left after the
    LFPS state holds token slots beside the host store's, the LFPS rows count the full-context
    requests both hold, and the log says so; where it does not, the store is host memory only
    and the log says why."""
    from sglang.srt.runtime_context import get_parallel

    from redknot.lfps.serving import state_bytes
    from redknot.pool import vmm

    row, token, ctx = 1000, 4096, 4096
    assert sizing.lfps_request_rows(None, 2 * GiB, token, ctx, 1 * GiB, row) == (
        3 * GiB // (token * ctx + row)
    )  # 191, where the host store alone holds 128
    assert sizing.lfps_request_rows(None, 2 * GiB, token, ctx, 0, row) == 128
    config = RedknotConfig(**OFFLOAD, lfps_offload_gb=2.0)
    monkeypatch.setenv(envs.REDKNOT_RESOLVED_CONFIG.name, config.to_json())
    monkeypatch.setattr(host_memory, "meminfo_bytes", lambda field: 64 * GiB)
    budget = 4 * GiB
    with get_parallel().override(attn_tp_size=1, attn_tp_rank=0):
        kvc = bare_configurator()
        monkeypatch.setattr(sizing, "tiered_store_usable", lambda kvc: True)
        with caplog.at_level("INFO"):
            got = sizing.reserve_local_bytes(kvc, budget)
        cell = sizing.cell_size(kvc)
        shape, rows = sizing.state_of(kvc)["lfps"]
        device = budget - state_bytes(shape, rows)
        assert got == 2 * GiB + device
        assert sizing.state_of(kvc)["device_token_slots"] == device // cell
        per_row = state_bytes(shape, 1) - state_bytes(shape, 0)
        assert rows == (2 * GiB + budget) // (cell * shape.max_len + per_row)
        assert rows > 2 * GiB // cell // shape.max_len
        assert "GPU's KV budget first" in caplog.text
        caplog.clear()
        kvc = bare_configurator()
        monkeypatch.undo()
        monkeypatch.setenv(envs.REDKNOT_RESOLVED_CONFIG.name, config.to_json())
        monkeypatch.setattr(host_memory, "meminfo_bytes", lambda field: 64 * GiB)

        def refused():
            raise vmm.VmmError("cuMemCreate returned CUDA error 801")

        monkeypatch.setattr(vmm, "driver", refused)
        with caplog.at_level("INFO"):
            assert sizing.reserve_local_bytes(kvc, budget) == 2 * GiB
        assert "cannot hold token slots beside the host store (cuMemCreate" in caplog.text
        assert sizing.state_of(kvc)["device_token_slots"] == 0
