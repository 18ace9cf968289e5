#!/usr/bin/env bash
# Where the time of a reusing prompt goes without the torch profiler: the redknot variant's TTFT
# plain, then again with scripts/diag_site's layer timeline (its summary and raw lines, plus the
# plain and the instrumented TTFT, under $OUT).
#   after `source scripts/device_prelude.sh`: bash scripts/host_timeline_gpu.sh
# VARIANT / POINTS / REPS override the variant, points and reps; SKIP_PLAIN=1 runs only the
# instrumented engine.
variant=${VARIANT:-redknot-g0.125-reuse-sparse-cached}; points=${POINTS:-32768x8}; reps=${REPS:-3}
rows=${MIN_ROWS:-30000}
if [ "${SKIP_PLAIN:-0}" != 1 ]; then
  python3 benchmarks/ttft.py --points $points --reps $reps --variants $variant \
    --out "$OUT/ttft_plain.json" > "$OUT/plain.log" 2>&1
fi
rm -rf /tmp/diag && mkdir -p /tmp/diag
REDKNOT_LAYER_TIMELINE=/tmp/diag/timeline.jsonl \
  REDKNOT_TIMELINE_MIN_ROWS=$rows PYTHONPATH="$PWD/scripts/diag_site:$PYTHONPATH" \
  python3 benchmarks/ttft.py --points $points --reps $reps --variants $variant \
    --out "$OUT/ttft_diag.json" > "$OUT/diag.log" 2>&1
python3 scripts/diag_site/layer_timeline_summary.py /tmp/diag/timeline.jsonl \
  --out "$OUT/layer_timeline.json" > /dev/null
tar -C /tmp/diag -czf "$OUT/diag_raw.tgz" .
grep -h '"ttft_s"' "$OUT"/ttft_*.json
python3 - "$OUT/layer_timeline.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print("forwards", d["forwards"], "host", d["total_host_ms"], "gpu", d["total_gpu_ms"])
for r in d["per_layer_median"]:
    print(r)
PY
