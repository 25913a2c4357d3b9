# The two commands of the README:  `make demo`  and  `make test`.
# Each creates .venv and installs everything on first use.
# TORCH_SPEC picks the torch build: the default is the CPU build this kind of machine carries;
# on a GPU machine use e.g. `make test TORCH_SPEC=torch`.
PYTHON ?= python3
TORCH_SPEC ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test bench setup

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -e ".[test]"
	DS_BUILD_OPS=0 $(BIN)/python -m pip install --quiet --no-build-isolation deepspeed \
		|| echo "deepspeed did not install: the DeepSpeed tests skip"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/diffusion-debug demo

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest -n 2 --dist loadgroup

bench: $(STAMP)
	$(BIN)/python -m benchmarks.run
