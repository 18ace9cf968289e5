"""Diagnostics for every Python process of a server (scheduler included): put this directory
first on PYTHONPATH and set either variable.

- ``REDKNOT_TRITON_HOOK_LOG=FILE``: one JSON line per Triton JIT specialisation the process
  compiles or loads from the disk cache: wall time, pid, kernel, its specialisation data
  (argument types, constants, alignment attributes).
- ``REDKNOT_STACK_SAMPLE_LOG=FILE``: every 0.5 s, the main thread's innermost frames as one JSON
  line (wall time, pid, frames): what a process does during a long pause the profiler does not
  see (pure Python, compiles).

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
