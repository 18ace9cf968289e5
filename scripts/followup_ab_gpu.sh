#!/usr/bin/env bash
# TTFT of a follow-up turn over a cached history (benchmarks/followup_ttft.py) on one GPU: the
# head (flashinfer and redknot) and an older commit (redknot only; .devsrc_old.tar made by
# `git archive OLD -o .devsrc_old.tar`), each under the head's script. Results under $OUT.
#   HEAD_COMMIT=abc OLD_COMMIT=def bash scripts/followup_ab_gpu.sh   (carry .device, both archives)
ROOTDIR=$PWD; source scripts/device_prelude.sh
mkdir -p /tmp/src_old && tar -C /tmp/src_old -xf "$ROOTDIR/.devsrc_old.tar" && ln -sfn /tmp/src/.device /tmp/src_old/.device
hist=${HISTORIES:-8192,32768,65536}; reps=${REPS:-5}
cd /tmp/src && export PYTHONPATH=/tmp/site:/tmp/src REDKNOT_COMMIT=${HEAD_COMMIT}
python3 benchmarks/followup_ttft.py --histories $hist --reps $reps --out "$OUT/followup_head.json" > "$OUT/followup_head.log" 2>&1
cd /tmp/src_old && export PYTHONPATH=/tmp/site:/tmp/src_old REDKNOT_COMMIT=${OLD_COMMIT}
python3 -m pip install -q --upgrade --no-deps --no-build-isolation --no-index --target /tmp/site . >/dev/null 2>&1
python3 /tmp/src/benchmarks/followup_ttft.py --histories $hist --reps $reps --variants redknot-g0.125 \
  --out "$OUT/followup_old.json" > "$OUT/followup_old.log" 2>&1
grep -h "^flashinfer \|^redknot" "$OUT"/followup_*.log | cut -c1-200
