"""The startup gate as a server runs it: the redknot backend, built by SGLang's factory from the
published configuration, checks its attention path before it is returned; a wrong kernel stops
startup; --redknot-skip-startup-check parses from the CLI, the config file and sgl.Engine
keywords, and skipping says that the kernels are unverified. The FlashInfer dispatch (CUDA only)
is checked by the GPU-marked test at the end (`python3 benchmarks/gpu_run.py check`)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from redknot.config import RedknotConfig, RedknotConfigError
from redknot.headmap import ModelShape, synthetic_map

TINY = {  # a Llama of the smallest shape redknot serves: 4 query / 2 KV heads, head_dim 64
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_hidden_layers": 3,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "vocab_size": 256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "torch_dtype": "bfloat16",
}


def _parse(model_dir, *extra, device="cpu"):
    from sglang.srt.server_args import prepare_server_args

    argv = ["--model-path", str(model_dir), "--load-format", "dummy", "--device", device]
    return prepare_server_args(argv + list(extra))


def _published() -> RedknotConfig:
    from redknot.integration.server_args import published_config

    return published_config()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-llama")
    (d / "config.json").write_text(json.dumps(TINY))
    return d


@pytest.fixture(scope="module")
def tiny_map(tiny_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("maps") / "tiny-g0.5.json"
    synthetic_map(ModelShape.from_hf_config(TINY), 0.5, sink=2, window=4, seed=1).save(path)
    return path


@pytest.fixture
def fresh_gate(monkeypatch):
    """The gate of one TP rank of one, as in a scheduler process; it runs once per process and
    shape, and these tests build the backend again."""
    from sglang.srt.runtime_context import get_parallel

    from redknot.attention import startup_check

    monkeypatch.setattr(startup_check, "_passed", set())
    with get_parallel().override(attn_tp_size=1, attn_tp_rank=0):
        yield startup_check


# ---- the option --------------------------------------------------------------------------


def test_skip_option_parses_from_cli_config_file_and_engine(sglang_plugins, llama_dir, tmp_path):
    from sglang.srt.server_args import ServerArgs

    _parse(llama_dir, "--attention-backend", "redknot", "--redknot-all-global")
    assert _published().skip_startup_check is False
    _parse(
        llama_dir, "--attention-backend", "redknot", "--redknot-all-global",
        "--redknot-skip-startup-check",
    )  # fmt: skip
    assert _published() == RedknotConfig(all_global=True, skip_startup_check=True)
    cfg = tmp_path / "redknot.yaml"
    cfg.write_text("all_global: true\nskip_startup_check: true\n")
    _parse(llama_dir, "--attention-backend", "redknot", "--redknot-config", str(cfg))
    assert _published().skip_startup_check is True
    ServerArgs(
        model_path=str(llama_dir), load_format="dummy", device="cpu", attention_backend="redknot",
        redknot_all_global=True, redknot_skip_startup_check=True,
    )  # fmt: skip
    assert _published().skip_startup_check is True
    cfg.write_text(json.dumps({"all_global": True, "skip_startup_check": "yes"}))
    with pytest.raises(RedknotConfigError, match="skip_startup_check must be true or false"):
        _parse(llama_dir, "--attention-backend", "redknot", "--redknot-config", str(cfg))


def test_skip_flag_is_documented_in_help(sglang_plugins):
    import argparse

    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    help_text = parser.format_help()
    assert "--redknot-skip-startup-check" in help_text


def test_every_redknot_option_renders_its_help_as_written(sglang_plugins):
    """argparse formats help strings with ``%``: a bare ``%`` in an option's text breaks
    ``launch_server --help`` or prints the option's internals in place of the text."""
    import argparse

    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    formatter = parser._get_formatter()
    ours = [a for a in parser._actions if any(o.startswith("--redknot") for o in a.option_strings)]
    assert len(ours) > 20
    for action in ours:
        assert formatter._expand_help(action) == action.help.replace("%%", "%"), action.dest


# ---- the backend runs the gate -----------------------------------------------------------


def _model_runner(args, layout_dtype=torch.bfloat16, segments=False):
    """What the redknot backend reads of SGLang's ModelRunner, with a pool built as the pool hook
    builds it and the model's attention layers (no weights: the gate needs none); with
    ``segments``, a segment region in the pool and the model's RoPE."""
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    from redknot.integration.server_args import published_config, rank_layout
    from redknot.kernels.rope_reference import sglang_rope
    from redknot.pool.kv_pool import RedknotKVPool
    from redknot.pool.segment_region import plan_segments

    mc = args.get_model_config()
    layout = rank_layout(published_config(), mc)
    req_pool = ReqToTokenPool(4, mc.context_len + 4, "cpu", enable_memory_saver=False)
    plan = plan_segments([layout], layout_dtype, 10**6, 0.1, "local") if segments else None
    pool = RedknotKVPool(256, 1, layout_dtype, layout, num_rings=5, num_snapshots=0,
                         device="cpu", segment_plan=plan)  # fmt: skip
    model = torch.nn.ModuleList(
        RadixAttention(4, 64, 0.125, 2, layer_id=i) for i in range(TINY["num_hidden_layers"])
    )
    if segments:
        model.append(sglang_rope(64, 64, 512, 10000.0, True))
    return SimpleNamespace(
        model_config=mc, model=model, device="cpu", dtype=layout_dtype,
        kv_cache_dtype=layout_dtype, use_mla_backend=False, is_hybrid_swa=False,
        sliding_window_size=None, req_to_token_pool=req_pool, token_to_kv_pool=pool,
    )  # fmt: skip


