#!/usr/bin/env bash
# Drops from .device/sglang-site.tar.xz (built by ../shared/device/build-sglang-bundle.sh) what
# no redknot job loads, so that the bundle and the repository fit a device call's 64 MiB (counted
# on disk): jedi and parso (IPython's completer), every test folder (SGLang's, torchao's,
# FlashInfer's copies of CUTLASS and CCCL, ...), type stubs, and CUTLASS's examples and CCCL's
# benchmarks (FlashInfer compiles against their include folders only). About 1.3 MB less.
# soundfile stays: SGLang's HTTP server imports it.
#     bash scripts/slim_device_bundle.sh [.device/sglang-site.tar.xz]
set -euo pipefail
bundle="${1:-.device/sglang-site.tar.xz}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
tar -C "$work" -xJf "$bundle"
rm -rf "$work"/{jedi,parso} "$work"/flashinfer/data/cutlass/examples \
  "$work"/flashinfer/data/cccl/benchmarks
find "$work" -type d \( -name tests -o -name test \) -prune -exec rm -rf {} +
find "$work" -name '*.pyi' -delete
tar -C "$work" -cf - . | xz -9 -T0 > "$work.tar.xz"
mv "$work.tar.xz" "$bundle"
ls -la "$bundle"
