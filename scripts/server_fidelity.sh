#!/usr/bin/env bash
# Segment-reuse fidelity against running servers with real weights (SmolLM2-135M-Instruct):
# redknot servers, one per spec and one after the other, each against one flashinfer server of
# the same model, `python -m redknot.eval fidelity --backend server` over the case set, results
# under $OUT as fidelity_server_<name>.json.
# The checkpoint must be at /tmp/smol-hf first: ../shared/device/smollm2-pieces.sh here, then the
# pieces' three runs on the GPU machine (README beside that script); run 3 calls this script
# after the bundle unpack line and `python3 /tmp/smol/to_hf.py`.
# Usage: SPECS="name:policy[:server flags];..." bash scripts/server_fidelity.sh [--limit N] [...]
#   policy redknot serves the shipped profiled map, any other --redknot-policy every head
#   global (no map); the server flags give its knobs, e.g. "epic64:epic:--redknot-epic-k 64".
#   Default SPECS: redknot. (The results of commit ccb5f14 also have the hybrid
#   redknot+sparseq, served then with the map and --redknot-sparseq-boundary 8.)
# DEADLINE_S: no spec starts after this many seconds (a device call has 600); the specs that
# finished keep their files.
set -uo pipefail
out="${OUT:-/tmp}"
model="${MODEL:-/tmp/smol-hf}"
map="${HEAD_MAP:-configs/heads/smollm2-135m-instruct.json}"
common=(--model-path "$model" --context-length 8192 --mem-fraction-static 0.3
        --disable-prefill-cuda-graph --cuda-graph-max-bs-decode 4 --random-seed 0)
started=$SECONDS

# One after the other: a server sizes its KV cache from the memory free when it starts.
# A cold machine compiles FlashInfer's and Triton's head_dim-64 kernels at startup (minutes).
wait_healthy() {  # port pid log
  for _ in $(seq 1 "${STARTUP_S:-600}"); do
    curl -sf "http://127.0.0.1:$1/health" >/dev/null 2>&1 && return 0
    kill -0 "$2" 2>/dev/null || { echo "the server on port $1 exited during startup"; tail -n 30 "$3"; return 1; }
    sleep 1
  done
  echo "the server on port $1 did not answer in ${STARTUP_S:-600} s"; return 1
}
stop() {  # pid: stop a server and wait until its port is free again
  kill "$1" 2>/dev/null; wait "$1" 2>/dev/null
  for _ in $(seq 1 30); do curl -sf http://127.0.0.1:30000/health >/dev/null 2>&1 || return 0; sleep 1; done
}
python3 -m sglang.launch_server "${common[@]}" --port 30001 --attention-backend flashinfer \
  > "$out/server_dense.log" 2>&1 &
dense=$!
trap 'kill $dense ${redknot:-} 2>/dev/null; wait 2>/dev/null' EXIT
wait_healthy 30001 "$dense" "$out/server_dense.log" || exit 1
echo "dense server up after $((SECONDS - started)) s"

rc=0
IFS=';' read -r -a specs <<< "${SPECS:-redknot:redknot}"
for spec in "${specs[@]}"; do
  IFS=':' read -r name policy flags <<< "$spec"
  if [ -n "${DEADLINE_S:-}" ] && [ $((SECONDS - started)) -ge "$DEADLINE_S" ]; then
    echo "deadline: $name not started"; rc=1; continue
  fi
  case "$policy" in
    redknot) recovery=(--redknot-head-map "$map" --redknot-policy "$policy") ;;
    *) recovery=(--redknot-policy "$policy") ;;
  esac
  log="$out/server_$name.log"
  # shellcheck disable=SC2086  # the spec's flags are words
  python3 -m sglang.launch_server "${common[@]}" --port 30000 --attention-backend redknot \
    "${recovery[@]}" --redknot-segment-fraction 0.3 $flags > "$log" 2>&1 &
  redknot=$!
  if wait_healthy 30000 "$redknot" "$log"; then
    echo "$name: server up after $((SECONDS - started)) s"
    grep -h "redknot" "$log" | head -5
    python3 -m redknot.eval fidelity --backend server --cases benchmarks/cases/rag_v1.jsonl \
      --server http://127.0.0.1:30000 --reference-server http://127.0.0.1:30001 \
      --policies "full,$policy" --out "$out/fidelity_server_$name.json" "$@" || rc=1
    echo "$name: done after $((SECONDS - started)) s"
  else
    rc=1
  fi
  stop "$redknot"
done
exit $rc
