#!/usr/bin/env bash
# The recovery policies side by side on the GPU machine, in one command per part:
#   ttft      TTFT at 32K (8 cached segments, 8B shape, dummy weights) of flashinfer, redknot's
#             full layer schedule and the token-level policies -> $OUT/ttft_policies.json
#   fidelity  the served policies against a dense server with SmolLM2's real weights (the
#             checkpoint at /tmp/smol-hf, see scripts/server_fidelity.sh), each scored as its
#             policy -> $OUT/fidelity_server_<name>.json (compare with the reference path
#             case by case with benchmarks/fidelity_agreement.py)
# A cold machine starts each engine in 1-2 minutes: split the parts over calls of 600 s
# (PART=ttft VARIANTS=... or PART=fidelity SPECS=..., see scripts/server_fidelity.sh). The first
# SmolLM2 server on a cold machine compiled for more than 300 s (H100): give the first fidelity
# call few specs and a DEADLINE_S; later servers on the same warm machine start in about 40 s,
# and one policy's 12 cases take about 20 s.
# Usage: PART=ttft|fidelity bash scripts/policies_gpu.sh
set -uo pipefail
out="${OUT:-/tmp}"
case "${PART:-ttft}" in
  ttft)
    variants="${VARIANTS:-flashinfer,redknot-g0.125-reuse-sparse-cached,naive,epic,cacheblend,sparsex}"
    python3 benchmarks/ttft.py --points "${POINTS:-32768x8}" --reps "${REPS:-2}" \
      --variants "$variants" --out "$out/ttft_policies.json"
    ;;
  fidelity)
    # one dense server, then one redknot server per spec (name:policy[:flags])
    SPECS="${SPECS:-redknot:redknot;cacheblend:cacheblend;epic:epic;sparsex:sparsex;naive:naive}" \
      OUT="$out" bash scripts/server_fidelity.sh --limit "${LIMIT:-24}"
    ;;
  *) echo "PART must be ttft or fidelity"; exit 2 ;;
esac
