#!/usr/bin/env bash
# Time to first token of segment reuse on the GPU machine, with a profile, in one call:
#   1. the GPU tests of the kernels the reuse schedule runs on (gathered extend rows, key mass,
#      RoPE alignment with head maps, the 32K prefill), unless SKIP_TESTS=1;
#   2. benchmarks/ttft.py at POINTS for VARIANTS (flashinfer in the same run: side by side);
#   3. one more prompt of PROFILE_VARIANT under the torch profiler at each point, summarised by
#      benchmarks/profile_summary.py (PROFILE_VARIANT= turns it off); the trace of TRACE_POINT
#      (default 32768x8) is kept.
# Run from the pristine copy of scripts/device_prelude.sh. Writes $OUT/ttft.json,
# $OUT/profile_<point>.json and $OUT/gpu_kernel_tests.log.
#   OUT=/tmp/o REDKNOT_COMMIT=abc bash scripts/ttft_gpu.sh
set -uo pipefail
out="${OUT:-/tmp/redknot-ttft}"
mkdir -p "$out"
points="${POINTS:-32768x8,65536x8}"
variants="${VARIANTS:-flashinfer,redknot-g0.125-reuse-sparse-cached}"
profiled="${PROFILE_VARIANT-redknot-g0.125-reuse-sparse-cached}"
rc=0
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout "${TESTS_TIMEOUT_S:-240}" python3 -m pytest tests/kernels -m gpu -q -p no:cacheprovider \
    -k "${TESTS_K:-gathered or key_mass or rope_align or prefill_32k}" \
    > "$out/gpu_kernel_tests.log" 2>&1 || rc=1
  echo "kernel GPU tests: $(tail -n 1 "$out/gpu_kernel_tests.log")"
fi
prof=()
[ -n "$profiled" ] && prof=(--profile-dir /tmp/redknot-prof --profile-variants "$profiled")
python3 benchmarks/ttft.py --points "$points" --reps "${REPS:-3}" --variants "$variants" \
  "${prof[@]}" --out "$out/ttft.json" 2>&1 | tail -n 40 || rc=1
if [ -n "$profiled" ]; then
  for point in ${points//,/ }; do
    trace=$(ls /tmp/redknot-prof/"$profiled-$point"/*.trace.json.gz 2>/dev/null | head -n 1)
    [ -n "$trace" ] || { echo "no trace for $point"; rc=1; continue; }
    python3 benchmarks/profile_summary.py "$trace" --top 25 --out "$out/profile_$point.json" \
      > /dev/null || rc=1
    [ "$point" = "${TRACE_POINT:-32768x8}" ] && cp "$trace" "$out/trace_$point.json.gz"
    python3 - "$out/profile_$point.json" <<'PY'
import json, sys
t = next(iter(json.load(open(sys.argv[1]))["traces"].values()))
print(sys.argv[1], {k: t[k] for k in ("span_ms", "gpu_busy_ms", "gpu_idle_ms")})
for name, r in sorted(t["ranges"].items()):
    print(f"  {name:42s} n={r['count']:3d} host={r['host_ms']:8.1f} span={r['gpu_span_ms']:8.1f} "
          f"kern={r['gpu_kernel_ms']:8.1f}")
PY
  done
fi
exit $rc
