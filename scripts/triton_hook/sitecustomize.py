"""Diagnostic: log every Triton JIT specialisation a process compiles (or loads from the disk
cache) as one JSON line in ``$REDKNOT_TRITON_HOOK_LOG``: wall time, pid, kernel, and the
signature repr (argument types and specialisations). Put this directory first on PYTHONPATH so
that every Python process of a server (scheduler included) imports it:

    REDKNOT_TRITON_HOOK_LOG=/tmp/hook.jsonl PYTHONPATH=scripts/triton_hook:$PYTHONPATH python ...
"""

import json
import os
import time

_PATH = os.environ.get("REDKNOT_TRITON_HOOK_LOG")
if _PATH:
    try:
        import triton

        def _log(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
            with open(_PATH, "a") as f:
                f.write(json.dumps({"t": time.time(), "pid": os.getpid(), "kernel": fn.name,
                                    "repr": repr}) + "\n")  # fmt: skip
            # returns None: Triton compiles as usual

        triton.knobs.runtime.jit_cache_hook = _log
    except (ImportError, AttributeError) as e:  # never stop the process it watches
        print(f"triton hook not installed: {e}")
