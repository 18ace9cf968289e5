#!/usr/bin/env bash
# The split extend on the GPU, second pass: its GPU tests (split and gathered cases),
# benchmarks/extend_split.py, then the TTFT A/B of the reusing 32K prompt against the commit
# before the split (scripts/ttft_ab_gpu.sh; carry .devsrc_old.tar made from OLD_COMMIT).
#   after `source scripts/device_prelude.sh`: HEAD_COMMIT=.. OLD_COMMIT=.. bash scripts/extend_split_ab_gpu.sh
python3 -m pytest tests/kernels/test_extend.py -m gpu -k "split or gathered" -q -p no:cacheprovider \
  > "$OUT/gpu_tests.log" 2>&1
tail -2 "$OUT/gpu_tests.log"
python3 benchmarks/extend_split.py --commit "$HEAD_COMMIT" --out "$OUT/extend_split.json" \
  > "$OUT/extend_split.log" 2>&1
cut -c1-260 "$OUT/extend_split.log" | tail -10
cd "$ROOTDIR" && REPS=${REPS:-3} bash scripts/ttft_ab_gpu.sh
