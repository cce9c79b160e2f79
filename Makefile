# Set-up and entry points. `make demo` and `make test` work on a fresh machine: they create
# .venv (torch 2.13.0 first, so pip never pulls a multi-GB CUDA build), then install the project.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv demo test test-fast test-gpu ablation bench clean

$(STAMP): setup.py
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/python tools/demo.py

test: $(STAMP)
	$(BIN)/python -m pytest -q

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

test-gpu: $(STAMP)
	$(BIN)/python -m pytest -q -m gpu

ablation: $(STAMP)
	$(BIN)/python experiments/ablation/run.py

bench: $(STAMP)
	$(BIN)/python -m pip install -q -e '.[bench]'
	$(BIN)/python tools/bench_throughput.py

clean:
	rm -rf runs .pytest_cache
