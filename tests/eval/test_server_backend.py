"""The server backend of the fidelity evaluation against stub HTTP servers that speak SGLang
0.5.17's wire format (``/server_info``, streaming ``/generate`` with ``data:`` events and
``output_top_logprobs`` entries ``[logprob, token_id, text]``, redknot's ``/redknot/*``)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

import pytest

from redknot.eval.base import PolicySetting
from redknot.eval.cases import parse_case
from redknot.eval.compose import compose
from redknot.eval.fidelity import evaluate
from redknot.eval.server_backend import ServerBackend, ServerEvalError, _final_output

VOCAB = 97


def next_token(ids: list[int], shift: int) -> int:
    """The stub model: a deterministic function of the whole context."""
    return (sum(ids) * 31 + len(ids) + shift) % VOCAB


class StubServer:
    """One fake SGLang server; ``shift`` makes its model differ from another stub's."""

    def __init__(self, *, backend, model="m", shift=0, incremental=False, count_hits=True):
        self.info = {
            "attention_backend": backend,
            "model_path": model,
            "incremental_streaming_output": incremental,
            # SGLang lists its own server args only; redknot's resolved options come from the
            # scheduler's internal state (redknot.integration.segments)
            "internal_states": [
                (
                    {"redknot_config": {"head_map": "map.json", "dense_layers": None}}
                    if backend == "redknot"
                    else {}
                )
            ],
        }
        self.shift, self.incremental, self.count_hits = shift, incremental, count_hits
        self.registered: list[list[int]] = []
        self.generated: list[dict] = []
        self.hits = 0
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, status, body):
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                url = urlparse(self.path)
                if url.path == "/server_info":
                    return self._send(200, stub.info)
                if url.path == "/redknot/stats" and stub.info["attention_backend"] == "redknot":
                    assert parse_qs(url.query)["namespace"] == ["default"]
                    return self._send(200, {"store": {"hits": stub.hits}, "api": {}})
                self._send(404, {"error": "not found"})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path == "/redknot/segments":
                    stub.registered.append(body["input_ids"])
                    return self._send(200, {"segment_id": "x", "num_tokens": 1})
                if self.path != "/generate":
                    return self._send(404, {"error": "not found"})
                stub.generated.append(body)
                ids = list(body["input_ids"])
                for seg in body.get("redknot_segments") or []:
                    if stub.count_hits and ids[seg["start"] : seg["end"]] in stub.registered:
                        stub.hits += 1
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                out, tops = [], []
                for _ in range(body["sampling_params"]["max_new_tokens"]):
                    best = next_token(ids + out, stub.shift)
                    # top-10 in a scrambled order: the backend must rank by logprob
                    entries = [[-0.1 * k, (best + k) % VOCAB, None] for k in range(10)]
                    tops.append(entries[::-1])
                    out.append(best)
                    new = slice(-1, None) if stub.incremental else slice(None)
                    chunk = {
                        "text": "",
                        "output_ids": out[new],
                        "meta_info": {"output_top_logprobs": tops[new]},
                    }
                    self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                self.wfile.write(b"data: [DONE]\n\n")

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.http.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"

    def close(self):
        self.http.shutdown()


class Tokenizer:
    """Characters as token ids (below VOCAB), as far as compose() and decoding need."""

    eos_token_id = 0
    chat_template = None

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [1 + ord(c) % (VOCAB - 1) for c in text]}

    def convert_tokens_to_ids(self, token):
        return None

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


CASE = parse_case(
    {
        "id": "c0",
        "segments": ["first document text", "second one"],
        "between": ["Docs: ", " and "],
        "question": " Q?",
        "answers": ["x"],
    }
)


@pytest.fixture
def servers():
    made = []

    def make(**kwargs):
        made.append(StubServer(**kwargs))
        return made[-1]

    yield make
    for s in made:
        s.close()


