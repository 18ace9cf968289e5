#!/usr/bin/env bash
# Every GPU check of redknot in one command, for the GPU machine:
#   1. the GPU-marked tests (kernels at real shapes, CUDA-graph capture),
#   2. the end-to-end greedy equivalence of `--attention-backend redknot` (every head global,
#      dense dispatch and redknot's own kernels) with `--attention-backend flashinfer`, plus a
#      served 1/8-global map,
#   3. the same greedy tokens with SGLang's default prefill CUDA graph as without it, for plain
#      prompts and prompts that reuse segments under the layer schedule
#      (scripts/prefill_graph_check.py).
# On the shared GPU machine, first unpack the SGLang bundle (../shared/device/README.md).
# Usage: bash scripts/gpu_check.sh   (SKIP_TESTS=1, SKIP_E2E=1 or SKIP_GRAPH=1 to skip a part)
set -uo pipefail
out="${OUT:-/tmp/redknot-gpu-check}"
mkdir -p "$out"
rc=0
if [ -z "${SKIP_TESTS:-}" ]; then
  python3 -m pytest tests -m gpu -q -p no:cacheprovider -x 2>&1 | tee "$out/gpu_tests.log"
  rc=${PIPESTATUS[0]}
fi
if [ -z "${SKIP_E2E:-}" ]; then
  python3 scripts/e2e_equivalence.py --variants flashinfer,redknot,redknot-triton \
    --head-map synthetic:0.125 --disable-prefill-cuda-graph --out "$out/e2e_equivalence.json" \
    2>&1 | tail -80
  [ "${PIPESTATUS[0]}" -ne 0 ] && rc=1
fi
if [ -z "${SKIP_GRAPH:-}" ]; then
  python3 scripts/prefill_graph_check.py --out "$out/prefill_graph_check.json" 2>&1 | tail -20
  [ "${PIPESTATUS[0]}" -ne 0 ] && rc=1
fi
exit $rc
