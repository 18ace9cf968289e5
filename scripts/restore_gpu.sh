#!/usr/bin/env bash
# Adaptive restore on the GPU machine: its GPU tests (the restore kernels at the 8B shape, the
# startup check with restore columns), then scripts/restore_check.py (the exact limit and a
# served setting in SGLang engines). Results and logs under $OUT.
#   after `source scripts/device_prelude.sh`: bash scripts/restore_gpu.sh   (SKIP_TESTS=1 to skip)
set -uo pipefail
rc=0
if [ -z "${SKIP_TESTS:-}" ]; then
  python3 -m pytest tests -m gpu -q -p no:cacheprovider -k "promoted or restore" 2>&1 \
    | tail -20 | tee "$OUT/restore_gpu_tests.log"
  rc=${PIPESTATUS[0]}
fi
python3 scripts/restore_check.py --variants "${VARIANTS:-dense,restore-all,reuse,restore}" --out "$OUT/restore_check.json" > "$OUT/restore_check.log" 2>&1
[ $? -ne 0 ] && rc=1
tail -c 3000 "$OUT/restore_check.log"
exit $rc
