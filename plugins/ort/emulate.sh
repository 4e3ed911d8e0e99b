#!/usr/bin/env bash
# plugins/ort/emulate.sh DEST: the AVX-512 variant's code on a CPU without AVX-512. The kernels compiled with
# simd/portable.h at 16 lanes (AQUA_PORTABLE_LANES=16: the AVX-512 variant's panels, tiles and bfloat16 path, in
# GCC's generic vectors) for this CPU, installed into DEST as its x86-64-v3 variant beside a loader. Slow; for the
# numeric tests only, on a machine where the v4 library cannot run (QEMU emulates no AVX-512):
#   bash plugins/ort/emulate.sh build/emulated
#   AQUA_ORT_KERNEL=build/emulated/libaqua_ort.so AQUA_ORT_ISA=x86-64-v3 \
#     .venv/bin/python -m pytest tests/test_ops.py -k "not triton"
# What it cannot reach: the few instructions avx512.h names (its any_gt, folds, widening loads, vpdpbusd,
# vdpbf16ps, vcvtne2ps2bf16), which run where the CPU has them.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
dest=$1
bash "$root/plugins/fetch_deb.sh" libonnxruntime-dev "$root/build/ort-deb"
cmake -S "$root/plugins/ort" -B "$root/build/ort-emulated" -DORT_INCLUDE_DIR="$root/build/ort-deb/usr/include/onnxruntime" \
  -DAQUA_VARIANTS=x86-64-v3 -DAQUA_EXTRA_FLAGS="-DAQUA_SIMD_PORTABLE;-DAQUA_PORTABLE_LANES=16;-DAQUA_PORTABLE_BF16" \
  > /dev/null
cmake --build "$root/build/ort-emulated" -j "$(nproc)" > /dev/null
mkdir -p "$dest"
cp "$root"/build/ort-emulated/libaqua_ort.so "$root"/build/ort-emulated/libaqua_ort_x86-64-v3.so "$dest/"
