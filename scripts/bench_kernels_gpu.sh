#!/usr/bin/env bash
# SegPagedAttention on the GPU machine: the GPU kernel tests, then the kernel benchmark.
#
#   bash scripts/bench_kernels_gpu.sh [--commit SHA] [--tests-only | --bench-only] [-- BENCH_ARGS]
#
# Logs and the benchmark JSON go to $OUT (default: ./out). FlashInfer's JIT cache and Triton's
# cache live under ./build so that a warm machine reuses them.
set -uo pipefail

commit=unknown
run_tests=1
run_bench=1
while [[ $# -gt 0 ]]; do
    case "$1" in
        --commit) commit="$2"; shift 2 ;;
        --tests-only) run_bench=0; shift ;;
        --bench-only) run_tests=0; shift ;;
        --) shift; break ;;
        *) echo "unknown argument $1" >&2; exit 2 ;;
    esac
done

out="${OUT:-out}"
mkdir -p "$out" build
export FLASHINFER_WORKSPACE_BASE="$PWD/build"
export TRITON_CACHE_DIR="$PWD/build/triton-cache"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > "$out/gpu.txt" 2>&1

status=0
if [[ $run_tests == 1 ]]; then
    timeout "${TESTS_TIMEOUT_S:-300}" python3 -m pytest tests/kernels -m gpu -q -p no:cacheprovider \
        > "$out/kernel_tests.log" 2>&1
    rc=$?
    echo "kernel GPU tests: rc=$rc ($(tail -n 1 "$out/kernel_tests.log"))"
    [[ $rc == 0 ]] || status=1
fi
if [[ $run_bench == 1 ]]; then
    timeout "${BENCH_TIMEOUT_S:-420}" python3 benchmarks/segpaged_kernels.py \
        --out "$out/segpaged_kernels.json" --commit "$commit" "$@" > "$out/bench.log" 2>&1
    rc=$?
    echo "benchmark: rc=$rc"
    tail -n 30 "$out/bench.log"
    [[ $rc == 0 ]] || status=1
fi
exit $status
