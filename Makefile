# Two entry points: `make demo` (the main job on the bundled example) and `make test` (the whole suite).
# Both create and fill the project-local .venv on first use; re-running is a no-op when nothing changed.
# The package declares ranges (pyproject.toml); the exact torch build of this machine is pinned here, through
# the constraints file CI uses too.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
CONSTRAINTS := .ci/constraints-torch-2.14.txt

.PHONY: install demo test lint

$(VENV)/.installed: pyproject.toml $(CONSTRAINTS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c $(CONSTRAINTS) -e '.[vision,dev,fast]'
	touch $@

install: $(VENV)/.installed

demo: install
	$(VENV)/bin/hf-rebasin demo

test: install
	$(PY) -m pytest -q

lint: install
	$(VENV)/bin/ruff check hf_rebasin tests benchmarks examples
