# adstream — the README's commands. Each target does its own set-up.
VENV ?= .venv
BIN := $(VENV)/bin
PYTEST_ARGS ?=
# every package of the project (the rooms): doctests and mypy run over all of them
PACKAGES := schemas streams trainers serving attribution workloads creatives deploy adstream_client

.PHONY: install demo up down status test test-all lint typecheck schemas clean

install:
	@bash deploy/install.sh

up: install
	$(BIN)/adstream up

down:
	$(BIN)/adstream down

status:
	$(BIN)/adstream status

demo: install
	$(BIN)/adstream up
	$(BIN)/adstream demo

# Unit and integration tests (real broker, Redis, ClickHouse, Ray), slow suites excluded.
test: install
	$(BIN)/python -m pytest -m "not slow and not gpu" --durations=10 $(PYTEST_ARGS)
	$(BIN)/python -m pytest -q -p no:cacheprovider --doctest-modules $(PACKAGES)

# Everything, slow suites included.
test-all: install
	$(BIN)/python -m pytest -m "not gpu" $(PYTEST_ARGS)
	$(BIN)/python -m pytest -q -p no:cacheprovider --doctest-modules $(PACKAGES)

# Gates in CI (.ci/run): lint, format, complexity/argument-count rules, types of every package.
lint: install
	$(BIN)/ruff check .
	$(BIN)/lint-imports --no-cache
	$(BIN)/ruff format --check .
	$(BIN)/mypy $(PACKAGES)
	$(BIN)/mypy --explicit-package-bases benchmarks

schemas: install
	$(BIN)/python -m schemas.jsonschema

clean:
	$(BIN)/adstream down || true
	rm -rf .adstream
