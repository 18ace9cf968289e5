"""The startup gate (redknot.attention.startup_check) on a tiny shape: the Triton path with local
heads passes under the interpreter; kernels made wrong on purpose fail it with a message that
says where, by how much, and how to skip it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from redknot.attention import segpaged_runner
from redknot.attention.check_batch import synthetic_requests
from redknot.attention.startup_check import (
    ROW_CASES,
    ServedAttention,
    StartupCheckError,
    check_reuse_kernels,
    checked_rows,
    reuse_launches,
    run_startup_check,
)
from redknot.kernels import extend as extend_mod
from redknot.pool.layout import HeadLayout

SINK, WINDOW = 2, 4


def _served(classes=("GL", "LG", "GL"), dtype=torch.bfloat16) -> ServedAttention:
    layout = HeadLayout(classes=classes, num_q_heads=4, head_dim=64, window=WINDOW, sink=SINK)
    return ServedAttention(
        layout=layout, dtype=dtype, kv_dtype=dtype, device=torch.device("cpu"),
        max_context_len=512, table_width=160, model="TinyLlama",
    )  # fmt: skip


def test_requests_cover_short_long_and_crossing_the_span():
    for sink, window in [(2, 4), (64, 256), (0, 1000), (4, 1)]:
        span = sink + window
        reqs = synthetic_requests(sink, window, max_len=4096)
        assert len({r.row for r in reqs}) == 3 and min(r.row for r in reqs) >= 1
        assert reqs[0].prefix > span  # its ring has wrapped before the extend
        assert reqs[2].prefix < span < reqs[2].prefix + reqs[2].new  # the extend crosses it
        if span > 5:
            assert reqs[1].length < span
    assert all(r.length <= 100 for r in synthetic_requests(64, 256, max_len=100))


def test_checked_rows_are_every_head_global_then_each_distinct_row():
    layout = _served(("GL", "LG", "GL", "GG")).layout
    assert checked_rows(layout, "segpaged") == [("GG", 3), ("GL", 0), ("LG", 1)]
    assert checked_rows(layout, "dense") == [("GG", 3)]


def test_triton_path_with_local_heads_passes(gate_log):
    results = run_startup_check(_served(), "segpaged")
    rows = ("GG", "GL", "LG")
    reuse = []  # per row, the extend as segment reuse runs it, then as a plain extend does
    for name, _, with_lse, _ in ROW_CASES:
        reuse += [name] + ([name + ": log-sum-exp"] if with_lse else [])
    want = [("prefill", row) for row in rows]
    want += [(c, row) for row in rows for c in reuse + ["extend"]]
    want += [(c, row) for c in ("decode", "decode (graph plan)") for row in rows]
    assert [(r.case, r.row) for r in results] == want
    assert len(reuse) == 7 and all(r.bad == 0 and r.ratio <= 1 for r in results)
    (line,) = [m for m in gate_log if "startup check passed" in m]
    assert "TinyLlama on TP rank 0/1: 4 query / 2 KV heads, head_dim 64" in line
    assert "sink 2 + window 4" in line and "the Triton path" in line and " s" in line


def _restoring(classes=("GL", "LG", "GL")) -> ServedAttention:
    served = _served(classes)
    return dataclasses.replace(served, layout=dataclasses.replace(served.layout, restore=1))


def test_adaptive_restore_is_checked_with_a_promoting_request(gate_log):
    """With restore columns every launch passes the promoted-head table, and request 0
    promotes the local head of each row: the gate passes, and a kernel that ignores the table
    fails it on that request's promoted head only."""
    results = run_startup_check(_restoring(), "segpaged")
    assert all(r.bad == 0 for r in results) and len(results) == 33
    assert any("startup check passed" in m for m in gate_log)


def test_a_kernel_that_ignores_promoted_heads_fails_the_gate(monkeypatch):
    real_extend, real_decode = segpaged_runner.run_extend, segpaged_runner.run_decode
    monkeypatch.setattr(segpaged_runner, "run_extend",
                        lambda *a, promoted=None, **k: real_extend(*a, **k))  # fmt: skip
    monkeypatch.setattr(segpaged_runner, "run_decode",
                        lambda *a, promoted=None, **k: real_decode(*a, **k))  # fmt: skip
    with pytest.raises(StartupCheckError) as e:
        run_startup_check(_restoring(), "segpaged")
    lines = _case_lines(str(e.value))
    assert lines and all("worst at request 0 " in x for x in lines)
    assert all("local, promoted by the request)" in x for x in lines)


