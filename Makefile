# Every target creates (once) and uses the virtual environment $(VENV).
VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin

.PHONY: install demo test test-fast lint clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip
	$(BIN)/python -m pip install -e ".[dev]"
	touch $@

install: $(BIN)/.installed

## demo: train on the embedded synthetic dataset (CPU, 1-2 minutes: see the README)
demo: install
	$(BIN)/mlcls-train

## test: the whole test suite (the command CI runs)
test: install
	$(BIN)/python -m pytest -q --durations=10

## test-fast: skip the tests that launch torchrun
test-fast: install
	$(BIN)/python -m pytest -q -m "not slow"

lint: install
	$(BIN)/ruff check mlcls tests scripts
	$(BIN)/ruff format --check mlcls tests scripts

clean:
	rm -rf $(VENV) outputs multirun .pytest_cache
