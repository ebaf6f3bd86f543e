# `make demo` and `make test` each create .venv if it is missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.partita-installed

.PHONY: demo test test-fast bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first and pinned: an unpinned torch would pull the CUDA build (GBs)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q numpy xxhash pytest pytest-timeout transformers matplotlib
	# launchers: Ray Train (with its dashboard, which serves the state API that Ray Train polls) and mpi4py
	$(PY) -m pip install -q "ray[default,train]==2.60.0" mpi4py==4.1.2
	$(PY) -m pip install -q --no-build-isolation -e .
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/partita run -n 4 examples/demo.py

test: $(STAMP)
	$(PY) -m pytest -q

# the unit and torch tests alone: tests marked slow (real launchers, big models) are left out
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

bench: $(STAMP)
	for b in bench/*.py; do $(PY) $$b || exit 1; done

clean:
	rm -rf $(VENV) partita-logs .pytest_cache
