"""redknot options on the launch_server command line and sgl.Engine keywords."""

from __future__ import annotations

import json

import pytest

from redknot.config import RedknotConfig, RedknotConfigError
from redknot.headmap import ModelShape, synthetic_map


def _parse(llama_dir, *extra):
    from sglang.srt.server_args import prepare_server_args

    argv = ["--model-path", str(llama_dir), "--load-format", "dummy", "--device", "cpu"]
    return prepare_server_args(argv + list(extra))


def _published():
    from redknot.integration.server_args import published_config

    return published_config()


@pytest.fixture(scope="module")
def llama_map(llama_dir, tmp_path_factory):
    shape = ModelShape.from_hf_config(json.loads((llama_dir / "config.json").read_text()))
    path = tmp_path_factory.mktemp("maps") / "llama-g0.125.json"
    synthetic_map(shape, 0.125).save(path)
    return path


def test_all_global_flag_selects_backend_and_cache(sglang_plugins, llama_dir):
    args = _parse(llama_dir, "--attention-backend", "redknot", "--redknot-all-global")
    assert args.attention_backend == "redknot"
    assert args.radix_cache_backend == "redknot"
    assert _published() == RedknotConfig(all_global=True)


def test_head_map_flag_and_overrides_are_published(sglang_plugins, llama_dir, llama_map):
    _parse(
        llama_dir,
        "--attention-backend",
        "redknot",
        "--redknot-head-map",
        str(llama_map),
        "--redknot-sink",
        "4",
        "--redknot-kernel",
        "triton",
    )
    assert _published() == RedknotConfig(head_map=str(llama_map), sink=4, kernel="triton")


def test_config_file_with_flag_override(sglang_plugins, llama_dir, llama_map, tmp_path):
    cfg = tmp_path / "redknot.json"
    cfg.write_text(json.dumps({"head_map": str(llama_map), "window": 512}))
    _parse(
        llama_dir,
        "--attention-backend",
        "redknot",
        "--redknot-config",
        str(cfg),
        "--redknot-window",
        "128",
    )
    assert _published() == RedknotConfig(head_map=str(llama_map), window=128)


def test_engine_keywords_reach_server_args(sglang_plugins, llama_dir):
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(
        model_path=str(llama_dir),
        load_format="dummy",
        device="cpu",
        attention_backend="redknot",
        redknot_all_global=True,
        redknot_sink=8,
    )
    assert args.radix_cache_backend == "redknot"
    assert _published() == RedknotConfig(all_global=True, sink=8)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--attention-backend", "redknot", "--redknot-policy", "redknot"], "needs a head map"),
        (
            ["--attention-backend", "redknot", "--redknot-head-map", "/no/such/map.json"],
            "does not exist",
        ),
        (
            [
                "--attention-backend",
                "redknot",
                "--redknot-all-global",
                "--redknot-window",
                "200000",
            ],
            "exceeds the context length",
        ),
        (
            ["--attention-backend", "flashinfer", "--redknot-all-global"],
            "add --attention-backend redknot",
        ),
        (
            ["--attention-backend", "redknot", "--redknot-all-global", "--redknot-kernel", "cuda"],
            "is not one of",
        ),
        (
            ["--attention-backend", "redknot", "--redknot-all-global", "--redknot-window", "0"],
            "must be an integer >= 1",
        ),
        (
            [
                "--attention-backend",
                "redknot",
                "--redknot-all-global",
                "--kv-cache-dtype",
                "fp8_e4m3",
            ],
            "kv-cache-dtype",
        ),
        (
            [
                "--attention-backend",
                "redknot",
                "--redknot-all-global",
                "--radix-cache-backend",
                "flexkv",
            ],
            "radix-cache-backend",
        ),
        (
            ["--attention-backend", "redknot", "--redknot-all-global", "--redknot-capture", "yes"],
            "--redknot-capture 'yes' is not one of on, off",
        ),
        (
            [
                "--attention-backend",
                "redknot",
                "--redknot-all-global",
                "--redknot-namespace-fraction",
                "0",
            ],
            r"--redknot-namespace-fraction must be a number in \(0, 1\]",
        ),
        (
            ["--attention-backend", "redknot", "--redknot-all-global"]
            + ["--redknot-auto-segments", "on"],
            "--redknot-auto-segments 'on' is not one of off, cdc",
        ),
        (
            ["--attention-backend", "redknot", "--redknot-all-global"]
            + ["--redknot-auto-segments", "cdc", "--redknot-auto-chunk-tokens", "8"],
            "--redknot-auto-chunk-tokens must be an integer >= 16, got 8",
        ),
        (
            ["--attention-backend", "redknot", "--redknot-all-global"]
            + ["--redknot-auto-segments", "cdc", "--redknot-auto-capture-context", "-1"],
            "--redknot-auto-capture-context must be an integer >= 0, got -1",
        ),
    ],
)
def test_bad_options_fail_at_startup_with_a_fix(sglang_plugins, llama_dir, extra, message):
    with pytest.raises((RedknotConfigError, ValueError), match=message):
        _parse(llama_dir, *extra)


