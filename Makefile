# `make demo` and `make test` each create .venv if it is missing, and install what that command needs:
#   runtime   (demo, bench): torch, numpy, xxhash, partita
#   testing   (test-fast):   + pytest, pytest-timeout, transformers, matplotlib
#   launchers (test):        + Ray Train and mpi4py, which the launcher tests start
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
RUNTIME := $(VENV)/.partita-runtime
TESTING := $(VENV)/.partita-testing
LAUNCHERS := $(VENV)/.partita-launchers

.PHONY: demo test test-fast bench clean
.NOTPARALLEL:  # one pip at a time in the venv

$(RUNTIME): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first and pinned: an unpinned torch would pull the CUDA build (GBs)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q numpy xxhash
	$(PY) -m pip install -q --no-build-isolation -e .
	touch $@

$(TESTING): $(RUNTIME)
	$(PY) -m pip install -q pytest pytest-timeout transformers matplotlib
	touch $@

# Ray Train (with its dashboard, which serves the state API that Ray Train polls) and mpi4py (built against
# the system's MPI: .ci/run installs Open MPI first)
$(LAUNCHERS): $(RUNTIME)
	$(PY) -m pip install -q "ray[default,train]==2.60.0" mpi4py==4.1.2
	touch $@

demo: $(RUNTIME)
	$(VENV)/bin/partita run -n 4 examples/demo.py

test: $(TESTING) $(LAUNCHERS)
	$(PY) -m pytest -q

# the unit and torch tests alone: tests marked slow (real launchers, big models) are left out
test-fast: $(TESTING)
	$(PY) -m pytest -q -m "not slow"

bench: $(RUNTIME)
	for b in bench/*.py; do $(PY) $$b || exit 1; done

clean:
	rm -rf $(VENV) partita-logs .pytest_cache
