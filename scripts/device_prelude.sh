#!/usr/bin/env bash
# Source on the GPU machine from the carried working tree: unpacks the SGLang bundle and runs
# from a pristine copy of a committed tree (.devsrc.tar, made by `git archive HEAD`), so that
# uncommitted edits in the working tree never reach a measurement.
#   git archive HEAD -o .devsrc.tar   # here; carry [".device", ".devsrc.tar"]
#   source scripts/device_prelude.sh   # there; then run from $PWD (the pristine copy)
set -e
mkdir -p /tmp/site /tmp/src
[ -f /tmp/site/.unpacked ] || { tar -C /tmp/site -xJf .device/sglang-site.tar.xz && touch /tmp/site/.unpacked; }
rm -rf /tmp/src/* && tar -C /tmp/src -xf .devsrc.tar
ln -sfn "$PWD/.device" /tmp/src/.device
cd /tmp/src
export PYTHONPATH=/tmp/site:/tmp/src PYTHONUNBUFFERED=1
export REDKNOT_COMMIT="${REDKNOT_COMMIT:-unknown}"
python3 -m pip install -q --upgrade --no-deps --no-build-isolation --no-index --target /tmp/site . >/dev/null
set +e
