"""The frontend-language expression, run by SGLang's real interpreter and RuntimeEndpoint
against SGLang's app served by uvicorn (fake tokenizer manager behind it)."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from redknot.api import segment
from redknot.api.marks import decode_marks

DOC = "Paris is the capital of France."


@pytest.fixture
def endpoint(http_app):
    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(http_app, host="127.0.0.1", port=port, lifespan="off", log_level="error")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started and time.time() < deadline:
        time.sleep(0.05)
    assert server.started
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


def test_segment_expression_in_a_program(make_api, endpoint, bpe_tokenizer):
    import sglang as sgl

    api = make_api(bpe_tokenizer, namespaces="kb")

    @sgl.function
    def rag(s, doc, question):
        s += "Context: " + segment(doc, namespace="kb") + "\n"
        s += "Question: " + question + "\nAnswer:"
        s += sgl.gen("answer", max_tokens=4, temperature=0)

    state = rag.run(doc=DOC, question="capital?", backend=sgl.RuntimeEndpoint(endpoint))
    assert state["answer"] == " ok"
    obj = api.tokenizer_manager.last
    (mark,) = decode_marks(obj.sampling_params["custom_params"], obj.input_ids)
    assert mark.namespace == "kb"
    assert obj.input_ids[mark.start : mark.end] == bpe_tokenizer.encode(
        DOC, add_special_tokens=False
    )
    text = bpe_tokenizer.decode(obj.input_ids, skip_special_tokens=True)
    assert text == "Context: " + DOC + "\nQuestion: capital?\nAnswer:"


@pytest.mark.filterwarnings("ignore:Error in stream_executor")
def test_program_with_an_unknown_namespace_gets_the_400_message(make_api, endpoint, bpe_tokenizer):
    import sglang as sgl

    make_api(bpe_tokenizer, namespaces="tenant1")  # a fixed set without "kb"

    @sgl.function
    def rag(s):
        s += segment(DOC, namespace="kb") + sgl.gen("answer", max_tokens=4)

    backend = sgl.RuntimeEndpoint(endpoint)
    state = rag.run(backend=backend)
    state.sync()
    assert "'kb' is unknown: this server's namespaces are fixed" in str(state.error())
    # the server keeps serving
    make_api(bpe_tokenizer, namespaces="kb")
    assert rag.run(backend=backend)["answer"] == " ok"