def test_a_perturbed_merge_of_split_keys_fails_the_gate(monkeypatch):
    """The extend with global rows' keys split (checked with 3 runs, as a short question over a
    long prefix is served) is compared like the others: an off merge stops startup."""
    real = extend_mod.run_extend

    def perturbed(plan, q, *args, num_splits=None, **kwargs):
        out = real(plan, q, *args, num_splits=num_splits, **kwargs)
        if num_splits is not None and num_splits > 1:
            out[0, 0] += 0.25  # the first row, query head 0 (of global KV head 0)
        return out

    monkeypatch.setattr(extend_mod, "run_extend", perturbed)
    with pytest.raises(StartupCheckError) as e:
        run_startup_check(_served(), "segpaged")
    assert "keys split in 3" in str(e.value)
    assert "extend (with LSE)" not in str(e.value)  # the unsplit launches still pass


def test_a_perturbed_decode_kernel_fails_the_gate(monkeypatch):
    real = segpaged_runner.run_decode

    def perturbed(plan, q, *args, **kwargs):
        out = real(plan, q, *args, **kwargs)
        out[0, 1] += 0.25  # request 0, query head 1
        return out

    monkeypatch.setattr(segpaged_runner, "run_decode", perturbed)
    with pytest.raises(StartupCheckError) as e:
        run_startup_check(_served(), "segpaged")
    msg = str(e.value)
    assert "TinyLlama on TP rank 0/1: 4 query / 2 KV heads, head_dim 64, bfloat16 on cpu" in msg
    assert "tolerance |out - ref| <= 0.02 + 0.02 * |ref| for bfloat16" in msg
    lines = [x for x in msg.splitlines() if x.startswith("  - ")]
    assert len(lines) == 6  # decode and decode (graph plan), each for GG, GL and LG
    assert all(x.startswith(("  - decode, ", "  - decode (graph plan), ")) for x in lines)
    # 3 requests x 4 query heads x 64 dims; the 64 values of request 0, query head 1 are off
    assert all("64 of 768 values beyond tolerance" in x for x in lines)
    assert all("query head 1 (KV head 0, " in x for x in lines)
    assert "worst at request 0 (prefix " in lines[0]
    max_err = float(lines[0].split("max |out - ref| ")[1].split(",")[0])
    assert 0.2 < max_err < 0.3
    assert "--redknot-skip-startup-check" in msg and "unverified" in msg


def _case_lines(message: str) -> list[str]:
    """The failing cases a gate error lists (not its "and N more" line)."""
    return [x for x in message.splitlines() if x.startswith("  - ") and " more case" not in x]


def test_a_wrong_log_sum_exp_or_packed_row_fails_the_gate(monkeypatch):
    """The extend as segment reuse runs it is checked too: a log-sum-exp off by 0.5 for query
    head 1, or the packed rows' outputs shifted by one row, stop startup."""
    from redknot.kernels import extend

    real = extend.run_extend

    def wrong_lse(plan, q, *args, lse=None, **kwargs):
        out = real(plan, q, *args, lse=lse, **kwargs)
        if lse is not None:
            lse[:, 1] += 0.5
        return out

    monkeypatch.setattr(extend, "run_extend", wrong_lse)
    with pytest.raises(StartupCheckError) as e:
        run_startup_check(_served(), "segpaged")
    lines = _case_lines(str(e.value))
    assert lines and all(": log-sum-exp, head classes " in x for x in lines)
    assert all("query head 1 (KV head 0, " in x for x in lines)

    def shifted(plan, q, *args, **kwargs):
        out = real(plan, q, *args, **kwargs)
        if plan.gathered:
            out.copy_(out.roll(1, dims=0))
        return out

    monkeypatch.setattr(extend, "run_extend", shifted)
    with pytest.raises(StartupCheckError) as e:
        run_startup_check(_served(), "segpaged")
    lines = _case_lines(str(e.value))
    assert lines and all(x.startswith("  - extend (every third row, packed") for x in lines)


