"""Diagnostics for every Python process of a server (scheduler included): put this directory
first on PYTHONPATH and set either variable.

- ``REDKNOT_TRITON_HOOK_LOG=FILE``: one JSON line per Triton JIT specialisation the process
  compiles or loads from the disk cache: wall time, pid, kernel, its specialisation data
  (argument types, constants, alignment attributes).
- ``REDKNOT_STACK_SAMPLE_LOG=FILE``: every 0.5 s, the main thread's innermost frames as one JSON
  line (wall time, pid, frames): what a process does during a long pause the profiler does not
  see (pure Python, compiles).
- ``REDKNOT_LAYER_TIMELINE=FILE``: for every extend of at least ``REDKNOT_TIMELINE_MIN_ROWS``
  (default 8192) rows, a CUDA event and a host clock reading at each decoder layer's start and
  at each ``redknot.attention.trace.phase`` boundary, one JSON line per forward (summary:
  ``layer_timeline_summary.py``); the forward's end waits for the GPU once.

    REDKNOT_TRITON_HOOK_LOG=/tmp/hook.jsonl PYTHONPATH=scripts/diag_site:$PYTHONPATH python ...
"""

import json
import os
import sys
import threading
import time

_HOOK = os.environ.get("REDKNOT_TRITON_HOOK_LOG")
_STACKS = os.environ.get("REDKNOT_STACK_SAMPLE_LOG")


def _append(path: str, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps({"t": time.time(), "pid": os.getpid(), **record}) + "\n")


if _HOOK:
    try:
        import triton

        def _log(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
            _append(_HOOK, {"kernel": fn.name, "spec": compile.get("specialization_data")})
            # returns None: Triton compiles as usual

        triton.knobs.runtime.jit_cache_hook = _log
    except (ImportError, AttributeError) as e:  # never stop the process it watches
        print(f"triton hook not installed: {e}")

if _STACKS:
    _main = threading.main_thread().ident

    def _sample() -> None:
        while True:
            time.sleep(0.5)
            frame = sys._current_frames().get(_main)
            frames = []
            while frame is not None and len(frames) < 25:
                code = frame.f_code
                frames.append(f"{code.co_filename}:{frame.f_lineno} {code.co_name}")
                frame = frame.f_back
            _append(_STACKS, {"argv0": sys.argv[0][-40:], "frames": frames})

    threading.Thread(target=_sample, daemon=True, name="redknot-stack-sampler").start()


_TIMELINE = os.environ.get("REDKNOT_LAYER_TIMELINE")
if _TIMELINE:
    try:
        import redknot.attention.trace as _trace

        _min_rows = int(os.environ.get("REDKNOT_TIMELINE_MIN_ROWS", "8192"))
        _state = {"marks": None}
        _plain_phase = _trace.phase

        def _mark(name: str, kind: str) -> None:
            import torch

            event = torch.cuda.Event(enable_timing=True)
            event.record()
            _state["marks"].append((name, kind, time.perf_counter(), event))

        class _Timed:
            def __init__(self, name: str):
                self.name = name

            def __enter__(self):
                _mark(self.name, "enter")

            def __exit__(self, *exc):
                _mark(self.name, "exit")
                return False

        def _phase(name: str):
            return _Timed(name) if _state["marks"] is not None else _plain_phase(name)

        _trace.phase = _phase  # before the modules that import it by name
        import redknot.attention.ffn_schedule as _fs

        _plain_layer = _fs.around_decoder_layer

        def _timed_layer(original, self, positions, hidden_states, forward_batch, residual):
            import torch

            lid = _fs._layer_id(self)
            if lid == 0:
                big = forward_batch.forward_mode.is_extend() and hidden_states.shape[0] >= _min_rows
                _state["marks"] = [] if big else None
            if _state["marks"] is None:
                return _plain_layer(
                    original, self, positions, hidden_states, forward_batch, residual
                )
            _mark(f"layer{lid}", "start")
            out = _plain_layer(original, self, positions, hidden_states, forward_batch, residual)
            if lid == _fs.SCHEDULE.last_layer:
                _mark("end", "end")
                marks, _state["marks"] = _state["marks"], None
                torch.cuda.synchronize()
                h0, e0 = marks[0][2], marks[0][3]
                rows = [
                    (n, k, round((h - h0) * 1000, 4), round(e0.elapsed_time(e), 4))
                    for n, k, h, e in marks
                ]
                _append(_TIMELINE, {"rows": hidden_states.shape[0], "marks": rows})
            return out

        _fs.around_decoder_layer = _timed_layer
    except Exception as e:  # noqa: BLE001 - never stop the process it watches
        print(f"layer timeline not installed: {e}")
