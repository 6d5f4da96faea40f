# Every target sets up what it needs: the virtual environment is (re)built only when
# pyproject.toml changes, so each command is idempotent and cheap after the first run.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: venv run test lint bench-mil clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

run: venv
	$(VENV)/bin/tiered run

# In a network namespace with loopback only where the machine allows one (Ray's tests need it).
test: venv
	scripts/loopback $(PY) -m pytest -q

lint: venv
	$(VENV)/bin/ruff check tiered tests benchmarks
	$(VENV)/bin/mypy tiered

bench-mil: venv
	$(VENV)/bin/tiered bench mil --model embedded:bench --json benchmarks/out/mil.json

clean:
	rm -rf $(VENV) .models
