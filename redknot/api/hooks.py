"""The SGLang hooks of the request API (SGLang 0.5.17), registered and verified by
``redknot.integration.plugin`` with the others. The functions import their modules lazily so
that loading the plugin stays light."""

from __future__ import annotations

from typing import Any


def _before_setup_http_server(*args: Any, **kwargs: Any) -> None:
    from redknot.api.server import before_setup_http_server

    before_setup_http_server(*args, **kwargs)


def _around_apply_jinja_template(original: Any, *args: Any, **kwargs: Any) -> Any:
    from redknot.api.chat import around_apply_jinja_template

    return around_apply_jinja_template(original, *args, **kwargs)


def _after_tokenizer_dispatcher(result: Any, self: Any) -> None:
    from redknot.api.control import after_tokenizer_dispatcher

    after_tokenizer_dispatcher(result, self)


def _after_scheduler_dispatcher(result: Any, self: Any) -> None:
    from redknot.api.control import after_scheduler_dispatcher

    after_scheduler_dispatcher(result, self)


def register_types() -> None:
    """Make redknot's control messages decodable by SGLang's IPC (every process)."""
    from redknot.api.control import register_types as register

    register()


def types_registered() -> bool:
    from redknot.api.control import types_registered as registered

    return registered()


# (target, HookType name, function), turned into plugin.Hook entries by the plugin.
HOOKS: tuple[tuple[str, str, Any], ...] = (
    (
        "sglang.srt.entrypoints.http_server._setup_and_run_http_server",
        "BEFORE",
        _before_setup_http_server,
    ),
    (
        "sglang.srt.entrypoints.openai.serving_chat.OpenAIServingChat._apply_jinja_template",
        "AROUND",
        _around_apply_jinja_template,
    ),
    (
        "sglang.srt.managers.tokenizer_manager.TokenizerManager.init_request_dispatcher",
        "AFTER",
        _after_tokenizer_dispatcher,
    ),
    (
        "sglang.srt.managers.scheduler.Scheduler.init_request_dispatcher",
        "AFTER",
        _after_scheduler_dispatcher,
    ),
)
