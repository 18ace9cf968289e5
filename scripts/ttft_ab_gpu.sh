#!/usr/bin/env bash
# A/B of the TTFT of segment reuse at two commits on one GPU machine, in one call: the committed
# head (.devsrc.tar, profiled) and an older commit (.devsrc_old.tar, made by
# `git archive OLD -o .devsrc_old.tar`), 32768x8, 4 reps each.
# The old commit runs under the head's benchmarks/ttft.py (same harness, its own redknot).
#   HEAD_COMMIT=abc OLD_COMMIT=def bash scripts/ttft_ab_gpu.sh   (carry .device, both archives)
ROOTDIR=$PWD; source scripts/device_prelude.sh
export REDKNOT_COMMIT=${HEAD_COMMIT}
python3 benchmarks/ttft.py --points 32768x8 --reps 4 --variants redknot-g0.125-reuse-sparse-cached --profile-dir /tmp/prof --out $OUT/ttft_ab_head.json > $OUT/ab_head.log 2>&1
t=$(ls /tmp/prof/*/*.trace.json.gz | head -1); python3 benchmarks/profile_summary.py "$t" --top 25 --out $OUT/profile_head.json > /dev/null 2>&1; cp "$t" $OUT/trace_head.json.gz
mkdir -p /tmp/src_old && tar -C /tmp/src_old -xf $ROOTDIR/.devsrc_old.tar && ln -sfn /tmp/src/.device /tmp/src_old/.device
cd /tmp/src_old && export PYTHONPATH=/tmp/site:/tmp/src_old REDKNOT_COMMIT=${OLD_COMMIT}
python3 -m pip install -q --upgrade --no-deps --no-build-isolation --no-index --target /tmp/site . >/dev/null 2>&1
python3 /tmp/src/benchmarks/ttft.py --points 32768x8 --reps 4 --variants redknot-g0.125-reuse-sparse-cached --out $OUT/ttft_ab_old.json > $OUT/ab_old.log 2>&1
grep -h '"ttft_s"\|samples' -A5 $OUT/ttft_ab_head.json $OUT/ttft_ab_old.json | grep -v flops | head -30