def test_a_kernel_that_drops_the_sink_fails_on_local_heads_only(monkeypatch):
    real = segpaged_runner.run_extend

    def no_sink(plan, *args, **kwargs):
        geo = dataclasses.replace(plan.geometry, sink=0)
        return real(dataclasses.replace(plan, geometry=geo), *args, **kwargs)

    monkeypatch.setattr(segpaged_runner, "run_extend", no_sink)
    with pytest.raises(StartupCheckError) as e:
        run_startup_check(_served(), "segpaged")
    lines = _case_lines(str(e.value))
    failed = {(x[4:].split(",")[0], x.split("head classes ")[1][:2]) for x in lines}
    # every-head-global rows never read a sink; local heads of the long requests do
    assert failed == {("prefill", "GL"), ("prefill", "LG"), ("extend", "GL"), ("extend", "LG")}
    assert all(", local)" in x for x in lines)


def test_a_kernel_that_cannot_run_stops_startup_with_the_case(monkeypatch):
    def broken(*args, **kwargs):
        raise AssertionError("k_global: shape mismatch")

    monkeypatch.setattr(segpaged_runner, "run_extend", broken)
    with pytest.raises(StartupCheckError) as e:
        run_startup_check(_served(), "segpaged")
    msg = str(e.value)
    assert (
        "could not run the Triton path (redknot's SegPaged kernels) (prefill) for TinyLlama" in msg
    )
    assert "AssertionError: k_global: shape mismatch" in msg
    assert "--redknot-skip-startup-check" in msg


# ---- GPU: compiled kernels at a real shape -----------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_path_passes_the_gate_at_llama_shape_on_gpu(dtype, monkeypatch):
    """Llama-3.1-8B's attention shape (32 query / 8 KV heads, head_dim 128), sink 64 + window 256,
    rows as a 1/8-global map has them; a perturbed decode output fails it."""
    classes = ("GLLLLLLL", "LLLGLLLL", "GLGLGGLL", "LLLLLLLL", "GGGGGGGG")
    layout = HeadLayout(classes=classes, num_q_heads=32, head_dim=128, window=256, sink=64)
    served = ServedAttention(
        layout=layout, dtype=dtype, kv_dtype=dtype, device=torch.device("cuda"),
        max_context_len=131072, table_width=131076, model="Llama-3.1-8B shape",
    )  # fmt: skip
    results = run_startup_check(served, "segpaged")
    per_row = 4 + sum(1 + with_lse for _, _, with_lse, _ in ROW_CASES)
    assert len(results) == per_row * len(classes) and all(r.bad == 0 for r in results)
    real = segpaged_runner.run_decode

    def perturbed(plan, q, *args, **kwargs):
        out = real(plan, q, *args, **kwargs)
        out[2, 7] += 0.25  # request 2, query head 7 (KV head 1)
        return out

    monkeypatch.setattr(segpaged_runner, "run_decode", perturbed)
    with pytest.raises(StartupCheckError, match=r"query head 7 \(KV head 1, "):
        run_startup_check(served, "segpaged")


@pytest.mark.gpu
def test_triton_path_with_restore_passes_the_gate_at_llama_shape_on_gpu():
    """With one restore column per layer (request 0 promotes a local head of every row): the
    restore variants of the kernels compile and match the reference on the GPU."""
    classes = ("GLLLLLLL", "LLLGLLLL", "LLLLLLLL")
    layout = HeadLayout(classes=classes, num_q_heads=32, head_dim=128, window=256, sink=64,
                        restore=1)  # fmt: skip
    served = ServedAttention(
        layout=layout, dtype=torch.bfloat16, kv_dtype=torch.bfloat16,
        device=torch.device("cuda"), max_context_len=131072, table_width=131076,
        model="Llama-3.1-8B shape",
    )  # fmt: skip
    results = run_startup_check(served, "segpaged")
    per_row = 4 + sum(1 + with_lse for _, _, with_lse, _ in ROW_CASES)
    assert len(results) == per_row * (len(classes) + 1) and all(r.bad == 0 for r in results)


# ---- segment reuse's RoPE re-alignment and key mass ---------------------------------------------


