#!/usr/bin/env bash
# Source on the GPU machine from the carried working tree (.device/, and .devsrc.tar made here by
# `git archive HEAD | gzip > .devsrc.tar` so that uncommitted edits never reach a measurement):
# benchmarks/gpu_run.py makes the machine ready (SGLang bundle in /tmp/site, the committed tree
# in /tmp/src, the project installed, the commit known) and this shell continues in /tmp/src
# with PYTHONPATH and REDKNOT_COMMIT set.
#   source scripts/device_prelude.sh && python3 benchmarks/ttft.py ...
_redknot_env="$(python3 benchmarks/gpu_run.py unpack --shell)" || {
  echo "device_prelude: benchmarks/gpu_run.py unpack failed" >&2; return 1 2>/dev/null || exit 1; }
eval "$_redknot_env"
unset _redknot_env
