# Set-up and checks. `make test` is what CI runs (through .ci/run).
PYTHON ?= python3
# Where torch comes from: empty for the default index (PyPI's Linux x86_64 wheel carries CUDA, several GB);
# `make venv TORCH_INDEX=https://download.pytorch.org/whl/cpu` takes the CPU-only build.
TORCH_INDEX ?=
VENV := .venv
BIN := $(VENV)/bin

.PHONY: venv test demo

$(BIN)/hetdp: pyproject.toml requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(BIN)/pip install -q -r requirements-dev.txt
	$(BIN)/pip install -q --no-deps -e .
	touch $(BIN)/hetdp

venv: $(BIN)/hetdp

test: venv
	$(BIN)/python -m pytest -q tests

demo: venv
	$(BIN)/hetdp demo
