# Two commands from a fresh clone:  `make run`  (the embedded demo)  and  `make test`.
# Each creates the virtual environment on first use.
PYTHON ?= python3
VENV ?= .venv
STAMP := $(VENV)/.installed

.PHONY: run test test-fast install clean-runs

$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/vlmrl run

test: $(STAMP)
	# llama.cpp's GGUF converter, from the llama-cpp-python source package on PyPI (once, into vlmrl's cache);
	# without it the GGUF test skips and says so
	-$(VENV)/bin/python -m vlmrl.export.gguf fetch
	$(VENV)/bin/python -m pytest -q

# The inner loop: the suite less the tests marked `slow` (whole runs, subprocesses, compiles, fuzzing; pyproject.toml
# registers the marker), under 3 minutes on 2 cores. `make test` stays the whole suite.
test-fast: $(STAMP)
	$(VENV)/bin/python -m pytest -q -m "not slow"

clean-runs:
	rm -rf runs