def _reuse_world(dense_layers: int, segment_heads: str, layout=None, device="cpu"):
    """A runner over a pool with a segment region (``layout``: 4 layers of 2 KV heads by
    default), a plain RoPE, the layer schedule from ``dense_layers`` on; and the
    ServedAttention the gate would build for it."""
    from redknot.attention.segpaged_runner import SegPagedRunner
    from redknot.kernels.rope_align import alignable_rope
    from redknot.kernels.rope_reference import sglang_rope
    from redknot.pool.kv_pool import RedknotKVPool
    from redknot.pool.segment_region import plan_segments

    layout = layout or HeadLayout(classes=("GL", "LG", "GG", "LL"), num_q_heads=4, head_dim=64,
                                  window=WINDOW, sink=SINK)  # fmt: skip
    dtype, d = torch.bfloat16, layout.head_dim
    plan = plan_segments([layout], dtype, 10**8, 0.1, segment_heads)
    pool = RedknotKVPool(600, 1, dtype, layout, num_rings=6, num_snapshots=0, device=device,
                         segment_plan=plan)  # fmt: skip
    table = torch.zeros((6, 200), dtype=torch.int32, device=device)
    runner = SegPagedRunner(layout, pool, table, 6, 200, torch.device(device))
    runner.rope = alignable_rope(sglang_rope(d, d, 4096, 10000.0, True).to(device))
    runner.dense_layers = dense_layers
    served = ServedAttention(
        layout=layout, dtype=dtype, kv_dtype=dtype, device=torch.device(device),
        max_context_len=200, table_width=200, model="TinyLlama",
    )  # fmt: skip
    return runner, served


def test_reuse_launches_are_each_distinct_launch_shape():
    runner, _ = _reuse_world(dense_layers=4, segment_heads="local")
    assert reuse_launches(runner) == [("local", 0), ("local", 3)]  # widths 1 and 2
    runner, _ = _reuse_world(dense_layers=1, segment_heads="all")
    assert reuse_launches(runner) == [
        ("local", 0), ("left", 0), ("mass", 1), ("left", 2), ("mass", 2), ("local", 3),
    ]  # fmt: skip
    # fresh: no local launch; rows that leave take every stored head, 2 of 2 in every layer,
    # so one left launch shape serves all layers
    runner.local_kv = "fresh"
    assert reuse_launches(runner) == [("left", 0), ("mass", 1), ("mass", 2)]
    assert [len(runner.left_heads(lid)) for lid in range(4)] == [2, 2, 2, 2]


def test_fresh_local_kv_checks_the_launch_of_every_stored_head():
    runner, served = _reuse_world(dense_layers=1, segment_heads="all")
    runner.local_kv = "fresh"
    assert check_reuse_kernels(runner, served) == 3


def test_reuse_kernels_pass_and_a_wrong_alignment_or_mass_stops_startup(monkeypatch, gate_log):
    import importlib

    # the modules (the package re-exports a function under the name rope_align)
    rope_align = importlib.import_module("redknot.kernels.rope_align")
    key_mass = importlib.import_module("redknot.kernels.key_mass")
    runner, served = _reuse_world(dense_layers=1, segment_heads="all")
    assert check_reuse_kernels(runner, served) == 6
    (line,) = [m for m in gate_log if "segment reuse's kernels" in m]
    assert "local of layer 0, left of layer 0, mass of layer 1" in line

    real_align, real_mass = rope_align.rope_align, key_mass.key_mass

    def misaligned(k_src, src_rows, k_dst, dst_rows, *args, **kwargs):
        real_align(k_src, src_rows, k_dst, dst_rows, *args, **kwargs)
        k_dst[dst_rows[5], :, 3] += 0.5  # one key's dim 3, every head moved

    monkeypatch.setattr(rope_align, "rope_align", misaligned)
    with pytest.raises(StartupCheckError) as e:
        check_reuse_kernels(runner, served)
    msg = str(e.value)
    assert "RoPE re-alignment (redknot/kernels/rope_align.py) differs from its reference" in msg
    assert "(local launch, shaped as in layer 0; keys)" in msg
    assert "--redknot-segment-fraction 0" in msg and "--redknot-skip-startup-check" in msg

    def off_mass(*args, **kwargs):
        out = real_mass(*args, **kwargs)
        out[7] += 0.01
        return out

    monkeypatch.setattr(rope_align, "rope_align", real_align)
    monkeypatch.setattr(key_mass, "key_mass", off_mass)
    with pytest.raises(
        StartupCheckError, match=r"key mass .* \(mass launch, shaped as in layer 1;"
    ):
        check_reuse_kernels(runner, served)


@pytest.mark.gpu
def test_reuse_kernels_pass_the_gate_at_llama_shape_on_gpu():
    """Llama-3.1-8B's attention shape with a 1/8 map, segments keeping every head and the layer
    schedule on: every launch shape of segment reuse matches its reference."""
    classes = ("GLLLLLLL", "LLLGLLLL", "GLGLGGLL", "LLLLLLLL", "GGGGGGGG")
    layout = HeadLayout(classes=classes, num_q_heads=32, head_dim=128, window=256, sink=64)
    runner, served = _reuse_world(1, "all", layout, "cuda")
    launches = reuse_launches(runner)
    assert {name for name, _ in launches} == {"local", "left", "mass"}
    assert check_reuse_kernels(runner, served) == len(launches)


