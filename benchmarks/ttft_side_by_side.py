"""Time to first token of several servers running at once, one request at a time, interleaved.

``ttft.py`` starts one engine after another; where a prompt takes 20-60 ms of mostly host time
(a 135M model), two engines of one machine differ by as much as the servers do (SmolLM2 at
1024 x 8, H100: flashinfer 17.9 ms in one run, 59 ms in another, the redknot servers the other
way round). Here every server runs for the whole measurement and they take turns: each round
sends one prompt per point to every server, the order of the servers rotating from round to
round, so a slow spell of the machine falls on all of them alike, and each server's TTFT is
compared with flashinfer's of the same round (``paired_speedup``: the median over rounds of
flashinfer's TTFT over the server's; ``over_unmarked``, with ``--unmarked-too``: the same
against the server's own TTFT of the same prompt unmarked (the same documents, with a first
token and a question of its own like every prompt here), which the host speed of whole server
processes, different from one to the next, does not move). A prompt leaves at least
``--settle-ms`` (10 ms) after its server's last answer: a server works on for a few ms after
answering (SGLang's scheduler after a one-token prompt), and rows of one server that follow each
other in a round (its ``-unmarked`` and ``-params`` rows) would otherwise wait for it unequally.

Servers are ``sglang.launch_server`` processes with the given flags and SGLang's defaults
otherwise (the prefill CUDA graph included), dummy weights, token ids in. A prompt is one
unique token (no two prompts share a cached prefix), ``S`` documents of ``L / S`` tokens and a
fresh ``--question``-token question; a redknot server first registers the documents and the
prompt marks them as segments, a flashinfer server gets the same ids unmarked. Per request the
redknot report (``meta_info["redknot_reuse"]``) says whether the reuse gate served it with reuse
or recomputed it; both are counted per point.

    python3 benchmarks/gpu_run.py bench ttft_side_by_side \
        --model benchmarks/models/smollm2-135m-instruct --points 512x4,1024x8,4096x8 \
        --servers "flashinfer=--attention-backend flashinfer;cacheblend=--attention-backend redknot --redknot-policy cacheblend"
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import serving_common as common
from serving_common import PHASES, phases_of, post
from trace_replay import reuse_report, stream_generate
from ttft import parse_points, point_key

BASELINE = "flashinfer"
SERVER_FLAGS = (  # every server: dummy weights, token ids in, no grammar, decode graphs for
    # small batches only (quicker startup; the prefill graph stays on, as SGLang's default)
    "--load-format dummy --skip-tokenizer-init --grammar-backend none --random-seed 0 "
    "--sampling-backend pytorch --cuda-graph-max-bs-decode 8"
)
DEFAULT_SERVERS = (
    "flashinfer=--attention-backend flashinfer;"
    "redknot=--attention-backend redknot;"
    "cacheblend=--attention-backend redknot --redknot-policy cacheblend;"
    "epic=--attention-backend redknot --redknot-policy epic"
)


def parse_servers(text: str, own_recompute: bool = False) -> dict[str, list[str]]:
    """``"name=flags;name=flags"`` -> ``{name: flags}``; flashinfer (the baseline) must be one,
    unless ``own_recompute`` (``--unmarked-too``: each server is compared with itself,
    ``over_unmarked``)."""
    servers = {}
    for item in filter(None, (part.strip() for part in text.split(";"))):
        name, sep, flags = item.partition("=")
        if not sep or not name.strip():
            raise SystemExit(f"--servers: {item!r} is not NAME=FLAGS")
        servers[name.strip()] = flags.split()
    if BASELINE not in servers and not own_recompute:
        raise SystemExit(
            f"--servers: one server must be named {BASELINE!r} (the baseline), or give "
            "--unmarked-too to compare each server with its own unmarked prompts"
        )
    return servers


CLIENT_CORES = 2  # cores this script keeps for itself when the servers are pinned


def split_cores(cores: list[int], servers: int) -> tuple[list[int], list[list[int]]] | None:
    """``cores`` as the client's first ``CLIENT_CORES`` and an equal, disjoint share per server
    (the remainder unused); None when a server would get fewer than 2."""
    cores = sorted(cores)
    each = (len(cores) - CLIENT_CORES) // max(servers, 1)
    if each < 2:
        return None
    rest = cores[CLIENT_CORES:]
    return cores[:CLIENT_CORES], [rest[i * each : (i + 1) * each] for i in range(servers)]


def register(url: str, payload: dict) -> None:
    """``POST url/redknot/segments``: a segment stored standalone (docs/api.md section 4)."""
    post(url, "/redknot/segments", payload)


def gate_of(meta: dict) -> str:
    """``reuse``, ``recompute`` (the gate's decision), ``none`` (no report or no hit)."""
    report = reuse_report(meta)
    if not report:
        return "none"
    if report.get("reused_tokens"):
        return "reuse"
    return (report.get("gate") or {}).get("decision", "none")


def gate_state(url: str) -> dict | None:
    """The server's ``redknot_reuse_gate`` in ``GET /server_info`` (decisions counted, the host
    scale, the measured correction's forwards and factors), None where it has none."""
    try:
        with urllib.request.urlopen(url + "/server_info", timeout=60) as resp:
            info = json.loads(resp.read())
    except (urllib.error.URLError, ValueError):
        return None
    states = info.get("internal_states") or [{}]
    return states[0].get("redknot_reuse_gate")


def gate_reason(meta: dict) -> str | None:
    """The gate's reason in the answer's report (its predictions and measured factors), None
    without a gate decision."""
    report = reuse_report(meta)
    return ((report or {}).get("gate") or {}).get("reason")


UNMARKED = "-unmarked"  # row suffix: a redknot server's same prompt sent without markup
PARAMS = "-params"  # row suffix: that unmarked prompt with a neutral ``custom_params``
SETTLE_MS = 10.0  # a prompt leaves at least this long after its server's last answer
NEUTRAL_PARAMS = {"probe": 0}  # a key nothing reads: what carrying custom_params alone costs
PROFILE_WARMUP = "-warmup"  # suffix of the directory of each server's discarded first profile


def measure(urls: dict[str, str], args, vocab: int, on_point=None) -> dict:
    """Every point of ``args.points`` on every server; ``on_point(results so far)`` after each
    point (the caller writes them, so that a run cut short keeps its finished points).

    With ``args.unmarked_too`` every redknot server also answers each round's prompt unmarked
    (row ``NAME-unmarked``): the difference to its marked row is what the markup costs on that
    server. With ``args.params_too`` it also answers it unmarked with a neutral
    ``custom_params`` (row ``NAME-params``, :data:`NEUTRAL_PARAMS`), the channel marks travel
    in: what SGLang's handling of a request that carries them costs, apart from redknot's.
    With ``args.profile_dir``, after the rounds of each point of ``args.profile_points``
    every row's server answers ``args.profile_requests`` more prompts under SGLang's torch
    profiler, traces under ``profile_dir/ROW-POINT``. Before its first, each server runs one
    prompt under the profiler, kept apart (``profile_dir-warmup/SERVER``, not summarised): a
    process's first profile is slower throughout (the profiler's own start), which would
    fall on whichever row it profiled first."""
    rng = random.Random(0)

    def rand(n: int) -> list[int]:
        return [rng.randrange(100, vocab - 100) for _ in range(n)]

    one = {"temperature": 0.0, "max_new_tokens": 1}
    settle_ms = getattr(args, "settle_ms", SETTLE_MS)
    answered: dict[str, float] = {}  # server -> when it last answered (perf_counter)
    profiled = set(filter(None, (getattr(args, "profile_points", "") or "").split(",")))
    profiler_warm: set[str] = set()  # servers whose discarded first profile has run
    results = {}
    for length, count in parse_points(args.points):
        docs = [rand(length // count) for _ in range(count)]
        names = list(urls)
        rows = {name: {"samples": [], "gate": {}} for name in names}
        marked = {name: name != BASELINE for name in names}
        for name in names:
            for doc in docs if marked[name] else ():  # registered (standalone), not timed
                try:
                    register(urls[name], {"namespace": "bench", "input_ids": doc, "pin": False})
                except urllib.error.HTTPError as e:  # a server that stores no segments
                    rows[name]["unmarked"] = f"registration refused: {e.read()[:300]!r}"
                    marked[name] = False
                    break
        # (row, server, marked): the rows that take turns in each round
        entries = [(name, name, marked[name]) for name in names]
        if getattr(args, "unmarked_too", False):
            entries += [(name + UNMARKED, name, False) for name in names if marked[name]]
        if getattr(args, "params_too", False):
            entries += [(name + PARAMS, name, PARAMS) for name in names if marked[name]]
        rows.update({row: {"samples": [], "gate": {}} for row, _, _ in entries[len(names) :]})

        def send(server: str, mark, docs=docs) -> tuple[float, dict, float]:
            """``mark``: True (marked), False (unmarked) or PARAMS (unmarked, neutral params)."""
            ids, spans = common.reusing_prompt(rand(1), docs, rand(args.question), "bench")
            payload = {"input_ids": ids, "sampling_params": one}
            if mark == PARAMS:
                payload["sampling_params"] = {**one, "custom_params": NEUTRAL_PARAMS}
            elif mark:
                payload["redknot_segments"] = spans
            common.settle(answered.get(server, 0.0), settle_ms)  # after this server's answer
            sent = time.time()
            out = stream_generate(urls[server], payload, timeout=300)
            answered[server] = time.perf_counter()
            return (*out, sent)

        for rnd in range(args.rounds + 1):  # round 0 warms every server up, not counted
            shift = rnd % len(entries)
            for row, server, mark in entries[shift:] + entries[:shift]:
                ttft, meta, sent = send(server, mark)
                if rnd:
                    rows[row]["samples"].append(round(ttft, 5))
                    phases = phases_of(meta, sent, ttft)
                    if phases is not None:
                        rows[row].setdefault("phase_samples", []).append(phases)
                    gate, decision = rows[row]["gate"], gate_of(meta)
                    gate[decision] = gate.get(decision, 0) + 1
                    reason = gate_reason(meta)  # what the gate predicted, per sample
                    if reason is not None:
                        rows[row].setdefault("gate_reasons", []).append(reason)

        def under_profiler(server: str, mark, where: Path, prompts: int) -> list[float]:
            """TTFTs of ``prompts`` prompts to ``server`` traced into ``where``."""
            post(urls[server], "/start_profile", {
                "output_dir": str(where), "activities": ["CPU", "GPU"],
                "with_stack": bool(getattr(args, "profile_stack", False)), "record_shapes": False,
            })  # fmt: skip
            took = [send(server, mark)[0] for _ in range(prompts)]
            post(urls[server], "/stop_profile")
            return took

        key = point_key(length, count)
        if key in profiled and args.profile_dir:
            for server in dict.fromkeys(server for _, server, _ in entries):
                if server not in profiler_warm:
                    profiler_warm.add(server)
                    under_profiler(
                        server, False, Path(args.profile_dir + PROFILE_WARMUP, server), 1
                    )
            for row, server, mark in entries:
                where = Path(args.profile_dir, f"{row}-{key}")
                took = under_profiler(server, mark, where, args.profile_requests)
                rows[row]["profiled_ttft_s"] = [round(t, 5) for t in took]
        base = rows[BASELINE]["samples"] if BASELINE in rows else None
        for name, row in rows.items():
            row["ttft_s"] = statistics.median(row["samples"])
            row["p90_s"] = sorted(row["samples"])[int(0.9 * (len(row["samples"]) - 1))]
            if base is not None:
                row["speedup_vs_flashinfer"] = round(statistics.median(base) / row["ttft_s"], 3)
                row["paired_speedup"] = round(
                    statistics.median(b / s for b, s in zip(base, row["samples"])), 3
                )
            seen = row.pop("phase_samples", None)
            if seen:  # the median of each phase over the rounds, ms
                row["phases_ms"] = {
                    name: round(1e3 * statistics.median(p[name] for p in seen), 3)
                    for name in PHASES
                }
        for name, row in rows.items():  # a marked row against its own server unmarked
            plain = rows.get(f"{name}{UNMARKED}")
            if plain is not None:
                row["over_unmarked"] = round(statistics.median(
                    u / m for u, m in zip(plain["samples"], row["samples"])
                ), 3)  # fmt: skip
        for name in names:  # what each redknot server's gate holds after the point
            if marked[name]:
                rows[name]["gate_state"] = gate_state(urls[name])
        results[key] = rows
        print(key, {n: (round(r["ttft_s"] * 1e3, 1),
                        r.get("paired_speedup", r.get("over_unmarked")), r["gate"])
                    for n, r in rows.items()}, flush=True)  # fmt: skip
        if on_point is not None:
            on_point(results)
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=common.DEFAULT_MODEL)
    ap.add_argument("--points", default="512x4,1024x8,2048x8,4096x8,6144x8")
    ap.add_argument("--servers", default=DEFAULT_SERVERS, help="NAME=FLAGS;... (one flashinfer)")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--question", type=int, default=64)
    ap.add_argument(
        "--settle-ms", type=float, default=SETTLE_MS,
        help="send each prompt at least this long after its server's last answer (a server "
        "works on for a few ms after answering, and a prompt that arrives then waits: two rows "
        "of one server sent back to back would be timed unequally); 0: at once",
    )  # fmt: skip
    ap.add_argument(
        "--mem-fraction-static", type=float, default=0.2,
        help="per server, of the GPU memory free when it starts",
    )  # fmt: skip
    ap.add_argument(
        "--startup-s", type=float, default=420,
        help="per server; the first on a fresh machine waits for FlashInfer's JIT (4.7 min for "
        "SmolLM2's head dim 64 on an H100, 2026-11-25)",
    )  # fmt: skip
    ap.add_argument(
        "--pin-cores", action=argparse.BooleanOptionalAction, default=True,
        help="each server (all its processes) on its own cores, this script on two others: "
        "servers that share cores disturb each other's host-bound TTFT",
    )  # fmt: skip
    ap.add_argument(
        "--unmarked-too", action="store_true",
        help="each redknot server also answers every round's prompt unmarked (row NAME-unmarked)",
    )  # fmt: skip
    ap.add_argument(
        "--params-too", action="store_true",
        help="each redknot server also answers every round's prompt unmarked with a neutral "
        "custom_params (row NAME-params): what carrying custom_params alone costs",
    )  # fmt: skip
    ap.add_argument(
        "--profile-dir", default="",
        help="with --profile-points: traces of SGLang's torch profiler under DIR/ROW-POINT "
        "(gpu_run.py summarises them with benchmarks/profile_summary.py)",
    )  # fmt: skip
    ap.add_argument("--profile-points", default="", help="points to profile, e.g. 512x4,4096x8")
    ap.add_argument("--profile-requests", type=int, default=1, help="prompts per profiled row")
    ap.add_argument(
        "--profile-stack", action="store_true",
        help="profile with Python stacks (the profiler's Python tracer: every function's host "
        "time lands in the summary's python list; host time runs slower under it)",
    )  # fmt: skip
    ap.add_argument(
        "--phases", action="store_true",
        help="every server with SGLang's --enable-metrics: each row also gets the median time "
        "of each phase of a request (phases_ms: http_in, api_dispatch, to_forward, prefill, out)",
    )  # fmt: skip
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    servers = parse_servers(args.servers, own_recompute=args.unmarked_too)
    split = None
    if args.pin_cores:
        split = split_cores(list(os.sched_getaffinity(0)), len(servers))
        if split is None:
            print("--pin-cores: too few cores for two per server; not pinned", flush=True)
        else:
            os.sched_setaffinity(0, split[0])
    cores = dict(zip(servers, split[1])) if split else {}

    import gpu_machine as gm

    tree, env = gm.unpack()
    context = max(length for length, _ in parse_points(args.points)) + args.question + 64
    common_flags = ["--model-path", args.model, *SERVER_FLAGS.split(),
                    "--context-length", str(context),
                    "--mem-fraction-static", str(args.mem_fraction_static)]  # fmt: skip
    common_flags += ["--enable-metrics"] if args.phases else []
    procs, urls = {}, {}
    try:
        # One after another: SGLang sizes a server's KV pool from the GPU memory free when it
        # loads (``--mem-fraction-static`` of it), so servers started together see each other's
        # allocations appear mid-profile (four at 0.15 on an H100: "Loaded weights leave no GPU
        # memory for the KV cache"). Started in turn, each takes its share of what is left.
        for i, (name, flags) in enumerate(servers.items()):
            port, log = 30000 + 10 * i, f"server_{gm.plain(name)}.log"
            proc = gm.start_server(common_flags + flags, port, tree, env, log, cores.get(name))
            procs[name], urls[name] = proc, f"http://127.0.0.1:{port}"
            if not gm.wait_healthy(proc, port, log, args.startup_s):
                return 1
        vocab = json.loads(Path(args.model, "config.json").read_text())["vocab_size"]

        def write(results: dict, complete: bool = False) -> None:
            served = {}  # what each redknot server said it serves and why, and what its reuse
            for name in servers:  # gate measured at startup (its log)
                log = (gm.OUT / f"server_{gm.plain(name)}.log").read_text(errors="replace")
                said = ("redknot: serv", "reuse gate calibrat", "gate is not calibrated",
                        "markup is inert")  # fmt: skip
                served[name] = [x for x in log.splitlines() if any(s in x for s in said)][:6]
            common.write_json(args.out, common.record(
                model=args.model, points=args.points, rounds=args.rounds,
                question=args.question, settle_ms=args.settle_ms, complete=complete,
                servers={name: " ".join(flags) for name, flags in servers.items()},
                server_flags=SERVER_FLAGS, mem_fraction_static=args.mem_fraction_static,
                cores={"client": split[0], **cores} if split else None,
                phases=args.phases, unmarked_too=args.unmarked_too, params_too=args.params_too,
                profile_points=args.profile_points,
                profile_requests=args.profile_requests if args.profile_points else None,
                profile_stack=args.profile_stack,
                served=served, summary=results,
            ))  # fmt: skip

        write(measure(urls, args, vocab, on_point=write), complete=True)
    finally:
        for proc in procs.values():
            gm.stop_server(proc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
