"""Installs the request API into SGLang's HTTP server (``sglang.srt.entrypoints.http_server``).

SGLang builds its FastAPI ``app`` at import and starts it in ``_setup_and_run_http_server``,
in the launching process, after the scheduler processes are up. A BEFORE hook on that function
(registered by the plugin) calls :func:`install` with the live tokenizer manager, so that before
uvicorn starts:

- ``SegmentMarkupMiddleware`` is added as the innermost middleware: inside everything SGLang
  adds (CORS and request decompression at import, API-key checks after this hook), so that it
  reads bodies as the routes will, and in front of every route;
- the ``/redknot`` routes are added;
- :func:`check_installed` confirms both, or the server does not start.

Only when ``--attention-backend redknot`` is served; with ``--tokenizer-worker-num > 1`` the
HTTP workers are other processes (the redknot options refuse it).
"""

from __future__ import annotations

import logging
from typing import Any

from starlette.middleware import Middleware

from redknot.api.middleware import SegmentMarkupMiddleware
from redknot.api.routes import PREFIX, build_router
from redknot.api.service import SegmentApi

logger = logging.getLogger(__name__)

_api: SegmentApi | None = None


def current_api() -> SegmentApi | None:
    """The API state of this process's HTTP server (``None`` before it is installed)."""
    return _api


def install(app: Any, api: SegmentApi) -> None:
    """Add the middleware and routes to ``app`` (idempotent) and make ``api`` current."""
    global _api
    _api = api
    if not any(m.cls is SegmentMarkupMiddleware for m in app.user_middleware):
        if app.middleware_stack is not None:
            raise RuntimeError("redknot: the HTTP app has started; its middleware is fixed")
        # user_middleware runs outermost first: the last entry sees the body the routes see
        # (after SGLang's RequestDecompressionMiddleware, say)
        app.user_middleware.append(Middleware(SegmentMarkupMiddleware, api=current_api))
    if not _has_routes(app):
        # Added one by one (not include_router): plain routes of the app, as SGLang's own are,
        # so that SGLang's API-key middleware finds their auth levels.
        for route in build_router(current_api).routes:
            app.add_api_route(route.path, route.endpoint, methods=list(route.methods))
    check_installed(app)


AUTO_OFF = (
    "redknot auto segments: off (the default), so unmarked prompts reuse only exact prefixes: "
    "measured on an H100 they make unmarked RAG traffic 5.7x faster (--redknot-auto-segments "
    "cdc-docs with --redknot-policy epic, answers kept as with registered documents) but chat "
    "traffic 6-14% slower (0.86-0.94x side by side), so they are not on by default "
    "(docs/auto_segments.md); "
    "--redknot-auto-segments cdc-docs turns them on for RAG traffic"
)


def _has_routes(app: Any) -> bool:
    return any(getattr(r, "path", "").startswith(PREFIX + "/") for r in app.router.routes)


def check_installed(app: Any) -> None:
    problems = []
    if not any(m.cls is SegmentMarkupMiddleware for m in app.user_middleware):
        problems.append("the /generate segment middleware is not in the app")
    elif app.user_middleware[-1].cls is not SegmentMarkupMiddleware:
        problems.append("the /generate segment middleware is not the innermost one")
    if not _has_routes(app):
        problems.append(f"the {PREFIX} routes are not in the app")
    if _api is None:
        problems.append("no SegmentApi is current")
    if problems:
        raise RuntimeError("redknot request API is not installed: " + "; ".join(problems))


def before_setup_http_server(server_args: Any, tokenizer_manager: Any, *args: Any, **kwargs: Any):
    """BEFORE hook on ``http_server._setup_and_run_http_server``."""
    from redknot.integration.server_args import published_config, uses_redknot

    if uses_redknot(server_args):
        from sglang.srt.entrypoints.http_server import app

        api = SegmentApi.from_config(tokenizer_manager, published_config())
        install(app, api)
        logger.info("redknot: segment request API installed (%s, /generate markup)", PREFIX)
        if not api.auto.enabled:
            logger.info(AUTO_OFF)
        from redknot.api import gate_warmup

        gate_warmup.install(server_args)
