#!/usr/bin/env bash
# plugins/fetch_deb.sh PACKAGES DEST [SUITE]: unpack Debian's PACKAGES (comma-separated; suite SUITE, default trixie)
# into the folder DEST, without touching the system's apt configuration: a private source list and lists folder
# (docs/design.md, Build facts). Nothing is installed or vendored; a DEST that already holds them is left as it is.
#   libonnxruntime-dev   the ONNX Runtime C/C++ API headers the kernels compile against (plugins/ort/build.sh)
#   qemu-user            qemu-x86_64, which emulates older CPUs for the kernels' portability test (make test)
#   haproxy,...          HAProxy and the libraries it needs beyond a base system, for the replicas deployment's
#                        test (make test; tools/replicas.py, HAPROXY_DEBS), from bookworm
set -euo pipefail
package=$1
dest=$2
suite=${3:-trixie}
if [ -f "$dest/.package" ] && [ "$(cat "$dest/.package")" = "$package $suite" ]; then exit 0; fi
mirror=${AQUA_DEBIAN_MIRROR:-http://deb.debian.org/debian}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/lists/partial"
echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $mirror $suite main" > "$work/sources.list"
apt_opts=(-q -o Dir::Etc::SourceList="$work/sources.list" -o Dir::Etc::SourceParts=/dev/null
          -o Dir::State::Lists="$work/lists" -o Debug::NoLocking=1 -o APT::Sandbox::User=root)
apt-get "${apt_opts[@]}" update >/dev/null
IFS=, read -ra names <<< "$package"
(cd "$work" && apt-get "${apt_opts[@]}" download "${names[@]}" >/dev/null 2>&1)
rm -rf "$dest.tmp"
mkdir -p "$(dirname "$dest")"
for name in "${names[@]}"; do
  deb=$(ls "$work"/"${name}"_*.deb)
  dpkg -x "$deb" "$dest.tmp"
  echo "Debian $suite: $(basename "$deb") -> $dest"
done
echo "$package $suite" > "$dest.tmp/.package"
rm -rf "$dest" && mv "$dest.tmp" "$dest"
