"""GPU smoke of automatic segments (``--redknot-auto-segments cdc``) against a real server (not
collected by pytest).

Starts ``python -m sglang.launch_server --attention-backend redknot`` on the Llama-3.1-8B shape
with dummy weights, ``--redknot-policy cacheblend`` (a reuse policy: the segment store is on) and
automatic chunks of about 256 tokens, ``--skip-tokenizer-init`` (token ids only). Sends an
unmarked RAG prompt (six 1,000-token documents under one head), then the same documents in
another order under another head, then that again under a third head with
``"redknot_auto_segments": false``; writes ``$OUT/auto_smoke.json`` (the answers' meta_info,
``/redknot/stats`` after each request) and the server log. On the GPU machine, after the bundle
unpack line: ``python3 tests/api/gpu_auto_smoke.py``.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time

from tests.api.gpu_smoke import OUT, PORT, call, stop, wait_healthy, write


def prompt(head: int, order: list[int], docs: list[list[int]]) -> list[int]:
    rng = random.Random(head)
    return [rng.randrange(1000, 100_000) for _ in range(50)] + [
        t for i in order for t in docs[i]
    ] + [7, 8, 9, 10] * 10  # fmt: skip


def wait_captures(results: dict, key: str) -> None:
    """Poll ``/redknot/stats`` until the captures of the last request are done."""
    last = None
    for _ in range(120):
        stats = call("GET", "/redknot/stats")[1]
        api = stats.get("api", {}) if isinstance(stats, dict) else {}
        done = api.get("captures_stored", 0) + api.get("captures_failed", 0)
        now = (done, api.get("captures_skipped", 0), api.get("captures_sent", 0))
        if now == last and done >= api.get("captures_sent", 0):
            break
        last = now
        time.sleep(1)
    results[key] = stats


def main() -> int:
    model = os.environ.get("MODEL", ".device/models/llama-3.1-8b")
    argv = [sys.executable, "-m", "sglang.launch_server", "--model-path", model]
    argv += ["--load-format", "dummy", "--skip-tokenizer-init", "--grammar-backend", "none"]
    argv += ["--sampling-backend", "pytorch", "--context-length", "16384", "--port", str(PORT)]
    argv += ["--disable-prefill-cuda-graph", "--cuda-graph-max-bs-decode", "4"]
    argv += ["--attention-backend", "redknot", "--redknot-policy", "cacheblend"]
    argv += ["--redknot-auto-segments", "cdc", "--redknot-auto-chunk-tokens", "256"]
    with open(os.path.join(OUT, "auto_smoke_server.log"), "w") as log:
        server = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    rng = random.Random(0)
    docs = [[rng.randrange(1000, 100_000) for _ in range(1000)] for _ in range(6)]
    results: dict[str, object] = {}
    try:
        if not wait_healthy(server, 500):
            return 1
        sp = {"max_new_tokens": 1, "temperature": 0}
        requests = [
            ("first", prompt(1, [0, 1, 2, 3, 4, 5], docs), {}),
            ("reordered", prompt(2, [5, 3, 0, 1, 4, 2], docs), {}),
            ("opted_out", prompt(3, [5, 3, 0, 1, 4, 2], docs), {"redknot_auto_segments": False}),
        ]
        for name, ids, extra in requests:
            t0 = time.perf_counter()
            status, out = call(
                "POST", "/generate", {"input_ids": ids, "sampling_params": sp} | extra
            )
            elapsed = time.perf_counter() - t0
            meta = out.get("meta_info") if isinstance(out, dict) else out
            results[name] = {"status": status, "seconds": elapsed, "meta_info": meta}
            wait_captures(results, f"stats_after_{name}")
    finally:
        stop(server)
    write(results, "auto_smoke.json")
    for k, v in results.items():
        print(k, json.dumps(v.get("auto", v) if isinstance(v, dict) else v, default=str)[:600])
    return 0


if __name__ == "__main__":
    sys.exit(main())
