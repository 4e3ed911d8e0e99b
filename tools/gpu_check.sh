#!/usr/bin/env bash
# The GPU checks of one lent device session (docs/performance.md, "GPU"), in the order they matter, each under
# its own time limit so that one stuck step leaves the others' results:  OUT=dir bash tools/gpu_check.sh [steps]
# steps (default all): generate suite attention; SUITE=files narrows the suite. Writes under $OUT: device.txt and, per step, its log and tables.
set -u
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
PY=${PY:-python3}
steps=${*:-generate suite attention}
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
  $PY -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__, torch.cuda.get_device_name())"; } 2>&1 | tee "$OUT/device.txt"
for step in $steps; do
  start=$(date +%s)
  case $step in
    generate) timeout ${GEN_S:-300} $PY -m tools gpu-generate --contexts 32768,65536 --profile --out "$OUT/gpu_generate.md" \
                >"$OUT/generate.log" 2>&1; rc=$?; grep -v -i warn "$OUT/generate.log" | tail -40 ;;
    suite) timeout 170 $PY -m pytest -n 8 -q -p no:cacheprovider ${SUITE:-tests/test_kernels_triton.py tests/test_ops.py \
             tests/test_h2o.py tests/test_tokens.py tests/test_triton_generate.py tests/test_gpu_tools.py} \
             -k "triton or gpu" >"$OUT/suite.log" 2>&1; rc=$?; tail -6 "$OUT/suite.log" ;;
    attention) timeout ${ATT_S:-150} $PY -m tools gpu --out "$OUT/gpu_attention.md" >"$OUT/attention.log" 2>&1; rc=$?
               grep -E "^\| (32768|65536) \| 8 " "$OUT/gpu_attention.md" ;;
    *) echo "gpu_check: unknown step $step (generate, suite, attention)"; rc=2 ;;
  esac
  echo "== $step: rc $rc in $(( $(date +%s) - start )) s" | tee -a "$OUT/device.txt"
done
