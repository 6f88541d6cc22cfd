# Two commands from a fresh clone:  `make run`  (the embedded demo)  and  `make test`.
# Each creates the virtual environment on first use.
PYTHON ?= python3
VENV ?= .venv
STAMP := $(VENV)/.installed

.PHONY: run test install clean-runs

$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/vlmrl run

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q

clean-runs:
	rm -rf runs
