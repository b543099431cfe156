# The two commands of the README: `make run` and `make test`. Each installs what is missing first.
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install lock locked run test bench lint typecheck unit clean

install:
	bash deploy/install.sh all

# Every install reads deploy/locks/: after a change to pyproject's dependencies or deploy/versions.env, `make lock`
# (LOCK_ARGS=--upgrade for the newest releases allowed).
lock: install
	$(BIN)/python deploy/lock.py $(LOCK_ARGS)

locked:
	python3 deploy/lock.py --check

run: install
	$(BIN)/tokenbus run

lint:
	$(BIN)/ruff check shared services tests
	$(BIN)/lint-imports  # the layers: pyproject.toml [tool.importlinter]

typecheck:
	$(BIN)/mypy

test: locked install lint typecheck
	$(BIN)/python -m pytest -n 2  # two processes: tests/conftest.py says which test runs where

bench: install
	$(BIN)/tokenbus bench all --out docs/benchmarks.md

unit:
	bash deploy/install.sh dev
	$(BIN)/python -m pytest -m "not engine"

clean:
	rm -rf $(VENV) .venv-checkov .mypy_cache .ruff_cache .pytest_cache
