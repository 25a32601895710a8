# Echo: the usual entry points. Everything runs from .venv (made by `make venv`).
.PHONY: venv run test lint bench clean distclean

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.echo-installed
CORES ?= 2

venv: $(STAMP)

# Redone only when the pins or the package metadata change.
$(STAMP): requirements.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -r requirements.txt
	$(BIN)/pip install -e . --no-deps
	touch $@

run: venv
	$(BIN)/snakemake --cores $(CORES)
	$(BIN)/python -m echo report

test: venv
	$(BIN)/pytest -q

lint: venv
	$(BIN)/ruff check .
	$(BIN)/snakemake --lint

bench: venv
	@set -e; found=0; for f in benchmarks/*.py; do \
	  [ -e "$$f" ] || continue; found=1; echo "== $$f"; $(BIN)/python "$$f"; \
	done; [ $$found = 1 ] || echo "no benchmarks/*.py yet"

clean:
	rm -rf results logs .snakemake benchmarks/out

distclean: clean
	rm -rf $(VENV) *.egg-info .pytest_cache .ruff_cache
