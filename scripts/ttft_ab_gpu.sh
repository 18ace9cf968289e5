#!/usr/bin/env bash
# A/B of the TTFT of segment reuse at two commits on one GPU machine, in one call: the committed
# head (.devsrc.tar) and an older commit (.devsrc_old.tar, made by
# `git archive OLD -o .devsrc_old.tar`), 32768x8, 4 reps each, each under its own redknot and
# the head's benchmarks/ttft.py (same harness).
#   HEAD_COMMIT=abc OLD_COMMIT=def bash scripts/ttft_ab_gpu.sh   (carry .device, both archives)
# POINTS / REPS override the points and reps; EXTRA adds options of ttft.py to both runs (e.g.
# EXTRA=--compile-log: the Triton kernels each engine compiles at startup and in its first prompt).
# ORDER=old-first runs the older commit first (the default runs the head first: run both orders
# to tell a code difference from a drift of the machine); PROFILE=1 profiles one more prompt of
# the head after its timed ones (trace and summary under $OUT).
ROOTDIR=$PWD; source scripts/device_prelude.sh
mkdir -p /tmp/src_old && tar -C /tmp/src_old -xf "$ROOTDIR/.devsrc_old.tar" && ln -sfn /tmp/src/.device /tmp/src_old/.device
variant=redknot-g0.125-reuse-sparse-cached
points=${POINTS:-32768x8}; reps=${REPS:-4}
run_head() {
  cd /tmp/src && export PYTHONPATH=/tmp/site:/tmp/src REDKNOT_COMMIT=${HEAD_COMMIT}
  python3 -m pip install -q --upgrade --no-deps --no-build-isolation --no-index --target /tmp/site . >/dev/null 2>&1
  prof=(); [ "${PROFILE:-0}" = 1 ] && prof=(--profile-dir /tmp/prof)
  python3 benchmarks/ttft.py --points $points --reps $reps --variants $variant "${prof[@]}" $EXTRA \
    --out "$OUT/ttft_ab_head.json" > "$OUT/ab_head.log" 2>&1
  if [ "${PROFILE:-0}" = 1 ]; then
    t=$(ls /tmp/prof/*/*.trace.json.gz | head -1)
    python3 benchmarks/profile_summary.py "$t" --top 25 --out "$OUT/profile_head.json" > /dev/null 2>&1
    cp "$t" "$OUT/trace_head.json.gz"
  fi
}
run_old() {
  cd /tmp/src_old && export PYTHONPATH=/tmp/site:/tmp/src_old REDKNOT_COMMIT=${OLD_COMMIT}
  python3 -m pip install -q --upgrade --no-deps --no-build-isolation --no-index --target /tmp/site . >/dev/null 2>&1
  python3 /tmp/src/benchmarks/ttft.py --points $points --reps $reps --variants $variant $EXTRA \
    --out "$OUT/ttft_ab_old.json" > "$OUT/ab_old.log" 2>&1
}
if [ "${ORDER:-head-first}" = old-first ]; then run_old; run_head; else run_head; run_old; fi
grep -h '"ttft_s"\|samples' -A5 "$OUT/ttft_ab_head.json" "$OUT/ttft_ab_old.json" | grep -v flops | head -30
