"""Shared pieces of the serving benchmarks: engine options, synthetic maps, result records.

Every benchmark runs each server variant in its own process (a fresh ``sgl.Engine``) so that
memory and state never leak between variants, and writes one JSON record with the device, date,
commit and command next to its figures.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = str(ROOT / ".device/models/llama-3.1-8b")


def git_commit() -> str:
    """The checkout's commit; the GPU machine's copy has no .git, so runs pass REDKNOT_COMMIT."""
    if os.environ.get("REDKNOT_COMMIT"):
        return os.environ["REDKNOT_COMMIT"]
    proc = subprocess.run(
        ["git", "rev-parse", "HEAD"], check=False, capture_output=True, text=True, cwd=ROOT
    )
    return proc.stdout.strip() if proc.returncode == 0 else "unknown"


def event_ms(fn, reps: int) -> float:
    """Median milliseconds of ``fn`` on the GPU over ``reps`` CUDA-event timings, after one
    warm-up call."""
    import statistics

    import torch

    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def device_name() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def record(**figures) -> dict:
    return {
        "device": device_name(),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "command": " ".join([Path(sys.executable).name] + sys.argv),
        **figures,
    }


def write_json(path: str | Path, data: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(data, indent=1) + "\n")


def synthetic_map_file(model_dir: str, global_fraction: float, out_dir: str | Path) -> str:
    """Write a synthetic head map of ``global_fraction`` for the model at ``model_dir``."""
    from redknot.headmap import ModelShape, synthetic_map

    shape = ModelShape.from_hf_config(json.loads(Path(model_dir, "config.json").read_text()))
    path = Path(out_dir) / f"synthetic-g{global_fraction:.4f}.json"
    synthetic_map(shape, global_fraction, model_name=Path(model_dir).name).save(path)
    return str(path)


def engine_kwargs(model: str, context_length: int, **extra) -> dict:
    """Options every benchmark engine shares (dummy weights, token ids in, no grammar)."""
    kwargs = {
        "model_path": model,
        "load_format": "dummy",
        "skip_tokenizer_init": True,
        "grammar_backend": "none",
        "sampling_backend": "pytorch",
        "context_length": context_length,
        "random_seed": 0,
        "log_level": "warning",
    }
    kwargs.update(extra)
    return kwargs


def launch_server_warmup(engine) -> float:
    """Run the warm-up request ``launch_server`` sends once a server is up (SGLang's http_server:
    a short prompt, 8 new tokens), so that SGLang's first-use JIT builds are not counted in a
    measured request; returns its seconds."""
    t0 = time.perf_counter()
    engine.generate(input_ids=[10, 11, 12], sampling_params={"max_new_tokens": 8})
    return time.perf_counter() - t0


def forward_args(args, *names: str) -> list[str]:
    """``["--name", "value", ...]`` for the parsed options ``names`` (dashes in flags)."""
    out: list[str] = []
    for name in names:
        out += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    return out


def run_child(script: str, args: list[str], log_grep: str | tuple[str, ...] | None = None) -> dict:
    """Run ``script`` in a fresh process; it prints one JSON line prefixed by ``RESULT ``.

    Lines of the server log (the child's and its scheduler's output) containing ``log_grep``
    (or any of several) are returned under ``log_lines``.
    """
    proc = subprocess.run(
        [sys.executable, script, *args],
        check=False,
        capture_output=True,
        text=True,
        env=os.environ.copy(),
    )
    text = proc.stdout + proc.stderr
    greps = (log_grep,) if isinstance(log_grep, str) else (log_grep or ())
    log_lines = [x for x in text.splitlines() if any(g in x for g in greps)]
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT ") :])
            if log_grep:
                result["log_lines"] = log_lines
            return result
    failed = {"error": f"exit {proc.returncode}", "log_tail": text[-3000:],
              "error_lines": error_lines(text)}  # fmt: skip
    if log_grep:
        failed["log_lines"] = log_lines
    return failed


ERROR_MARKS = re.compile(r"Error|error:|Traceback|FAILED|build stopped|Killed|out of memory")


def error_lines(text: str, each_end: int = 20) -> list[str]:
    """The lines of a failed child's output that name an error (exception lines, a compiler's
    ``error:``, ``ninja: build stopped``, an out-of-memory), each after the line before it: the
    first ``each_end`` such lines and the last ``each_end``. A failure's cause is often far
    above the tail a crash leaves (a compile error before the engine's own traceback), so a
    failed run keeps both ends."""
    lines = text.splitlines()
    hits = [i for i, line in enumerate(lines) if ERROR_MARKS.search(line)]
    keep = set(hits[:each_end] + hits[-each_end:])
    rows = sorted({j for i in keep for j in (i - 1, i) if j >= 0})
    return [lines[j][:300] for j in rows]


def register_segments(engine, docs: list[list[int]], namespace: str) -> None:
    """Register each token list of ``docs`` as a segment of ``namespace`` on a redknot
    ``sgl.Engine`` (prefilled standalone, nothing generated)."""
    from redknot.api.marks import SegmentMark, encode_marks
    from redknot.segcache.entry import segment_id

    for doc in docs:
        mark = SegmentMark(0, len(doc), namespace, segment_id(namespace, doc))
        params = {"max_new_tokens": 0, "custom_params": encode_marks([mark], register=True,
                                                                     pin=False)}  # fmt: skip
        engine.generate(input_ids=doc, sampling_params=params)


def reusing_prompt(head: list[int], docs: list[list[int]], question: list[int],
                   namespace: str) -> tuple[list[int], list[dict]]:  # fmt: skip
    """``head``, every document of ``docs``, then ``question``, and the documents' spans as
    segments of ``namespace`` (a ``/generate`` request's ``redknot_segments``, docs/api.md)."""
    ids, spans = list(head), []
    for doc in docs:
        spans.append({"start": len(ids), "end": len(ids) + len(doc), "namespace": namespace})
        ids += doc
    return ids + list(question), spans


# Where a request's first token went, from the timestamps SGLang's --enable-metrics puts in
# meta_info (wall clock, this machine): phase -> (from, to); "sent" and "first_token" are the
# client's own.
PHASES = {
    "http_in": ("sent", "request_received_ts"),  # HTTP, redknot's /generate rewrite
    "api_dispatch": ("request_received_ts", "api_server_dispatch_finish_ts"),
    "to_forward": ("api_server_dispatch_finish_ts", "forward_entry_time"),  # IPC, scheduler
    "prefill": ("forward_entry_time", "prefill_finished_time"),  # the extend and its sample
    "out": ("prefill_finished_time", "first_token"),  # detokenizer, HTTP stream
}


def settle(last_answer: float, settle_ms: float) -> None:
    """Sleep until ``settle_ms`` after ``last_answer`` (``time.perf_counter``): a server works on
    for a few ms after it answers, and a prompt sent meanwhile waits for that, so TTFT scripts
    send every timed prompt the same gap after the answer before it."""
    wait = last_answer + settle_ms / 1e3 - time.perf_counter()
    if wait > 0:
        time.sleep(wait)


def phases_of(meta: dict, sent: float, ttft: float) -> dict[str, float] | None:
    """Seconds per phase of :data:`PHASES`; None without SGLang's timestamps."""
    at = dict(meta, sent=sent, first_token=sent + ttft)
    if not all(isinstance(at.get(k), (int, float)) for pair in PHASES.values() for k in pair):
        return None
    return {name: at[b] - at[a] for name, (a, b) in PHASES.items()}


def post(url: str, path: str, payload: dict | None = None) -> None:
    """``POST url+path`` with a JSON body (an empty one when None); the answer is dropped."""
    req = urllib.request.Request(
        url + path, data=json.dumps(payload or {}).encode(),
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    with urllib.request.urlopen(req, timeout=600) as resp:
        resp.read()
