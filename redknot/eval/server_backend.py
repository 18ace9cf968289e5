"""The server backend: cases served by running SGLang servers over HTTP, with TTFT measured.

Two servers of the same model take part:

| setting   | server              | request                                                      |
| --------- | ------------------- | ------------------------------------------------------------ |
| ``full``  | ``reference_url``   | the composed prompt, no segments (run it with ``--attention-backend flashinfer`` or ``redknot --redknot-all-global``) |
| ``redknot`` | ``url``           | every segment registered first (``POST /redknot/segments``), then the prompt with its segments marked over ``input_ids`` |
| ``naive``, ``epic``, ``cacheblend``, ``sparsex``, ``samkv`` | ``url`` | as ``redknot``, on a server started with that ``--redknot-policy`` (``samkv``: the answer's ``sequence_ratio`` recorded) |

The recovery knobs are the redknot server's own options (``--redknot-dense-layers`` ...): a
server serves one setting, recorded from its ``/server_info``. Prompts are composed exactly as
on the reference path (:mod:`redknot.eval.compose`), with the tokenizer of the served model.

Each request streams: TTFT is the time from sending the prompt to the first chunk carrying an
output token; the last chunk gives the greedy tokens and the first token's top-10 (SGLang's
``top_logprobs_num``). A server returns no full logits, so ``cosine`` is not reported. A marked
request whose segments are not all hit (``/redknot/stats`` counters) is an error, not a quiet
miss: a miss would be scored as if it were reuse.

>>> backend = ServerBackend("http://gpu:30000", "http://gpu:30001", tokenizer_path="/models/m")
>>> evaluate(backend, cases, [PolicySetting("full"), PolicySetting("redknot")])
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Sequence
from typing import Any

import requests

from redknot.config import POLICY_CHOICES
from redknot.eval.base import (
    REFERENCE_LABEL,
    FidelityBackend,
    PolicyOutput,
    PolicySetting,
)
from redknot.eval.cases import Case
from redknot.eval.compose import ComposedCase, compose

SERVER_POLICIES = (REFERENCE_LABEL, *POLICY_CHOICES)  # what a redknot server can serve
TOP_K = 10


class ServerEvalError(RuntimeError):
    """A server answered something the evaluation cannot score; the message says what."""


class ServerBackend(FidelityBackend):
    """Serves cases on a redknot server (``url``) against a dense one (``reference_url``)."""

    name = "server"

    def __init__(
        self,
        url: str,
        reference_url: str,
        *,
        tokenizer_path: str | None = None,
        namespace: str = "default",
        max_new_tokens: int = 16,
        timeout: float = 600.0,
        tokenizer=None,
    ) -> None:
        self.url = url.rstrip("/")
        self.reference_url = reference_url.rstrip("/")
        self.namespace = namespace
        self.max_new_tokens = max_new_tokens
        self.timeout = timeout
        self.http = requests.Session()
        self.info = self._server_info(self.url)
        self.reference_info = self._server_info(self.reference_url)
        if self.info.get("attention_backend") != "redknot":
            raise ServerEvalError(
                f"{self.url} serves attention backend {self.info.get('attention_backend')!r}; "
                "the redknot setting needs a server started with --attention-backend redknot"
            )
        model, ref_model = self.info.get("model_path"), self.reference_info.get("model_path")
        if model != ref_model:
            raise ServerEvalError(
                f"the two servers serve different models ({model!r} at {self.url}, {ref_model!r} "
                f"at {self.reference_url}); start both with the same --model-path"
            )
        if tokenizer is None:
            from transformers import AutoTokenizer

            path = tokenizer_path or self.info.get("tokenizer_path") or model
            tokenizer = AutoTokenizer.from_pretrained(path)
        self.tokenizer = tokenizer
        stops = {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")}
        self.stop_token_ids = sorted(t for t in stops if isinstance(t, int) and t >= 0)

    # ---- HTTP ------------------------------------------------------------------------------

    def _server_info(self, url: str) -> dict[str, Any]:
        for path in ("/server_info", "/get_server_info"):
            try:
                r = self.http.get(url + path, timeout=30)
            except requests.RequestException as e:
                raise ServerEvalError(f"cannot reach {url}: {e}") from None
            if r.status_code == 200:
                return r.json()
        raise ServerEvalError(f"{url} answers no /server_info; is it an SGLang server?")

    def _post(self, url: str, body: dict[str, Any], what: str) -> dict[str, Any]:
        r = self.http.post(url, json=body, timeout=self.timeout)
        if r.status_code != 200:
            raise ServerEvalError(f"{what}: HTTP {r.status_code} from {url}: {r.text[:500]}")
        return r.json()

    def _hits(self) -> int:
        r = self.http.get(
            f"{self.url}/redknot/stats", params={"namespace": self.namespace}, timeout=30
        )
        if r.status_code != 200:
            raise ServerEvalError(f"/redknot/stats: HTTP {r.status_code}: {r.text[:300]}")
        return int(r.json()["store"]["hits"])

    def _stream(self, url: str, body: dict[str, Any]) -> tuple[float, list[dict[str, Any]]]:
        """Send a streaming ``/generate``; (TTFT seconds, every chunk)."""
        chunks, ttft = [], None
        started = time.perf_counter()
        with self.http.post(
            f"{url}/generate", json={**body, "stream": True}, stream=True, timeout=self.timeout
        ) as r:
            if r.status_code != 200:
                raise ServerEvalError(f"/generate: HTTP {r.status_code} from {url}: {r.text[:500]}")
            for chunk in _sse(r.iter_lines()):
                if "error" in chunk:
                    raise ServerEvalError(f"/generate at {url} failed: {chunk['error']}")
                if ttft is None and chunk.get("output_ids"):
                    ttft = time.perf_counter() - started
                chunks.append(chunk)
        if ttft is None:
            raise ServerEvalError(f"/generate at {url} streamed no output token")
        return ttft, chunks

    # ---- FidelityBackend -------------------------------------------------------------------

    def describe(self) -> dict[str, Any]:
        def redknot_args(info: dict[str, Any]) -> dict[str, Any]:
            """The redknot options a server resolved (``internal_states[0].redknot_config``)."""
            states = info.get("internal_states") or [{}]
            config = states[0].get("redknot_config")
            return {"redknot_config": config} if config else {}

        return {
            "backend": self.name,
            "device": "server",
            "device_detail": f"redknot server {self.url}, dense reference {self.reference_url}",
            "model": self.info.get("model_path"),
            "servers": {
                "redknot": {"url": self.url, **redknot_args(self.info)},
                "reference": {
                    "url": self.reference_url,
                    "attention_backend": self.reference_info.get("attention_backend"),
                    **redknot_args(self.reference_info),
                },
            },
            "namespace": self.namespace,
            "max_new_tokens": self.max_new_tokens,
            "stop_token_ids": self.stop_token_ids,
        }

    def run_case(self, case: Case, settings: Sequence[PolicySetting]) -> dict[str, PolicyOutput]:
        composed = compose(self.tokenizer, case)
        outputs = {}
        for setting in settings:
            if setting.policy not in SERVER_POLICIES:
                raise ServerEvalError(
                    f"policy {setting.policy!r} cannot run on the server backend (it serves "
                    f"{', '.join(SERVER_POLICIES)}); use --backend reference"
                )
            if setting.policy == REFERENCE_LABEL:
                outputs[setting.label] = self._serve(self.reference_url, composed, marked=False)
            elif setting.policy != self.served_policy:
                raise ServerEvalError(
                    f"{self.url} serves policy {self.served_policy!r}, not {setting.policy!r}: "
                    f"ask for --policies full,{self.served_policy}, or start the server with "
                    f"--redknot-policy {setting.policy}"
                )
            else:
                outputs[setting.label] = self._serve_reused(composed)
        return outputs

    @property
    def served_policy(self) -> str:
        """The ``--redknot-policy`` the redknot server resolved (older servers: ``redknot``)."""
        states = self.info.get("internal_states") or [{}]
        return (states[0].get("redknot_config") or {}).get("policy", "redknot")

    def _serve_reused(self, composed: ComposedCase) -> PolicyOutput:
        for start, end in composed.segments:
            self._post(
                f"{self.url}/redknot/segments",
                {"namespace": self.namespace, "input_ids": list(composed.ids[start:end])},
                "segment registration",
            )
        before = self._hits()
        out = self._serve(self.url, composed, marked=True)
        hits = self._hits() - before
        if hits != len(composed.segments):
            raise ServerEvalError(
                f"{hits} of {len(composed.segments)} registered segments were hit; a segment "
                "was evicted before use (raise --redknot-segment-fraction) or the server "
                "does not reuse segments"
            )
        return out

    def _serve(self, url: str, composed: ComposedCase, *, marked: bool) -> PolicyOutput:
        body: dict[str, Any] = {
            "input_ids": list(composed.ids),
            "sampling_params": {
                "max_new_tokens": self.max_new_tokens,
                "temperature": 0,
                "stop_token_ids": self.stop_token_ids,
            },
            "return_logprob": True,
            "top_logprobs_num": TOP_K,
            "logprob_start_len": len(composed.ids) - 1,
        }
        if marked:
            body["redknot_segments"] = [
                {"start": s, "end": e, "namespace": self.namespace} for s, e in composed.segments
            ]
        started = time.perf_counter()
        ttft, chunks = self._stream(url, body)
        info = self.info if url == self.url else self.reference_info
        tokens, first = _final_output(chunks, bool(info.get("incremental_streaming_output")))
        return PolicyOutput(
            first_top=first,
            first_logits=None,
            text=self.tokenizer.decode(tokens, skip_special_tokens=True),
            tokens=tokens,
            fractions=_served_fractions(chunks) if marked else {},
            ttft_s=ttft,
            wall_s=time.perf_counter() - started,
        )


def _served_fractions(chunks: list[dict[str, Any]]) -> dict[str, float | None]:
    """``sequence_ratio`` of a SamKV server's answer (its reuse report), else nothing."""
    for chunk in chunks:
        reports = (chunk.get("meta_info") or {}).get("redknot_reuse") or []
        samkv = reports[0].get("samkv") if reports and isinstance(reports[0], dict) else None
        if samkv and samkv.get("sequence_ratio") is not None:
            return {"sequence_ratio": samkv["sequence_ratio"]}
    return {}


