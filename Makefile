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

# Two passes over every test. The first runs the distributed tests but the `serial` ones on 4 workers, a file's tests
# on one worker (a module's launch is shared by its tests): their workers mostly import torch and sleep (emulated
# devices, timeouts waited out), so 4 overlap on 2 cores. The second runs the `serial` tests one at a time: what they
# assert (adaptive shares, who a partial round waited for) follows measured times, which other tests' processes
# would distort. Beside them, at the lowest CPU priority, run the unit tests (on 2 workers, their output printed once
# they end): they take only the CPU the serial tests leave idle while they sleep, and a woken serial rank preempts
# them. Then the site is built strictly, so that a broken reference fails. hetdp is compiled first: where
# PYTHONDONTWRITEBYTECODE is set, every rank would compile it again (0.15 s of CPU each, some 400 of them).
test: venv
	$(BIN)/python -m compileall -q src
	$(BIN)/python -m pytest -q -n 4 --dist loadfile -m "not serial" --durations=20 tests/distributed
	unit_log=$$(mktemp); \
	nice -n 19 $(BIN)/python -m pytest -q -n 2 -m "not serial" --durations=10 tests/unit >$$unit_log 2>&1 & unit=$$!; \
	$(BIN)/python -m pytest -q -m serial --durations=20 tests; serial=$$?; \
	wait $$unit; unit_rc=$$?; cat $$unit_log; rm -f $$unit_log; \
	test $$serial -eq 0 && test $$unit_rc -eq 0
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet --site-dir "$$(mktemp -d)"

docs: venv
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

demo: venv
	$(BIN)/hetdp demo
