"""GPU smoke of the request API against a real server (not collected by pytest).

Starts ``python -m sglang.launch_server --attention-backend redknot`` on the Llama-3.1-8B shape
with dummy weights and the synthetic 1/8-global map (``HEAD_MAP=all-global`` for every head
global, where segments keep nothing) (``--skip-tokenizer-init``: token spans only), then exercises ``/generate``
markup, a 400 and recovery, and the ``/redknot`` endpoints through the real launcher, IPC and
scheduler. Writes ``$OUT/api_smoke.json`` and the server log. On the GPU machine, after the
bundle unpack line: ``python3 tests/api/gpu_smoke.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

PORT = int(os.environ.get("PORT", "30000"))
OUT = os.environ.get("OUT", "/tmp")
URL = f"http://127.0.0.1:{PORT}"


def call(method: str, path: str, body: object | None = None) -> tuple[int, object]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        URL + path, data=data, method=method, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def wait_healthy(server: subprocess.Popen, seconds: int) -> bool:
    """Wait until the server answers /health (``False``: it exited; after ``seconds`` the
    requests go ahead and fail on their own)."""
    for _ in range(seconds):
        if server.poll() is not None:
            print("server exited during startup")
            return False
        try:
            if call("GET", "/health")[0] == 200:
                return True
        except OSError:
            pass
        time.sleep(1)
    return True


def stop(server: subprocess.Popen) -> None:
    server.terminate()
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.kill()


def write(results: dict, name: str) -> None:
    with open(os.path.join(OUT, name), "w") as f:
        json.dump(results, f, indent=1, default=str)


def main() -> int:
    model = os.environ.get("MODEL", ".device/models/llama-3.1-8b")
    argv = [sys.executable, "-m", "sglang.launch_server", "--model-path", model]
    argv += ["--load-format", "dummy", "--skip-tokenizer-init", "--grammar-backend", "none"]
    argv += ["--sampling-backend", "pytorch", "--context-length", "8192", "--port", str(PORT)]
    argv += ["--disable-prefill-cuda-graph", "--cuda-graph-max-bs-decode", "4"]
    head_map = os.environ.get("HEAD_MAP", "configs/heads/synthetic/llama-3.1-8b-g0.125.json")
    argv += ["--attention-backend", "redknot"]
    argv += (
        ["--redknot-all-global"] if head_map == "all-global" else ["--redknot-head-map", head_map]
    )
    argv += ["--redknot-namespaces", "kb"]
    with open(os.path.join(OUT, "api_smoke_server.log"), "w") as log:
        server = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    results: dict[str, object] = {}
    try:
        if not wait_healthy(server, 400):
            return 1
        ids = list(range(1000, 1400))
        gen = {"input_ids": ids, "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
        results["generate_marked"] = call(
            "POST",
            "/generate",
            gen | {"redknot_segments": [{"start": 10, "end": 200, "namespace": "kb"}]},
        )
        results["generate_overlap"] = call(
            "POST",
            "/generate",
            gen | {"redknot_segments": [{"start": 0, "end": 50}, {"start": 40, "end": 60}]},
        )
        results["generate_unknown_ns"] = call(
            "POST",
            "/generate",
            gen | {"redknot_segments": [{"start": 0, "end": 5, "namespace": "x"}]},
        )
        results["generate_after_errors"] = call("POST", "/generate", gen)
        reg = call(
            "POST", "/redknot/segments", {"namespace": "kb", "input_ids": ids[10:200], "pin": True}
        )
        results["register"] = reg
        results["register_again"] = call(
            "POST", "/redknot/segments", {"namespace": "kb", "input_ids": ids[10:200]}
        )
        moved = [5] * 37 + ids[10:200] + [9] * 20  # the segment at another position
        results["generate_reusing"] = call(
            "POST",
            "/generate",
            {"input_ids": moved, "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
            | {"redknot_segments": [{"start": 37, "end": 227, "namespace": "kb"}]},
        )
        results["list"] = call("GET", "/redknot/segments?namespace=kb")
        results["stats"] = call("GET", "/redknot/stats")
        sid = reg[1].get("segment_id") if isinstance(reg[1], dict) else "none"
        results["delete"] = call("DELETE", f"/redknot/segments/{sid}?namespace=kb")
        results["delete_again"] = call("DELETE", f"/redknot/segments/{sid}?namespace=kb")
        info = call("GET", "/server_info")[1]
        states = info.get("internal_states", []) if isinstance(info, dict) else []
        results["server_info_redknot_segments"] = [s.get("redknot_segments") for s in states]
    finally:
        stop(server)
    write(results, "api_smoke.json")
    for k, v in results.items():
        print(k, json.dumps(v, default=str)[:400])
    return 0


if __name__ == "__main__":
    sys.exit(main())
