#!/usr/bin/env bash
# LFPS over host memory: the concurrent 128K requests one H100 serves, offloaded against the
# dense flashinfer backend (issue 28), on a machine of two H100s and 256 GiB of host memory:
# GPU 0 runs the offloaded server (192 GiB of pinned host KV, prompts in one chunk); GPU 1 the
# flashinfer baseline, the offload GPU tests, then the offloaded server on chunked 32K prompts
# against LFPS in GPU memory (the host-prefix extend: same outputs, TTFT).
# Run from the carried tree on the GPU machine: bash benchmarks/lfps_capacity_x2.sh
set -u
OUT=${OUT:-./out}
eval "$(python3 benchmarks/gpu_run.py unpack --shell)" > /dev/null 2>&1
free -g | head -2
nvidia-smi --query-gpu=name,memory.total --format=csv
run() { python3 benchmarks/gpu_run.py "$@"; }
(
  export CUDA_VISIBLE_DEVICES=1 OUT=$OUT/gpu1
  mkdir -p "$OUT"
  run bench lfps_serve --mode capacity --capacity-requests 4 --mem-fraction-static 0 \
    --capacity-deadline 120 --variants dense --out "$OUT/capacity_dense.json"
  run tests tests/attention/test_host_extend.py tests/pool/test_host_offload.py \
    tests/kernels/test_lfps_build.py
  run bench lfps_serve --mode capacity --capacity-requests 3 --capacity-length 32000 \
    --variants "lfps,lfps-offload=redknot_lfps_offload_gb=12" --out "$OUT/offload_chunked.json"
) > "$OUT/gpu1.txt" 2>&1 &
export CUDA_VISIBLE_DEVICES=0 OUT=$OUT/gpu0
mkdir -p "$OUT"
# one 130K chunk needs activation memory SGLang's default fraction does not leave (it went
# negative): 0.6 of the GPU, of which the KV budget holds only LFPS's tables
run bench lfps_serve --mode capacity --capacity-requests 12 --mem-fraction-static 0.6 \
  --capacity-deadline ${DEADLINE:-240} \
  --variants "lfps-offload=redknot_lfps_offload_gb=192,chunked_prefill_size=131072,max_prefill_tokens=131072" \
  --out "$OUT/capacity_offload.json"
wait
tail -5 "$OUT/../gpu1.txt"