def _backend(redknot, reference, **kwargs):
    return ServerBackend(
        redknot.url, reference.url, tokenizer=Tokenizer(), max_new_tokens=4, **kwargs
    )


def test_full_and_redknot_served_by_their_servers(servers):
    redknot, dense = servers(backend="redknot"), servers(backend="flashinfer")
    backend = _backend(redknot, dense)
    outputs = backend.run_case(CASE, [PolicySetting("full"), PolicySetting("redknot")])
    composed = compose(Tokenizer(), CASE)
    # every segment registered with exactly its tokens, then one marked request
    assert redknot.registered == [list(composed.ids[s:e]) for s, e in composed.segments]
    (marked,) = redknot.generated
    assert marked["input_ids"] == list(composed.ids)
    spans = [(m["start"], m["end"]) for m in marked["redknot_segments"]]
    assert spans == list(composed.segments)
    (plain,) = dense.generated
    assert "redknot_segments" not in plain and plain["input_ids"] == list(composed.ids)
    assert plain["sampling_params"]["temperature"] == 0
    # greedy tokens and the top-10 ranked best first, from the last cumulative chunk
    want, ids = [], list(composed.ids)
    for _ in range(4):
        want.append(next_token(ids + want, 0))
    for out in outputs.values():
        assert out.tokens == want
        assert out.first_top == [(want[0] + k) % VOCAB for k in range(10)]
        assert out.first_logits is None and out.ttft_s is not None and out.ttft_s > 0
    assert redknot.hits == 2


def test_incremental_streams_add_up(servers):
    redknot = servers(backend="redknot", incremental=True)
    dense = servers(backend="flashinfer")
    out = _backend(redknot, dense).run_case(CASE, [PolicySetting("redknot")])["redknot"]
    ids, want = list(compose(Tokenizer(), CASE).ids), []
    for _ in range(4):
        want.append(next_token(ids + want, 0))
    assert out.tokens == want
    assert out.first_top[0] == want[0]


def test_evaluate_scores_server_outputs(servers):
    redknot, dense = servers(backend="redknot", shift=0), servers(backend="flashinfer", shift=5)
    result = evaluate(
        _backend(redknot, dense),
        [CASE],
        [PolicySetting("full"), PolicySetting("redknot")],
        log=lambda line: None,
    )
    row = result["per_case"][0]["settings"]["redknot"]
    # the dense stub's best token is 5 ids further: top-1 differs, 5 of 10 shared
    assert row["top1"] == 0.0 and row["top10"] == 0.5
    assert row["cosine"] is None and row["ttft_s"] > 0
    assert result["summary"]["full"]["top1"] == 1.0


def test_unhit_segments_are_an_error(servers):
    redknot = servers(backend="redknot", count_hits=False)
    backend = _backend(redknot, servers(backend="flashinfer"))
    with pytest.raises(ServerEvalError, match="0 of 2 registered segments were hit"):
        backend.run_case(CASE, [PolicySetting("redknot")])


def test_refuses_mismatched_servers_and_reference_only_policies(servers):
    dense = servers(backend="flashinfer")
    with pytest.raises(ServerEvalError, match="--attention-backend redknot"):
        _backend(servers(backend="flashinfer"), dense)
    with pytest.raises(ServerEvalError, match="different models"):
        _backend(servers(backend="redknot", model="other"), dense)
    backend = _backend(servers(backend="redknot"), dense)
    with pytest.raises(ServerEvalError, match="use --backend reference"):
        backend.run_case(CASE, [PolicySetting("headclass")])
    with pytest.raises(ServerEvalError, match="serves policy 'redknot', not 'naive'"):
        backend.run_case(CASE, [PolicySetting("naive")])


def test_a_token_policy_server_serves_its_policy(servers):
    blend = servers(backend="redknot")
    blend.info["internal_states"][0]["redknot_config"]["policy"] = "cacheblend"
    backend = _backend(blend, servers(backend="flashinfer"))
    out = backend.run_case(CASE, [PolicySetting("cacheblend")])
    assert out["cacheblend"].tokens and blend.hits == 2  # served with its segments marked
    with pytest.raises(ServerEvalError, match="--policies full,cacheblend"):
        backend.run_case(CASE, [PolicySetting("redknot")])


