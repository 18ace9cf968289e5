#!/usr/bin/env bash
# Segment reuse with cached against fresh local K/V (--redknot-local-kv) in the server, side by
# side with flashinfer: TTFT of the 32K prompt of 8 cached segments (benchmarks/ttft.py).
#   after `source scripts/device_prelude.sh`: bash scripts/local_kv_gpu.sh   (results under $OUT;
#   POINTS=8192x8,65536x8 REPS=2 NAME=ttft_local_kv_8k_64k for other lengths)
python3 benchmarks/ttft.py --points ${POINTS:-32768x8} --reps ${REPS:-3} \
  --variants "flashinfer,redknot-g0.125-reuse-sparse-cached,redknot-g0.125-reuse-sparse-cached[local_kv=fresh]" \
  --out "$OUT/${NAME:-ttft_local_kv}.json" > "$OUT/${NAME:-ttft_local_kv}.log" 2>&1
python3 - "$OUT/${NAME:-ttft_local_kv}.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for name, v in d["variants"].items():
    for key, p in v["points"].items():
        print(name, key, p["ttft_s"], p.get("ttft_samples_s"))
print(json.dumps(d.get("summary"), indent=1)[:3000])
PY