def _build_backend(runner):
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

    return ATTENTION_BACKENDS["redknot"](runner)


def _perturb_decode(monkeypatch):
    from redknot.attention import segpaged_runner

    real = segpaged_runner.run_decode

    def perturbed(plan, q, *args, **kwargs):
        out = real(plan, q, *args, **kwargs)
        out[1, 2] -= 0.5  # request 1 (the one shorter than sink + window), query head 2
        return out

    monkeypatch.setattr(segpaged_runner, "run_decode", perturbed)


MAP_FLAGS = ("--attention-backend", "redknot", "--redknot-sink", "2", "--redknot-window", "4")


def test_backend_with_local_heads_passes_the_gate_before_it_is_returned(
    sglang_plugins, tiny_dir, tiny_map, fresh_gate, gate_log
):
    args = _parse(tiny_dir, *MAP_FLAGS, "--redknot-head-map", str(tiny_map))
    backend = _build_backend(_model_runner(args))
    assert backend.path == "segpaged" and not backend.layout.all_global
    (line,) = [m for m in gate_log if "startup check passed" in m]
    assert "LlamaForCausalLM on TP rank 0/1: 4 query / 2 KV heads, head_dim 64" in line
    rows = {"G" * 2} | set(backend.layout.classes)
    assert f"on {len(rows)} head-class row(s)" in line


def test_with_segments_the_gate_also_checks_the_reuse_kernels(
    sglang_plugins, tiny_dir, tiny_map, fresh_gate, gate_log
):
    args = _parse(tiny_dir, *MAP_FLAGS, "--redknot-head-map", str(tiny_map))
    backend = _build_backend(_model_runner(args, segments=True))
    assert backend.segpaged.rope is not None
    (line,) = [m for m in gate_log if "segment reuse's kernels" in m]
    assert "(local of layer 0" in line and "match their references on cpu" in line


def test_a_wrong_kernel_stops_the_backend_from_being_built(
    sglang_plugins, tiny_dir, tiny_map, fresh_gate, monkeypatch
):
    _perturb_decode(monkeypatch)
    args = _parse(tiny_dir, *MAP_FLAGS, "--redknot-head-map", str(tiny_map))
    with pytest.raises(fresh_gate.StartupCheckError) as e:
        _build_backend(_model_runner(args))
    msg = str(e.value)
    assert msg.startswith("redknot startup check failed for LlamaForCausalLM on TP rank 0/1")
    assert "  - decode, head classes " in msg and "worst at request 1 (prefix 1, 3 new)" in msg
    assert "query head 2 (KV head 1, " in msg
    assert "--redknot-skip-startup-check" in msg and "unverified" in msg


def test_skipping_builds_the_backend_unverified_and_says_so(
    sglang_plugins, tiny_dir, fresh_gate, monkeypatch, gate_log
):
    _perturb_decode(monkeypatch)  # would fail the gate: skipping must not run it
    args = _parse(
        tiny_dir, *MAP_FLAGS, "--redknot-all-global", "--redknot-kernel", "triton",
        "--redknot-skip-startup-check",
    )  # fmt: skip
    backend = _build_backend(_model_runner(args))
    assert backend.path == "segpaged"
    (line,) = [m for m in gate_log if "startup check skipped" in m]
    assert "--redknot-skip-startup-check" in line and "unverified" in line
    assert not any("startup check passed" in m for m in gate_log)