def test_an_offloading_backend_checks_the_path_over_host_memory(monkeypatch):
    """Under --redknot-lfps-offload-gb the gate runs the dense path over a pool in pinned host
    memory with the host-prefix extend (``OffloadPath``, CUDA only), not the dense path over GPU
    memory that such a server never serves."""
    from types import SimpleNamespace

    from redknot.attention import startup_check

    ran = []
    monkeypatch.setattr(startup_check, "run_startup_check", lambda s, path, mr: ran.append(path))
    monkeypatch.setattr(startup_check, "_passed", set())
    served = _served(("GG", "GG"))
    monkeypatch.setattr(startup_check.ServedAttention, "of", lambda mr, layout: served)
    backend = SimpleNamespace(layout=served.layout, path="dense", segpaged=None, dense=object(),
                              host_extend=object())  # fmt: skip
    startup_check.check_backend(backend, None, skip=False)
    backend.host_extend = None
    startup_check.check_backend(backend, None, skip=False)
    assert ran == ["offload", "dense"]
    assert "pinned host memory" in startup_check.PATH_NAMES["offload"]


def test_the_rows_in_recovery_on_flashinfer_are_checked_against_the_reference():
    """``check_held_rows`` with FlashInfer's wrapper stood in for by its PyTorch semantics:
    it passes, and fails loudly when the attention is wrong (a wrapper that halves the
    scale) or when what it plans is not runs."""
    from redknot.attention.startup_check import check_held_rows
    from redknot.kernels.held_rows import (
        HeldRowsAttention,
        PagedPrefillReference,
        merge_state_reference,
    )

    served = _served(classes=("GG", "GG"))
    lay = served.layout

    def held(wrapper=PagedPrefillReference, **kw):
        return HeldRowsAttention(wrapper, merge_state_reference, lay.num_q_heads,
                                 lay.num_kv_heads, lay.head_dim, served.dtype, **kw)  # fmt: skip

    check_held_rows(held(), served)

    class HalfScale(PagedPrefillReference):
        def forward_return_lse(self, q, paged_kv, causal=False, sm_scale=None,
                               logits_soft_cap=None):  # fmt: skip
            return super().forward_return_lse(q, paged_kv, causal, sm_scale / 2, logits_soft_cap)

    with pytest.raises(StartupCheckError, match="differ from the reference"):
        check_held_rows(held(HalfScale), served)
    with pytest.raises(StartupCheckError, match="could not run the rows in recovery"):
        check_held_rows(held(force="blocks"), served)


@pytest.mark.gpu
@pytest.mark.parametrize("q_heads,kv_heads,head_dim", [(32, 8, 128), (9, 3, 64)])
@pytest.mark.parametrize("backend", ["fa2", "auto"])
def test_the_rows_in_recovery_pass_the_check_on_flashinfer(q_heads, kv_heads, head_dim, backend):
    """``check_held_rows`` as a token-policy server runs it at startup, on FlashInfer itself
    (the 8B shape and SmolLM2's, bf16, the FA2 backend a server passes and FlashInfer's own
    choice): it passes, and a run off by a quarter in one value fails it."""
    from redknot.attention.startup_check import check_held_rows
    from redknot.kernels.held_rows import HeldRowsAttention

    classes = ("G" * kv_heads,) * 2
    layout = HeadLayout(classes=classes, num_q_heads=q_heads, head_dim=head_dim, window=WINDOW,
                        sink=SINK)  # fmt: skip
    served = ServedAttention(
        layout=layout, dtype=torch.bfloat16, kv_dtype=torch.bfloat16,
        device=torch.device("cuda"), max_context_len=4096, table_width=4096, model="GPU shape",
    )  # fmt: skip
    workspace = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    held = HeldRowsAttention.on_flashinfer(workspace, q_heads, kv_heads, head_dim,
                                           torch.bfloat16, backend=backend)  # fmt: skip
    check_held_rows(held, served)
    real = held.run

    def perturbed(*args, **kwargs):
        out = real(*args, **kwargs)
        out[5, q_heads - 1, 3] += 0.25
        return out

    held.run = perturbed
    with pytest.raises(StartupCheckError, match="differ from the reference"):
        check_held_rows(held, served)
