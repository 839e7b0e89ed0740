# Set-up and checks. `make test` is what CI runs (through .ci/run).
PYTHON ?= python3
# Where torch comes from: empty for the default index (PyPI's Linux x86_64 wheel carries CUDA, several GB);
# `make venv TORCH_INDEX=https://download.pytorch.org/whl/cpu` takes the CPU-only build.
TORCH_INDEX ?=
VENV := .venv
BIN := $(VENV)/bin

.PHONY: venv test demo docs

$(BIN)/hetdp: pyproject.toml requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(BIN)/pip install -q -r requirements-dev.txt
	$(BIN)/pip install -q --no-deps -e .
	touch $(BIN)/hetdp

venv: $(BIN)/hetdp

# Two passes over every test. The first runs all but the `serial` ones on 4 workers, a file's tests on one worker
# (a module's launch is shared by its tests): unit tests use both cores, and distributed tests, whose workers mostly
# sleep (emulated devices, timeouts waited out), overlap each other's waits. The second runs the `serial` tests one
# at a time: what they assert (adaptive shares, who a partial round waited for) follows measured times, which other
# tests' processes would distort. Then the site is built strictly, so that a broken reference fails. hetdp is compiled
# first: where PYTHONDONTWRITEBYTECODE is set, every rank would compile it again (0.15 s of CPU each, some 400 of them).
test: venv
	$(BIN)/python -m compileall -q src
	$(BIN)/python -m pytest -q -n 4 --dist loadfile -m "not serial" --durations=20 tests
	$(BIN)/python -m pytest -q -m serial --durations=20 tests
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet --site-dir "$$(mktemp -d)"

docs: venv
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

demo: venv
	$(BIN)/hetdp demo
