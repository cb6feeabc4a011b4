# The two commands of the README:
#   make run    set up .venv and start a local fleet on embedded defaults (Ctrl-C stops it)
#   make test   set up .venv and redis-server, then lint, type-check and run the whole suite
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: run test lint typecheck pytest protos redis clean

$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet -e '.[engine,dev]'
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/kvplane up configs/local.yaml

test: $(STAMP) redis lint typecheck pytest

redis:
	@bash scripts/ensure_redis.sh

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy

pytest: $(STAMP)
	$(VENV)/bin/pytest -q -n 2 --dist loadfile

protos: $(STAMP)
	$(VENV)/bin/python scripts/gen_protos.py

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache
