#!/usr/bin/env bash
# The extend kernel's split keys on the GPU, in one call: its GPU tests and the startup check's
# (real shapes), benchmarks/extend_split.py, and the layer timeline of the reusing 32K prompt
# (scripts/host_timeline_gpu.sh, instrumented run only). Results under $OUT.
#   after `source scripts/device_prelude.sh`: bash scripts/extend_split_gpu.sh
python3 -m pytest tests/kernels/test_extend.py tests/attention/test_startup_check.py -m gpu -q \
  -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1
tail -3 "$OUT/gpu_tests.log"
python3 benchmarks/extend_split.py --commit "$REDKNOT_COMMIT" --out "$OUT/extend_split.json" \
  > "$OUT/extend_split.log" 2>&1
tail -12 "$OUT/extend_split.log"
SKIP_PLAIN=1 bash scripts/host_timeline_gpu.sh
