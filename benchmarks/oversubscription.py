"""Oversubscription: twice as many 32K-token requests as the KV pool holds, on a redknot server.

One ``python -m sglang.launch_server --attention-backend redknot`` (8B shape, dummy weights, the
synthetic 1/8-global map) with ``--max-total-tokens`` set so that ``--fit`` requests of
``--length`` prompt + ``--new-tokens`` tokens fill the token slots. ``2 * fit`` requests, a third
each of

- *hit*: the prompt is the ``--segments`` registered (pinned) documents in a random order
  (so at other positions than where they were prefilled), marked as segments;
- *miss*: the same shape, marked, but its documents were never registered;
- *plain*: random tokens, no marks;

every prompt starting with a token of its own (no two share a cached prefix).

1. **Alone**: each request is served by itself, one after the other (the reference outputs).
2. ``/flush_cache`` and the documents registered again, so that nothing of step 1 is cached.
3. **Load**: all requests are submitted at once; ``--cancel`` of them, chosen at random, are
   aborted (``/abort_request``) after a random delay. ``/server_info`` is polled meanwhile
   for the pool's occupancy (``redknot_pool``: token and request slots in use, queue).
4. **Drain**: once idle, the pool must hold nothing of the requests (request slots all free,
   no segment reference, no pending capture or segment read); then the documents are deleted,
   the cache flushed, and every token slot, snapshot and segment page must be free again.

The whole sequence runs twice (``--retract-intervals``): once as is (SGLang admits what fits and
queues the rest), once with SGLang's test switch that retracts running decodes every N forward
passes (``SGLANG_TEST_RETRACT``), so that retraction, requeueing and re-prefill of redknot
requests (rings, segment references) run many times.

Every completed request's greedy tokens are compared with its served-alone tokens; at a
mismatch, the top-2 log-probabilities at the first differing position are recorded (a near-tie
flipped by batch composition is a different finding from a wrong kernel). The server log is
scanned for SGLang's invariant-checker messages (leak, double free, use after free), which the
checker raises as errors by default (``SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE``).

    python benchmarks/oversubscription.py --out benchmarks/results/oversubscription.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serving_common as common

CHECKER_MESSAGES = ("memory leak detected", "double free", "use-after-free", "Traceback")
KINDS = ("hit", "miss", "plain")


def _body(raw: bytes) -> object:
    """JSON when the answer is JSON (``/flush_cache`` answers plain text)."""
    try:
        return json.loads(raw) if raw else None
    except ValueError:
        return raw.decode(errors="replace")


class Server:
    def __init__(self, url: str):
        self.url = url

    def call(self, method: str, path: str, body: object | None = None, timeout: float = 600):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            self.url + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, _body(r.read())
        except urllib.error.HTTPError as e:
            return e.code, _body(e.read())

    def state(self) -> dict:
        info = self.call("GET", "/server_info")[1]
        s = info["internal_states"][0]
        return {"pool": s.get("redknot_pool", {}), "segments": s.get("redknot_segments", {})}

    def wait_idle(self, timeout: float = 300) -> dict:
        end = time.time() + timeout
        while time.time() < end:
            st = self.state()
            pool = st["pool"]
            if pool.get("running_requests") == 0 and pool.get("waiting_requests") == 0:
                return st
            time.sleep(0.5)
        raise TimeoutError("the server did not become idle")


def gpu_used_mib() -> int | None:
    """Memory in use on GPU 0 as nvidia-smi reports it (the server's pools are allocated at
    startup, so this shows growth beyond them: activations, graphs, fragmentation)."""
    proc = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
        check=False, capture_output=True, text=True,
    )  # fmt: skip
    return int(proc.stdout.split()[0]) if proc.returncode == 0 and proc.stdout.strip() else None


def build_requests(args, vocab: int):
    rng = random.Random(args.seed)

    def rand(n: int) -> list[int]:
        return [rng.randrange(100, vocab - 100) for _ in range(n)]

    doc_len = (args.length - 1 - args.question) // args.segments
    shared_docs = [rand(doc_len) for _ in range(args.segments)]
    requests = []
    for i in range(2 * args.fit):
        kind = KINDS[i % 3]
        ids, marks = rand(1), []
        if kind == "plain":
            ids += rand(args.segments * doc_len)
        else:
            docs = rng.sample(shared_docs, len(shared_docs)) if kind == "hit" else None
            docs = docs or [rand(doc_len) for _ in range(args.segments)]
            for doc in docs:
                marks.append({"start": len(ids), "end": len(ids) + len(doc), "namespace": "kb"})
                ids += doc
        ids += rand(args.question)
        requests.append({"i": i, "kind": kind, "input_ids": ids, "marks": marks})
    cancel = set(rng.sample(range(len(requests)), args.cancel))
    for r in requests:
        r["cancel_after_s"] = round(rng.uniform(0.0, args.cancel_window_s), 3) if (
            r["i"] in cancel
        ) else None  # fmt: skip
    return shared_docs, requests


def generate(server: Server, req: dict, args, rid: str) -> tuple[int, object]:
    body = {
        "rid": rid,
        "input_ids": req["input_ids"],
        "sampling_params": {"max_new_tokens": args.new_tokens, "temperature": 0.0},
        "return_logprob": True,
        "top_logprobs_num": 2,
        "logprob_start_len": len(req["input_ids"]) - 1,
    }
    if req["marks"]:
        body["redknot_segments"] = req["marks"]
    return server.call("POST", "/generate", body)


def register_docs(server: Server, docs) -> list[str]:
    ids = []
    for doc in docs:
        code, out = server.call(
            "POST", "/redknot/segments", {"namespace": "kb", "input_ids": doc, "pin": True}
        )
        if code != 200:
            raise RuntimeError(f"registering a document failed: {code} {out}")
        ids.append(out["segment_id"])
    return ids


def top2(out: dict, step: int):
    tops = out["meta_info"].get("output_top_logprobs") or []
    if step < len(tops) and tops[step]:
        return [[round(lp, 4), tok] for lp, tok, *_ in tops[step][:2]]
    return None


def run(args, retract_interval: int, log_path: Path) -> dict:
    model = args.model
    cfg = json.loads(Path(model, "config.json").read_text())
    fit_tokens = args.fit * (args.length + args.new_tokens)
    argv = [sys.executable, "-m", "sglang.launch_server", "--model-path", model,
            "--load-format", "dummy", "--skip-tokenizer-init", "--grammar-backend", "none",
            "--sampling-backend", "pytorch", "--random-seed", "0",
            "--context-length", str(args.length + args.new_tokens + 64),
            "--port", str(args.port), "--attention-backend", "redknot",
            "--redknot-head-map", args.head_map, "--redknot-namespaces", "kb",
            "--redknot-segment-fraction", str(args.segment_fraction),
            "--max-total-tokens", str(fit_tokens + args.slack_tokens),
            "--max-running-requests", str(2 * args.fit),
            "--disable-prefill-cuda-graph", "--cuda-graph-max-bs-decode", str(2 * args.fit),
            "--chunked-prefill-size", str(args.chunked_prefill_size),
            "--mem-fraction-static", str(args.mem_fraction_static)]  # fmt: skip
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = os.environ.copy()
    if retract_interval:
        # SGLang's own test switch: retract running decodes every N forward passes, so that
        # retraction and re-admission run many times whatever the memory pressure.
        env.update(SGLANG_TEST_RETRACT="1", SGLANG_TEST_RETRACT_INTERVAL=str(retract_interval))
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
    server = Server(f"http://127.0.0.1:{args.port}")
    result: dict = {"server_argv": argv[1:], "forced_retract_interval": retract_interval}
    try:
        for _ in range(600):
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited during startup; see {log_path}")
            try:
                if server.call("GET", "/health", timeout=5)[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(1)
        docs, requests = build_requests(args, cfg["vocab_size"])
        idle0 = server.state()
        idle0["gpu_used_mib"] = gpu_used_mib()
        result["idle_before"] = idle0
        # 1. alone
        register_docs(server, docs)
        alone = {}
        t0 = time.time()
        for r in requests:
            code, out = generate(server, r, args, f"alone-{r['i']}")
            if code != 200:
                raise RuntimeError(f"request {r['i']} ({r['kind']}) alone failed: {code} {out}")
            alone[r["i"]] = out
        result["alone_s"] = round(time.time() - t0, 2)
        result["alone_segment_stats"] = server.state()["segments"]
        # 2. nothing of the alone runs stays cached
        server.wait_idle()
        code, out = server.call("POST", "/flush_cache")
        if code != 200:
            raise RuntimeError(f"/flush_cache failed: {code} {out}")
        doc_ids = register_docs(server, docs)
        seg_before = server.state()["segments"]
        # 3. load
        samples: list[dict] = []
        failed_polls: list[str] = []
        stop = threading.Event()

        def poll():
            while not stop.is_set():
                try:
                    st = server.state()["pool"]
                    st["t"] = time.time()
                    st["gpu_used_mib"] = gpu_used_mib()
                    samples.append(st)
                except (OSError, KeyError, ValueError) as e:  # a missing sample, counted
                    failed_polls.append(repr(e))
                time.sleep(0.25)

        def one(r):
            rid = f"load-{r['i']}"
            if r["cancel_after_s"] is not None:
                timer = threading.Timer(
                    r["cancel_after_s"], lambda: server.call("POST", "/abort_request", {"rid": rid})
                )
                timer.start()
            t = time.time()
            code, out = generate(server, r, args, rid)
            return r["i"], code, out, time.time() - t

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        t0 = time.time()
        with ThreadPoolExecutor(len(requests)) as pool:
            loaded = {i: (code, out, dt) for i, code, out, dt in pool.map(one, requests)}
        result["load_s"] = round(time.time() - t0, 2)
        stop.set()
        poller.join()
        # 4. drain
        drained = server.wait_idle()
        result["after_load_idle"] = drained
        for sid in doc_ids:
            server.call("DELETE", f"/redknot/segments/{sid}?namespace=kb")
        server.call("POST", "/flush_cache")
        result["after_flush"] = server.state()
        result["after_flush"]["gpu_used_mib"] = gpu_used_mib()
        result["server_alive"] = proc.poll() is None and server.call("GET", "/health")[0] == 200
        # compare
        rows, mismatches, completed, cancelled, lost, retractions = [], 0, 0, 0, 0, 0
        for r in requests:
            code, out, dt = loaded[r["i"]]
            row = {"i": r["i"], "kind": r["kind"], "prompt_tokens": len(r["input_ids"]),
                   "cancel_after_s": r["cancel_after_s"], "http": code,
                   "latency_s": round(dt, 2)}  # fmt: skip
            finish = (out.get("meta_info", {}).get("finish_reason") or {}) if code == 200 else {}
            row["finish"] = finish.get("type")
            if code == 200:
                retractions += out["meta_info"].get("num_retractions", 0) or 0
                row["retractions"] = out["meta_info"].get("num_retractions")
            if row["finish"] == "abort" or (code != 200 and r["cancel_after_s"] is not None):
                cancelled += 1
                row["outcome"] = "cancelled"
            elif code != 200 or row["finish"] != "length":
                lost += 1
                row["outcome"] = "lost"
                row["error"] = str(out)[:300]
            else:
                completed += 1
                got, want = out["output_ids"], alone[r["i"]]["output_ids"]
                same = got == want
                row["outcome"] = "completed"
                row["matches_alone"] = same
                if not same:
                    mismatches += 1
                    step = next(k for k, (a, b) in enumerate(zip(got, want)) if a != b)
                    row["first_difference"] = step
                    row["top2_load"] = top2(out, step)
                    row["top2_alone"] = top2(alone[r["i"]], step)
            rows.append(row)
        peak = max(samples, key=lambda s: s["token_slots_total"] - s["token_slots_free"]) if (
            samples
        ) else {}  # fmt: skip
        flushed = result["after_flush"]["pool"]
        drained_pool, seg_flushed = drained["pool"], result["after_flush"]["segments"]
        page_bytes = seg_flushed.get("page_tokens", 1) * seg_flushed.get("bytes_per_token", 1)
        leaked_pages = {  # held after the drain (requests) or after the flush (caches)
            "token_slots": flushed["token_slots_total"] - flushed["token_slots_free"],
            "request_slots": drained_pool["request_slots_total"]
            - drained_pool["request_slots_free"],
            "snapshots": flushed["snapshots_total"] - flushed["snapshots_free"],
            "segment_pages": seg_flushed.get("bytes_used", 0) // max(1, page_bytes),
        }
        leaked_references = {
            "segment_references": drained["segments"].get("referenced", 0),
            "segment_reads": drained_pool["segment_reads"],
            "segment_writes": flushed["segment_writes"],
            "capture_jobs": flushed["capture_jobs"],
            "pending_ring_copies": flushed["pending_ring_copies"],
            "tree_protected_tokens": drained_pool["tree_protected_tokens"],
        }
        log_text = log_path.read_text(errors="replace")
        checker = {m: log_text.count(m) for m in CHECKER_MESSAGES}
        result.update(
            requests=len(requests),
            fit=args.fit,
            by_kind={k: sum(r["kind"] == k for r in requests) for k in KINDS},
            cancel_requested=args.cancel,
            completed=completed,
            cancelled=cancelled,
            lost=lost,
            mismatches=mismatches,
            retractions=retractions,
            leaked_pages=sum(leaked_pages.values()),
            leaked_pages_by_kind=leaked_pages,
            leaked_references=leaked_references,
            returns_to_empty=not any(leaked_pages.values()),
            gpu_used_mib={
                "idle_before": idle0["gpu_used_mib"],
                "after_flush": result["after_flush"]["gpu_used_mib"],
            },
            peak={
                "token_slots_used": peak.get("token_slots_total", 0)
                - peak.get("token_slots_free", 0),
                "token_slots_total": peak.get("token_slots_total"),
                "running_requests": max((s["running_requests"] for s in samples), default=None),
                "waiting_requests": max((s["waiting_requests"] for s in samples), default=None),
                "gpu_used_mib": max((s["gpu_used_mib"] or 0 for s in samples), default=None),
                "samples": len(samples),
                "failed_polls": len(failed_polls),
            },
            invariant_checker_messages=checker,
            segment_hits_during_load=result["after_load_idle"]["segments"].get("hits", 0)
            - seg_before.get("hits", 0),
            segment_misses_during_load=result["after_load_idle"]["segments"].get("misses", 0)
            - seg_before.get("misses", 0),
            rows=rows,
        )
        return result
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def passed(result: dict) -> bool:
    return (
        result["lost"] == 0
        and result["mismatches"] == 0
        and result["returns_to_empty"]
        and not any(result["leaked_references"].values())
        and result["server_alive"]
        and not any(result["invariant_checker_messages"].values())
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=common.DEFAULT_MODEL)
    ap.add_argument(
        "--head-map", default=str(common.ROOT / "configs/heads/synthetic/llama-3.1-8b-g0.125.json")
    )
    ap.add_argument("--fit", type=int, default=8, help="requests the token slots hold at once")
    ap.add_argument("--length", type=int, default=32768)
    ap.add_argument("--segments", type=int, default=8)
    ap.add_argument("--question", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--cancel", type=int, default=4)
    ap.add_argument("--cancel-window-s", type=float, default=8.0)
    ap.add_argument("--slack-tokens", type=int, default=0)
    ap.add_argument("--segment-fraction", type=float, default=0.15)
    ap.add_argument("--mem-fraction-static", type=float, default=0.8)
    ap.add_argument("--chunked-prefill-size", type=int, default=8192)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument(
        "--retract-intervals",
        default="0,8",
        help="one run per value: 0 lets SGLang retract only under real memory pressure; N > 0 "
        "forces a retraction every N forward passes (SGLANG_TEST_RETRACT)",
    )
    ap.add_argument("--log-dir", default=os.environ.get("OUT", "/tmp"))
    ap.add_argument("--out", default=str(common.ROOT / "benchmarks/results/oversubscription.json"))
    args = ap.parse_args()
    runs = {}
    for interval in (int(x) for x in args.retract_intervals.split(",")):
        name = "natural" if interval == 0 else f"forced-retract-every-{interval}"
        try:
            result = run(args, interval, Path(args.log_dir) / f"oversub_server_{name}.log")
            result["passed"] = passed(result)
        except Exception as e:  # noqa: BLE001 - recorded as this run's failure, next run goes on
            result = {"error": repr(e), "passed": False}
        runs[name] = result
        summary = {k: v for k, v in result.items() if k not in ("rows", "server_argv")}
        print(name, json.dumps(summary, indent=1), flush=True)
    common.write_json(args.out, common.record(runs=runs))
    return 0 if all(r["passed"] for r in runs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
