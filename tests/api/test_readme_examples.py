"""The README's request examples, run as written against a fresh CPU server stand-in
(``cpu_server.py``: SGLang's real HTTP app and redknot's real request API and segment store,
no model), each on its own server served by uvicorn: curl blocks through bash, Python blocks in
this interpreter. Only the address changes (``localhost:30000`` -> the stand-in's port). Each
example must reach the model with the segments it means to mark."""

from __future__ import annotations

import contextlib
import io
import re
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from redknot.api.marks import decode_marks

README = Path(__file__).resolve().parents[2] / "README.md"
MARKER = "<!-- example:api -->"
DOC = "Paris is the capital of France."


def examples() -> list[tuple[str, str]]:
    pattern = re.escape(MARKER) + r"\n```(\w+)\n(.*?)\n```"
    return re.findall(pattern, README.read_text(), re.DOTALL)


@contextlib.contextmanager
def served(app):
    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="off", log_level="error")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started and time.time() < deadline:
        time.sleep(0.05)
    assert server.started
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def run_example(lang: str, code: str, port: int) -> str:
    """The example's output; it must finish without an error."""
    if lang == "bash":
        code = code.replace("localhost:30000", f"127.0.0.1:{port}")
        cmd = ["bash", "-c", code]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
        assert done.returncode == 0, done.stderr
        return done.stdout
    assert lang == "python", lang
    code = code.replace("http://localhost:30000", f"http://127.0.0.1:{port}")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        # running the README's own code is what this test is for
        exec(compile(code, "README example", "exec"), {"__name__": "__readme__"})  # noqa: S102
    return out.getvalue()


def marks(obj) -> list:
    return decode_marks(obj.sampling_params.get("custom_params") or {}, obj.input_ids)


def test_the_readme_has_one_example_per_request_api():
    found = examples()
    assert [lang for lang, _ in found] == ["bash", "python", "python", "python"]
    assert "/generate" in found[0][1] and "redknot_segments" in found[0][1]
    assert "from redknot.api import segment" in found[1][1]
    assert "/v1" in found[2][1] and "chat.completions" in found[2][1]
    assert "/redknot/segments" in found[3][1] and "/redknot/stats" in found[3][1]


@pytest.fixture
def fresh(http_app, smollm_tokenizer, server_args):
    """A fresh stand-in server with SmolLM2's tokenizer and chat template, chat messages as
    segments (``--redknot-chat-segments messages``, as the chat example says)."""
    from tests.api.cpu_server import CpuServer

    server = CpuServer(http_app, smollm_tokenizer, chat="messages", server_args=server_args)
    with served(http_app) as port:
        yield server, port


def _doc_ids(tok, text=DOC):
    return tok.encode(text, add_special_tokens=False)


def test_generate_example(fresh, smollm_tokenizer):
    server, port = fresh
    lang, code = examples()[0]
    out = run_example(lang, code, port)
    assert '"text"' in out and '"error"' not in out, out
    (mark,) = marks(server.tm.last)
    assert mark.namespace == "default"
    assert server.tm.last.input_ids[mark.start : mark.end] == _doc_ids(smollm_tokenizer)
    assert server.store.stats()["misses"] == 1  # a fresh server: computed as usual


def test_frontend_example(fresh, smollm_tokenizer):
    server, port = fresh
    lang, code = examples()[1]
    assert run_example(lang, code, port).strip() == "ok"  # the stand-in's answer
    (mark,) = marks(server.tm.last)
    assert mark.namespace == "default"
    assert server.tm.last.input_ids[mark.start : mark.end] == _doc_ids(smollm_tokenizer)


def test_chat_example(fresh, smollm_tokenizer):
    server, port = fresh
    lang, code = examples()[2]
    assert run_example(lang, code, port).strip() == "ok"
    found = marks(server.tm.last)
    assert len(found) == 2 and {m.namespace for m in found} == {"default"}
    ids = server.tm.last.input_ids
    assert ids[found[1].start : found[1].end] == _doc_ids(smollm_tokenizer, "Capital of France?")


def test_registration_example(fresh, smollm_tokenizer):
    server, port = fresh
    lang, code = examples()[3]
    out = run_example(lang, code, port)
    n = len(_doc_ids(smollm_tokenizer))
    assert f"tokens reused: {n}" in out, out  # the registered segment was hit
    assert "'namespace': 'kb'" in out and "'deleted': True" in out, out
    stats = server.store.stats("kb")
    assert stats["hits"] == 1 and stats["segments"] == 0  # used once, then deleted
