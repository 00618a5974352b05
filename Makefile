# adstream — the README's commands. Each target does its own set-up.
VENV ?= .venv
BIN := $(VENV)/bin
PYTEST_ARGS ?=
# every package of the project (the rooms): doctests and mypy run over all of them
PACKAGES := schemas streams trainers serving attribution workloads creatives deploy adstream_client

.PHONY: install demo up down status test test-all lint check-install typecheck schemas clean

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

# Gates in CI (.ci/run): lint, format, complexity/argument-count rules, types of every package,
# every import declared (deptry: the packages against the runtime and its extras, [tool.deptry];
# the tests against every extra, their own helper modules first-party).
TEST_MODULES = -kf tests $(shell find tests -name '*.py' -printf '%f\n' | sed 's/\.py$$//' | sort -u | sed 's/^/-kf /')
lint: install
	$(BIN)/ruff check .
	$(BIN)/lint-imports --no-cache
	$(BIN)/deptry .
	$(BIN)/deptry tests --exclude '\.venv' --ignore DEP002,DEP004 $(TEST_MODULES)
	$(BIN)/ruff format --check .
	$(BIN)/mypy $(PACKAGES)
	$(BIN)/mypy --explicit-package-bases benchmarks

# Installs that work everywhere (slow; tests/unit/test_packaging.py): the wheel, built and installed
# in a throwaway venv, runs `adstream bench`; the pinned dependencies (runtime and every extra)
# resolve for every supported Python, 3.11–3.13: pip's resolver per version, wheels only, from the
# package index (which it needs: CI runs this with the index required; `make test-all` skips the
# resolution when the index is unreachable).
check-install: install
	ADSTREAM_REQUIRE_INDEX=1 $(BIN)/python -m pytest -q -m slow -p no:cacheprovider tests/unit/test_packaging.py

schemas: install
	$(BIN)/python -m schemas.jsonschema

clean:
	$(BIN)/adstream down || true
	rm -rf .adstream