def test_unreachable_server_is_a_clear_error(servers):
    dense = servers(backend="flashinfer")
    with pytest.raises(ServerEvalError, match="cannot reach"):
        ServerBackend("http://127.0.0.1:9", dense.url, tokenizer=Tokenizer())


def test_no_top_logprobs_is_an_error():
    with pytest.raises(ServerEvalError, match="top logprobs"):
        _final_output([{"output_ids": [3], "meta_info": {}}], incremental=False)


def test_cli_runs_the_server_backend(servers, tmp_path, monkeypatch):
    from redknot.eval import server_backend
    from redknot.eval.cli import main

    redknot, dense = servers(backend="redknot"), servers(backend="flashinfer", shift=5)
    cases = tmp_path / "cases.jsonl"
    cases.write_text(json.dumps(CASE.to_json()) + "\n")
    monkeypatch.setattr(
        "transformers.AutoTokenizer.from_pretrained", lambda path, **kw: Tokenizer()
    )
    out = tmp_path / "out.json"
    argv = ["fidelity", "--cases", str(cases), "--backend", "server", "--server", redknot.url]
    argv += ["--reference-server", dense.url, "--max-new-tokens", "3", "--out", str(out)]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert [s["label"] for s in result["settings"]] == ["full", "redknot"]
    assert result["device"] == "server" and "default_options" not in result
    assert result["servers"]["redknot"]["redknot_config"]["head_map"] == "map.json"
    assert "redknot_config" not in result["servers"]["reference"]
    # the server's options apply, not the evaluation's defaults
    assert all(s["options"] is None for s in result["settings"])
    assert result["per_case"][0]["settings"]["redknot"]["top10"] == 0.5
    assert server_backend.SERVER_POLICIES == (
        "full", "redknot", "naive", "epic", "cacheblend", "sparsex", "samkv",
    )  # fmt: skip


@pytest.mark.parametrize(
    "extra, match",
    [
        ([], "needs --server URL and --reference-server URL"),
        (
            [
                "--server",
                "http://a",
                "--reference-server",
                "http://b",
                "--policies",
                "full,headclass",
            ],
            "policy 'headclass' cannot be used with --backend server",
        ),
        (
            ["--server", "http://a", "--reference-server", "http://b", "--mass-thresh", "0.3"],
            "--mass-thresh cannot be used with --backend server",
        ),
    ],
)
def test_cli_server_backend_errors(tmp_path, capsys, extra, match):
    from redknot.eval.cli import main

    cases = tmp_path / "cases.jsonl"
    cases.write_text(json.dumps(CASE.to_json()) + "\n")
    argv = ["fidelity", "--cases", str(cases), "--backend", "server", "--out", "o.json"]
    with pytest.raises(SystemExit, match=match):
        main(argv + extra)


def test_cli_reference_backend_needs_a_map(tmp_path):
    from redknot.eval.cli import main

    cases = tmp_path / "cases.jsonl"
    cases.write_text(json.dumps(CASE.to_json()) + "\n")
    with pytest.raises(SystemExit, match="--head-map is required"):
        main(["fidelity", "--cases", str(cases), "--out", "o.json"])


def test_a_samkv_answer_records_the_kv_it_held():
    from redknot.eval.server_backend import _served_fractions

    report = {"segments_hit": 2, "samkv": {"sequence_ratio": 0.23, "served_tokens": 900}}
    chunks = [{"meta_info": {"redknot_reuse": [report]}}, {"meta_info": {}}]
    assert _served_fractions(chunks) == {"sequence_ratio": 0.23}
    assert _served_fractions([{"meta_info": {"redknot_reuse": [{"segments_hit": 1}]}}]) == {}
