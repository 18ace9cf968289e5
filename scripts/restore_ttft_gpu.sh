#!/usr/bin/env bash
# TTFT of segment reuse with adaptive restore off, probing only (threshold 1: nothing promoted)
# and promoting (threshold 0.1, one head per layer), side by side in one run (benchmarks/ttft.py,
# 8B shape, dummy weights, 8 cached segments + a 64-token question). Results under $OUT.
#   after `source scripts/device_prelude.sh`: bash scripts/restore_ttft_gpu.sh
#   (POINTS, REPS, NAME and VARIANTS from the environment)
base=redknot-g0.125-reuse-sparse-cached
variants="${VARIANTS:-$base,$base[restore_thresh=1.0],$base[restore_thresh=0.1]}"
python3 benchmarks/ttft.py --points "${POINTS:-32768x8}" --reps "${REPS:-3}" \
  --variants "$variants" --out "$OUT/${NAME:-ttft_restore}.json" > "$OUT/${NAME:-ttft_restore}.log" 2>&1
rc=$?
python3 - "$OUT/${NAME:-ttft_restore}.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for name, v in d["variants"].items():
    for key, p in v.get("points", {}).items():
        print(name, key, p.get("ttft_s"), p.get("ttft_samples_s"))
    print(name, "restored per prompt:", v.get("restored_heads_per_prompt"), v.get("error"))
PY
exit $rc