def test_head_map_of_another_model_is_rejected(sglang_plugins, llama_dir, tmp_path):
    other = ModelShape("MistralForCausalLM", 32, 8, 32, 64)
    path = tmp_path / "other.json"
    synthetic_map(other, 0.125, model_name="other-model").save(path)
    with pytest.raises(RedknotConfigError, match=r"does not match the served model.*head_dim"):
        _parse(llama_dir, "--attention-backend", "redknot", "--redknot-head-map", str(path))


def test_unreadable_map_and_config_file(sglang_plugins, llama_dir, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(RedknotConfigError, match="not readable JSON"):
        _parse(llama_dir, "--attention-backend", "redknot", "--redknot-head-map", str(bad))
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({"all_global": True, "windw": 3}))
    with pytest.raises(RedknotConfigError, match="unknown redknot option"):
        _parse(llama_dir, "--attention-backend", "redknot", "--redknot-config", str(cfg))


def test_unknown_engine_keyword_is_rejected(sglang_plugins, llama_dir):
    from sglang.srt.server_args import ServerArgs

    with pytest.raises(RedknotConfigError, match="unknown redknot option 'redknot_windw'"):
        ServerArgs(
            model_path=str(llama_dir),
            load_format="dummy",
            device="cpu",
            attention_backend="redknot",
            redknot_windw=3,
        )


def test_the_flags_a_calibration_record_names_serve_its_setting(sglang_plugins, llama_dir):
    # the served-default log tells a user how to serve the closest setting: those flags parse
    # and publish exactly that setting's policy and knobs
    from redknot.calibrate import candidates, flags_of
    from redknot.headmap.served import TOKEN_LEVEL, ServedSetting

    for policy, knobs in candidates():
        if policy not in TOKEN_LEVEL:
            continue
        flags = flags_of(ServedSetting(policy, knobs)).split()
        _parse(llama_dir, "--attention-backend", "redknot", *flags)
        published = _published()
        assert published.policy == policy
        assert all(getattr(published, k) == v for k, v in knobs.items()), (flags, published)


def test_auto_segment_flags_reach_the_request_api(sglang_plugins, llama_dir):
    from redknot.api.service import SegmentApi

    _parse(llama_dir, "--attention-backend", "redknot", "--redknot-all-global")
    assert not SegmentApi.from_config(None, _published()).auto.enabled  # off by default
    extra = ["--redknot-auto-segments", "cdc", "--redknot-auto-chunk-tokens", "64"]
    _parse(llama_dir, "--attention-backend", "redknot", "--redknot-all-global", *extra)
    config = _published()
    assert (config.auto_segments, config.auto_chunk_tokens) == ("cdc", 64)
    auto = SegmentApi.from_config(None, config).auto
    assert auto.enabled and (auto.chunker.min_tokens, auto.chunker.max_tokens) == (16, 256)
