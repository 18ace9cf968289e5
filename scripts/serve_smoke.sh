#!/usr/bin/env bash
# Starts `python -m sglang.launch_server --attention-backend redknot` on the 8B shape with dummy
# weights, waits until it answers, sends one /generate request, and stops it.
# Usage (GPU machine, after the bundle unpack line): bash scripts/serve_smoke.sh [extra server flags]
set -uo pipefail
out="${OUT:-/tmp}"
model="${MODEL:-.device/models/llama-3.1-8b}"
port="${PORT:-30000}"
python3 -m sglang.launch_server --model-path "$model" --load-format dummy --skip-tokenizer-init \
  --grammar-backend none --sampling-backend pytorch --context-length 32768 --port "$port" \
  --disable-prefill-cuda-graph --cuda-graph-max-bs-decode 8 --attention-backend redknot "$@" \
  > "$out/serve_smoke.log" 2>&1 &
pid=$!
for _ in $(seq 1 300); do
  curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1 && break
  kill -0 "$pid" 2>/dev/null || { echo "server exited during startup"; tail -40 "$out/serve_smoke.log"; exit 1; }
  sleep 1
done
python3 - "$port" <<'PY'
import json, sys, urllib.request
ids = list(range(1000, 1000 + 3000))
req = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 16}}
r = urllib.request.urlopen(urllib.request.Request(
    f"http://127.0.0.1:{sys.argv[1]}/generate", data=json.dumps(req).encode(),
    headers={"Content-Type": "application/json"}), timeout=300)
body = json.loads(r.read())
print("generate answered:", {k: body[k] for k in ("output_ids",) if k in body},
      body.get("meta_info", {}).get("finish_reason"))
PY
rc=$?
grep -E "redknot" "$out/serve_smoke.log" | head -20
kill "$pid"; wait "$pid" 2>/dev/null
exit $rc