# ---- GPU: the FlashInfer dispatch --------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flashinfer_dispatch_passes_the_gate_on_gpu(
    sglang_plugins, llama_dir, fresh_gate, monkeypatch, request, dtype
):
    """Every head global with --redknot-kernel auto: SGLang's FlashInfer backend, built over the
    gate's own pool, matches the reference at the Llama-3.1-8B shape; a perturbed FlashInfer
    output fails it."""
    from sglang.srt.layers.attention import flashinfer_backend
    from sglang.srt.layers.attention.flashinfer_backend import FlashInferAttnBackend
    from sglang.srt.runtime_context import publish, reset_context

    from redknot.pool.layout import HeadLayout

    args = _parse(llama_dir, "--attention-backend", "redknot", "--redknot-all-global",
                  device="cuda")  # fmt: skip
    # A scheduler publishes its server args before it builds the attention backend; FlashInfer's
    # constructor reads the parallel configuration from there.
    publish(args, role="test")
    request.addfinalizer(reset_context)
    # Its CUDA-graph batch bound needs SGLang's process groups, which a server has and this
    # test does not; the bound only sizes index buffers, so the pool size stands in for it.
    monkeypatch.setattr(
        flashinfer_backend, "get_cuda_graph_max_batch_size", lambda _args, size: size
    )
    runner = SimpleNamespace(
        server_args=args, model_config=args.get_model_config(), device="cuda", dtype=dtype,
        kv_cache_dtype=dtype, page_size=1, sliding_window_size=None, is_draft_worker=False,
        init_new_workspace=False,
    )  # fmt: skip
    layout = HeadLayout(classes=("G" * 8,) * 32, num_q_heads=32, head_dim=128, window=256, sink=64)
    served = fresh_gate.ServedAttention(
        layout=layout, dtype=dtype, kv_dtype=dtype, device=torch.device("cuda"),
        max_context_len=131072, table_width=131076, model="Llama-3.1-8B shape",
    )  # fmt: skip
    results = fresh_gate.run_startup_check(served, "dense", runner)
    assert [r.case for r in results] == ["prefill", "extend", "decode"]
    assert all(r.bad == 0 for r in results)

    real = FlashInferAttnBackend.forward_extend

    def perturbed(self, q, *args, **kwargs):
        out = real(self, q, *args, **kwargs)
        out[5, :128] += 0.5  # token 5 (request 0), query head 0
        return out

    monkeypatch.setattr(FlashInferAttnBackend, "forward_extend", perturbed)
    with pytest.raises(fresh_gate.StartupCheckError) as e:
        fresh_gate.run_startup_check(served, "dense", runner)
    msg = str(e.value)
    assert "the FlashInfer path (dense dispatch) differs" in msg
    assert "  - prefill, head classes GGGGGGGG" in msg and "query head 0 (KV head 0" in msg


# ---- segment reuse's sparse layers ----------------------------------------------------------


def test_sparse_layers_refuse_settings_that_would_silently_change_them(sglang_plugins):
    """A model class without redknot's hooks and a segment region without the global heads that
    rows leaving recovery read stop startup with the fix in the message. A prefill CUDA graph
    does not (reusing batches run eagerly: test_prefill_graph_gate.py)."""
    from sglang.srt.models.llama import LlamaDecoderLayer, LlamaMLP

    from redknot.attention.backend import _check_sparse_layers
    from redknot.pool.layout import HeadLayout

    def decoder(cls, mlp_cls):
        layer = cls.__new__(cls)  # only the classes matter: no weights, no parallel state
        object.__setattr__(layer, "mlp", mlp_cls.__new__(mlp_cls))
        return layer

    llama = decoder(LlamaDecoderLayer, LlamaMLP)

    def model_runner(graph="disabled", layer=llama):
        graphs = SimpleNamespace(prefill=SimpleNamespace(backend=graph))
        return SimpleNamespace(
            server_args=SimpleNamespace(cuda_graph_config=graphs),
            model=SimpleNamespace(modules=lambda: [SimpleNamespace(), layer]),
        )

    layout = HeadLayout(classes=("GL", "LG"), num_q_heads=4, head_dim=64, window=4, sink=2)

    def runner(heads):
        return SimpleNamespace(
            layout=layout, pool=SimpleNamespace(segments=SimpleNamespace(heads=heads))
        )

    every, local = ((0, 1), (0, 1)), ((1,), (0,))
    cached = RedknotConfig(all_global=True, dense_layers=1)
    residual = RedknotConfig(all_global=True, dense_layers=1, skipped="residual")
    _check_sparse_layers(model_runner(), runner(every), cached)
    _check_sparse_layers(model_runner(), runner(local), residual)
    _check_sparse_layers(model_runner("breakable"), runner(every), cached)
    with pytest.raises(ValueError, match=r"layer 0 lacks heads \[0\].*--redknot-segment-heads all"):
        _check_sparse_layers(model_runner(), runner(local), cached)

    class PlainLayer(torch.nn.Module):
        def forward(self, *args):
            raise AssertionError("never run")

    plain = decoder(PlainLayer, LlamaMLP)
    _check_sparse_layers(model_runner(layer=plain), runner(local), residual)  # MLP is hooked
    with pytest.raises(ValueError, match="needs redknot's hook on .*PlainLayer.forward"):
        _check_sparse_layers(model_runner(layer=plain), runner(every), cached)
    blend = RedknotConfig(policy="cacheblend")  # every head global, segment heads 'all'
    _check_sparse_layers(model_runner(), runner(every), blend)
    _check_sparse_layers(model_runner("breakable"), runner(every), blend)
    with pytest.raises(ValueError, match="--redknot-policy cacheblend needs redknot's hook on"):
        _check_sparse_layers(model_runner(layer=plain), runner(every), blend)


def test_the_dense_path_refuses_a_segment_region_it_would_never_fill():
    from redknot.attention.backend import _check_dense_path

    _check_dense_path(SimpleNamespace(segments=None))  # segments off: dense serving
    with pytest.raises(ValueError, match="does not cache or reuse segments.*--redknot-kernel tri"):
        _check_dense_path(SimpleNamespace(segments=object()))
