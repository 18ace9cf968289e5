#!/usr/bin/env bash
# benchmarks/ttft.py once per variant, each into its own file (a call cut short by the device's
# time limit keeps the variants that finished); merge them afterwards with
#   python benchmarks/ttft.py --merge A.json,B.json --out benchmarks/results/NAME.json
# Run from the pristine copy of scripts/device_prelude.sh.
#   OUT=/tmp/o POINTS=32768x8 REPS=2 VARIANTS="flashinfer;cacheblend" bash scripts/ttft_variants_gpu.sh
# VARIANTS is ';'-separated (a variant's knobs may hold commas).
set -uo pipefail
out="${OUT:-/tmp/redknot-ttft}"
mkdir -p "$out"
rc=0
IFS=';' read -ra variants <<< "${VARIANTS:-flashinfer;redknot-g0.125-reuse-sparse-cached}"
for v in "${variants[@]}"; do
  name=$(echo "$v" | tr -c 'A-Za-z0-9.-' '_')  # the device returns plain names only
  echo "== $v ($(date +%T))"
  python3 benchmarks/ttft.py --points "${POINTS:-32768x8,65536x8}" --reps "${REPS:-3}" \
    --variants "$v" --out "$out/ttft_$name.json" 2>&1 | tail -n 12 || rc=1
done
exit $rc
