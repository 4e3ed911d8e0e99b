#!/usr/bin/env bash
# plugins/ort/build.sh DEST: the native kernels (CMakeLists.txt: the loader and one library per instruction-set
# variant) compiled under build/ort and installed into DEST, every file replaced at once. `make plugin` and a
# wheel build (setup.py) both run it; CMake rebuilds only what changed.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
dest=$1
bash "$root/plugins/fetch_deb.sh" libonnxruntime-dev "$root/build/ort-deb"
cmake -S "$root/plugins/ort" -B "$root/build/ort" -DORT_INCLUDE_DIR="$root/build/ort-deb/usr/include/onnxruntime" \
  > /dev/null
cmake --build "$root/build/ort" -j "$(nproc)" > /dev/null
mkdir -p "$dest"
for f in "$root"/build/ort/libaqua_ort*.so; do cp "$f" "$dest/.$(basename "$f").tmp"; done
rm -f "$dest"/libaqua_ort*.so  # a variant no longer built must not stay behind
for f in "$root"/build/ort/libaqua_ort*.so; do mv "$dest/.$(basename "$f").tmp" "$dest/$(basename "$f")"; done
