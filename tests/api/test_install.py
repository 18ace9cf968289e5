"""The plugin installs the request API in SGLang's HTTP server and fails loudly otherwise."""

from __future__ import annotations

import types

import pytest

HTTP_SETUP = "sglang.srt.entrypoints.http_server._setup_and_run_http_server"


def test_api_hooks_are_registered_and_applied(sglang_plugins):
    from redknot.api import hooks

    targets = {h.target for h in sglang_plugins.HOOKS}
    for target, _, fn in hooks.HOOKS:
        assert target in targets
        assert sglang_plugins._hook_applied(target, fn), target
    sglang_plugins.verify()


def test_http_server_setup_installs_routes_and_middleware(http_app):
    from redknot.api.middleware import SegmentMarkupMiddleware
    from redknot.api.server import check_installed, current_api

    check_installed(http_app)
    paths = {
        (getattr(r, "path", None), m)
        for r in http_app.router.routes
        for m in getattr(r, "methods", ())
    }
    assert {
        ("/redknot/segments", "POST"),
        ("/redknot/segments", "GET"),
        ("/redknot/segments/{segment_id}", "DELETE"),
        ("/redknot/stats", "GET"),
    } <= paths
    assert any(m.cls is SegmentMarkupMiddleware for m in http_app.user_middleware)
    assert current_api() is not None


def test_routes_carry_sglang_auth_levels(http_app):
    from sglang.srt.utils.auth import AuthLevel, _get_auth_level_from_app_and_scope

    def level(method, path):
        return _get_auth_level_from_app_and_scope(
            http_app, {"type": "http", "method": method, "path": path, "root_path": ""}
        )

    assert level("POST", "/redknot/segments") == AuthLevel.ADMIN_OPTIONAL
    assert level("DELETE", "/redknot/segments/abc") == AuthLevel.ADMIN_OPTIONAL
    assert level("GET", "/redknot/stats") == AuthLevel.NORMAL


def test_verify_fails_loudly_without_the_http_hook(sglang_plugins):
    from sglang.srt.entrypoints import http_server

    patched = http_server._setup_and_run_http_server
    http_server._setup_and_run_http_server = patched.__wrapped__
    try:
        with pytest.raises(RuntimeError, match=r"hook on .*_setup_and_run_http_server is not"):
            sglang_plugins.verify()
    finally:
        http_server._setup_and_run_http_server = patched
    sglang_plugins.verify()


def test_verify_fails_loudly_when_ipc_types_are_unknown(sglang_plugins, monkeypatch):
    from sglang.srt.managers import io_struct

    from redknot.api import control

    kept = tuple(t for t in io_struct._all_types if t not in control.TYPES)
    monkeypatch.setattr(io_struct, "_all_types", kept)
    with pytest.raises(RuntimeError, match="control messages are not known to SGLang's IPC"):
        sglang_plugins.verify()


def test_check_installed_names_what_is_missing():
    from fastapi import FastAPI

    from redknot.api.server import check_installed

    with pytest.raises(RuntimeError, match="middleware is not in the app.*routes are not"):
        check_installed(FastAPI())


def test_other_backends_get_no_api(http_app):
    from redknot.api import server

    before = server.current_api()
    server.before_setup_http_server(
        types.SimpleNamespace(
            attention_backend="flashinfer",
            prefill_attention_backend=None,
            decode_attention_backend=None,
        ),
        None,
    )
    assert server.current_api() is before


def test_multiple_tokenizer_workers_are_refused(sglang_plugins, model_dir):
    from sglang.srt.server_args import prepare_server_args

    from redknot.config import RedknotConfigError

    argv = ["--model-path", str(model_dir), "--load-format", "dummy", "--device", "cpu"]
    argv += ["--attention-backend", "redknot", "--redknot-all-global"]
    with pytest.raises((RedknotConfigError, ValueError), match="tokenizer-worker-num"):
        prepare_server_args(argv + ["--tokenizer-worker-num", "2"])


@pytest.mark.parametrize(
    "flag, message",
    [
        (["--redknot-chat-segments", "always"], "is not one of off, messages, min-tokens:N"),
        (["--redknot-namespaces", "kb,bad name"], "not a valid namespace name"),
    ],
)
def test_bad_api_options_fail_at_startup(sglang_plugins, model_dir, flag, message):
    from sglang.srt.server_args import prepare_server_args

    from redknot.config import RedknotConfigError

    argv = ["--model-path", str(model_dir), "--load-format", "dummy", "--device", "cpu"]
    argv += ["--attention-backend", "redknot", "--redknot-all-global", *flag]
    with pytest.raises(RedknotConfigError, match=message):
        prepare_server_args(argv)


def test_api_options_are_published(sglang_plugins, model_dir):
    from sglang.srt.server_args import prepare_server_args

    from redknot.integration.server_args import published_config

    argv = ["--model-path", str(model_dir), "--load-format", "dummy", "--device", "cpu"]
    argv += ["--attention-backend", "redknot", "--redknot-all-global"]
    argv += ["--redknot-chat-segments", "min-tokens:64", "--redknot-namespaces", "kb,t1"]
    prepare_server_args(argv)
    config = published_config()
    assert (config.chat_segments, config.namespaces) == ("min-tokens:64", "kb,t1")


def test_the_log_says_automatic_segments_are_off_and_why(server_args, caplog):
    import logging

    from redknot.api.server import AUTO_OFF
    from tests.api.cpu_server import setup_http_app

    with caplog.at_level(logging.INFO):
        setup_http_app(server_args)
    assert AUTO_OFF in caplog.text
    assert "docs/auto_segments.md" in AUTO_OFF and "--redknot-auto-segments cdc" in AUTO_OFF