def _sse(lines: Iterator[bytes]) -> Iterator[dict[str, Any]]:
    """The JSON chunks of SGLang's ``data: ...`` event stream, up to ``[DONE]``."""
    for line in lines:
        if not line or not line.startswith(b"data:"):
            continue
        data = line[len(b"data:") :].strip()
        if data == b"[DONE]":
            return
        yield json.loads(data)


def _final_output(chunks: list[dict[str, Any]], incremental: bool) -> tuple[list[int], list[int]]:
    """(greedy token ids, first token's top-10 ids best first) from a stream's chunks: the last
    chunk holds everything, or with ``--incremental-streaming-output`` the chunks add up."""
    if incremental:
        tokens = [t for c in chunks for t in c.get("output_ids") or []]
        tops = [t for c in chunks for t in c.get("meta_info", {}).get("output_top_logprobs") or []]
    else:
        tokens = list(chunks[-1].get("output_ids") or [])
        tops = chunks[-1].get("meta_info", {}).get("output_top_logprobs") or []
    if not tokens or not tops or not tops[0]:
        raise ServerEvalError(
            "the server returned no first-token top logprobs (return_logprob with "
            "top_logprobs_num was ignored?)"
        )
    ranked = sorted(tops[0], key=lambda entry: -entry[0])
    return tokens, [int(entry[1]) for entry in ranked[:TOP_K]]
