"""Host time a marked ``/generate`` request costs over the same prompt unmarked, on the CPU.

The CPU server stand-in (``tests/api/cpu_server.py``: SGLang's HTTP app, redknot's request API,
its real scheduler-side segment code, no model and no engine time) serves the prompts in this
process, through an in-process ASGI client, so the figures are host time only: what redknot's
markup adds around a request, not what a GPU does. A prompt is one fresh token, ``--docs``
registered documents of ``--doc-tokens`` tokens and a fresh 64-token question, sent unmarked and
then marked, alternating in blocks; each function of the marked path is timed around its calls.
The stand-in's policy reuses every hit, so ``plan_reads`` runs here; a prompt the reuse gate
recomputes skips it.

    python benchmarks/marked_host_cost.py --out benchmarks/results/marked_host_cost.json
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import serving_common as common

# (module, function) timed on the marked path: the API process, then the scheduler
TIMED = (
    ("redknot.api.middleware", "rewrite_generate"),  # markup -> the scheduler's marks (the
    # middleware's own name for it: patching redknot.api.generate would miss an earlier import)
    ("redknot.segcache.reuse", "start"),  # segment lookups, the reuse gate
    ("redknot.segcache.reuse", "plan_reads"),  # where the hits' K/V lie (reusing prompts only)
    # after the first token, what to capture: not called when the answer reports all hits
    ("redknot.api.capture", "Capturer.capture"),
)


def timed_calls() -> tuple[dict[str, list[float]], list]:
    """Wrap the functions of ``TIMED``; their call times (s) accumulate in the returned dict;
    the list holds ``(owner, name, function)`` to put back."""
    import importlib
    import inspect

    times: dict[str, list[float]] = {}
    undo: list = []
    for module, name in TIMED:
        owner = importlib.import_module(module)
        attr = name
        if "." in name:
            cls, attr = name.split(".")
            owner = getattr(owner, cls)
        fn = getattr(owner, attr)
        bucket = times.setdefault(name, [])

        def wrap(fn=fn, bucket=bucket):
            if inspect.iscoroutinefunction(fn):

                @functools.wraps(fn)
                async def run(*args, **kwargs):
                    t = time.perf_counter()
                    try:
                        return await fn(*args, **kwargs)
                    finally:
                        bucket.append(time.perf_counter() - t)

            else:

                @functools.wraps(fn)
                def run(*args, **kwargs):
                    t = time.perf_counter()
                    try:
                        return fn(*args, **kwargs)
                    finally:
                        bucket.append(time.perf_counter() - t)

            return run

        undo.append((owner, attr, fn))
        setattr(owner, attr, wrap())
    return times, undo


async def measure(app, args, times: dict[str, list[float]]) -> dict:
    import httpx

    rng = random.Random(0)

    def rand(n: int) -> list[int]:
        return [rng.randrange(100, 40000) for _ in range(n)]

    docs = [rand(args.doc_tokens) for _ in range(args.docs)]
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://standin") as client:
        for doc in docs:
            r = await client.post(
                "/redknot/segments", json={"namespace": "bench", "input_ids": doc, "pin": False}
            )
            r.raise_for_status()

        async def block(marked: bool) -> list[float]:
            out = []
            for _ in range(args.block):
                ids, spans = common.reusing_prompt(rand(1), docs, rand(64), "bench")
                body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1}}
                if marked:
                    body["redknot_segments"] = spans
                t = time.perf_counter()
                r = await client.post("/generate", json=body)
                out.append(time.perf_counter() - t)
                r.raise_for_status()
            return out

        await block(True)  # warm-up, not counted
        await block(False)
        runs: dict[str, list[float]] = {"plain": [], "marked": []}
        calls: dict[str, dict[str, list[float]]] = {kind: {} for kind in runs}
        for _ in range(args.blocks):
            for kind in runs:
                for samples in times.values():
                    samples.clear()
                runs[kind] += await block(kind == "marked")
                for name, samples in times.items():
                    calls[kind].setdefault(name, []).extend(samples)
    ms = lambda xs: round(1e3 * statistics.median(xs), 3)
    return {
        "request_ms_p50": {kind: ms(xs) for kind, xs in runs.items()},
        "marked_minus_plain_ms": round(ms(runs["marked"]) - ms(runs["plain"]), 3),
        "per_call_ms_p50": {
            kind: {name: ms(xs) for name, xs in per.items() if xs} for kind, per in calls.items()
        },
        "calls": {kind: {name: len(xs) for name, xs in per.items()} for kind, per in calls.items()},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--docs", type=int, default=8)
    ap.add_argument("--doc-tokens", type=int, default=768)
    ap.add_argument("--block", type=int, default=10, help="requests of one kind in a row")
    ap.add_argument("--blocks", type=int, default=6)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    import logging

    from trace_replay import StandIn

    times, undo = timed_calls()
    try:
        standin = StandIn(region_tokens=1 << 18, context_len=1 << 15)
        standin.start("plain")
        logging.getLogger("sglang").setLevel(logging.WARNING)
        figures = asyncio.run(measure(standin.client.app, args, times))
    finally:
        for owner, attr, fn in undo:
            setattr(owner, attr, fn)
    common.write_json(args.out, common.record(
        docs=args.docs, doc_tokens=args.doc_tokens, block=args.block, blocks=args.blocks,
        **figures,
    ))  # fmt: skip
    print(figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
