#!/usr/bin/env bash
# The head's split defaults in the server, in one short call: the reusing 32K prompt's TTFT
# (benchmarks/ttft.py, redknot only) and the follow-up turn (benchmarks/followup_ttft.py,
# redknot only). Results under $OUT.
#   after `source scripts/device_prelude.sh`: bash scripts/split_final_gpu.sh
python3 benchmarks/ttft.py --points 32768x8 --reps 3 --variants redknot-g0.125-reuse-sparse-cached \
  --out "$OUT/ttft_head.json" > "$OUT/ttft_head.log" 2>&1
grep -h '"ttft_s"' -A4 "$OUT/ttft_head.json" | head -6
python3 benchmarks/followup_ttft.py --variants redknot-g0.125 --reps 3 \
  --out "$OUT/followup_head.json" > "$OUT/followup_head.log" 2>&1
grep -h "^redknot" "$OUT/followup_head.log" | cut -c1-300
