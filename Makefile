# Two entry points: `make demo` (the main job on the bundled example) and `make test` (the whole suite).
# Both create and fill the project-local .venv on first use; re-running is a no-op when nothing changed.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: install demo test lint

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.14.1 torchvision==0.29.1
	$(PY) -m pip install -q -e '.[dev,fast]'
	touch $@

install: $(VENV)/.installed

demo: install
	$(VENV)/bin/hf-rebasin demo

test: install
	$(PY) -m pytest -q

lint: install
	$(VENV)/bin/ruff check hf_rebasin tests benchmarks examples
