"""Host time of the HTTP side of automatic segments: ``rewrite_generate`` on unmarked prompts.

Under ``--redknot-auto-segments`` every unmarked ``/generate`` prompt is cut into chunks, looked
up against the learned document edges, given segment ids and re-serialised before SGLang sees
it; on the GPU machine this showed as the ``http_in`` phase (+1.3 ms a chat request against
flashinfer, ``trace_replay_chat_paired.json``). This replays ``trace_replay.py``'s streams on the
CPU server stand-in (``--standin``: the real HTTP app and request API, no engine) and times every
call of the middleware's ``rewrite_generate`` (``marked_host_cost.timed_calls``), so the figures
are this machine's host time for the same prompts a GPU run sends.

    python benchmarks/auto_rewrite_cost.py --workloads chat,rag \
        --out benchmarks/results/auto_rewrite_cost.json
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import serving_common as common
from marked_host_cost import timed_calls


def measure(workload: str, mode: str, requests: int, warmup: int) -> dict:
    """One closed-loop pass of ``workload`` on a fresh stand-in with ``cdc-docs``; the
    ``rewrite_generate`` call times after the first ``warmup`` requests."""
    import trace_replay

    times, undo = timed_calls()
    try:
        argv = [
            "--standin", "--standin-exact-prefix", "--standin-auto-mode", mode,
            "--region-tokens", "211744", "--workloads", workload, "--modes", "auto",
            "--requests", str(requests), "--out", "/dev/null",
        ]  # fmt: skip
        with contextlib.redirect_stdout(io.StringIO()):
            trace_replay.main(argv)
    finally:
        for owner, attr, fn in undo:
            setattr(owner, attr, fn)
    calls = times["rewrite_generate"][warmup:]
    ms = [1e3 * t for t in calls]
    return {
        "workload": workload,
        "auto_mode": mode,
        "calls": len(ms),
        "rewrite_ms_p50": round(statistics.median(ms), 3),
        "rewrite_ms_mean": round(statistics.fmean(ms), 3),
        "rewrite_ms_p90": round(sorted(ms)[int(0.9 * len(ms))], 3),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default="chat,rag")
    ap.add_argument("--mode", default="cdc-docs", help="--redknot-auto-segments")
    ap.add_argument("--requests", type=int, default=128, help="RAG requests (chat: 16 x 8)")
    ap.add_argument("--warmup", type=int, default=32)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    rows = [measure(w, args.mode, args.requests, args.warmup) for w in args.workloads.split(",")]
    for row in rows:
        print(row)
    common.write_json(args.out, common.record(rows=rows, note="CPU host time, this machine"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
