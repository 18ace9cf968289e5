#!/usr/bin/env bash
# Segment-reuse fidelity against running servers with real weights (SmolLM2-135M-Instruct):
# a redknot server with the shipped profiled map against a flashinfer server of the same model,
# `python -m redknot.eval fidelity --backend server` over the case set, results under $OUT.
# The checkpoint must be at /tmp/smol-hf first: ../shared/device/smollm2-pieces.sh here, then the
# pieces' three runs on the GPU machine (README beside that script); run 3 calls this script
# after the bundle unpack line and `python3 /tmp/smol/to_hf.py`.
# Usage: bash scripts/server_fidelity.sh [--limit N] [more redknot.eval flags]
# POLICY=naive|epic|cacheblend|sparsex serves that token-level policy (every head global, no map),
# POLICY=redknot+sparseq the hybrid under the map (the shipped SmolLM2 map has its first global
# head in layer 7: add --redknot-sparseq-boundary 8), and scores it as such; REDKNOT_FLAGS adds
# server options (e.g. --redknot-blend-ratio 0.3).
set -uo pipefail
out="${OUT:-/tmp}"
model="${MODEL:-/tmp/smol-hf}"
map="${HEAD_MAP:-configs/heads/smollm2-135m-instruct.json}"
common=(--model-path "$model" --context-length 8192 --mem-fraction-static 0.3
        --disable-prefill-cuda-graph --cuda-graph-max-bs-decode 4 --random-seed 0)

# One after the other: a server sizes its KV cache from the memory free when it starts.
# A cold machine compiles FlashInfer's and Triton's head_dim-64 kernels at startup (minutes).
wait_healthy() {  # port pid log
  for _ in $(seq 1 "${STARTUP_S:-600}"); do
    curl -sf "http://127.0.0.1:$1/health" >/dev/null 2>&1 && return 0
    kill -0 "$2" 2>/dev/null || { echo "the server on port $1 exited during startup"; tail -n 30 "$3"; exit 1; }
    sleep 1
  done
  echo "the server on port $1 did not answer in ${STARTUP_S:-600} s"; exit 1
}
python3 -m sglang.launch_server "${common[@]}" --port 30001 --attention-backend flashinfer \
  > "$out/server_dense.log" 2>&1 &
dense=$!
trap 'kill $dense ${redknot:-} 2>/dev/null; wait 2>/dev/null' EXIT
wait_healthy 30001 "$dense" "$out/server_dense.log"
policy="${POLICY:-redknot}"
case "$policy" in
  redknot) recovery=(--redknot-head-map "$map") ;;
  redknot+sparseq) recovery=(--redknot-head-map "$map" --redknot-policy "$policy") ;;
  *) recovery=(--redknot-policy "$policy") ;;
esac
python3 -m sglang.launch_server "${common[@]}" --port 30000 --attention-backend redknot \
  "${recovery[@]}" --redknot-segment-fraction 0.3 ${REDKNOT_FLAGS:-} \
  > "$out/server_redknot.log" 2>&1 &
redknot=$!
wait_healthy 30000 "$redknot" "$out/server_redknot.log"
grep -h "redknot" "$out/server_redknot.log" | head -10
python3 -m redknot.eval fidelity --backend server --cases benchmarks/cases/rag_v1.jsonl \
  --server http://127.0.0.1:30000 --reference-server http://127.0.0.1:30001 \
  --policies "full,$policy" --out "$out/fidelity_server.json" "$@"
