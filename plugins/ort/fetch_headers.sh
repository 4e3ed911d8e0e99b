#!/usr/bin/env bash
# Fetch the ONNX Runtime C/C++ API headers from Debian trixie's libonnxruntime-dev into $1
# (default build/ort-headers) without touching the system's apt configuration (docs/design.md, Build facts).
set -euo pipefail
dest=${1:-build/ort-headers}
if [ -f "$dest/onnxruntime_cxx_api.h" ]; then exit 0; fi
mirror=${AQUA_DEBIAN_MIRROR:-http://deb.debian.org/debian}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/lists/partial"
echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $mirror trixie main" > "$work/sources.list"
apt_opts=(-q -o Dir::Etc::SourceList="$work/sources.list" -o Dir::Etc::SourceParts=/dev/null
          -o Dir::State::Lists="$work/lists" -o Debug::NoLocking=1 -o APT::Sandbox::User=root)
apt-get "${apt_opts[@]}" update >/dev/null
(cd "$work" && apt-get "${apt_opts[@]}" download libonnxruntime-dev >/dev/null 2>&1)
deb=$(ls "$work"/libonnxruntime-dev_*.deb)
dpkg -x "$deb" "$work/x"
mkdir -p "$dest.tmp"
cp "$work"/x/usr/include/onnxruntime/*.h "$dest.tmp/"
rm -rf "$dest" && mv "$dest.tmp" "$dest"
echo "ONNX Runtime headers: $(basename "$deb") -> $dest"
