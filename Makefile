# Echo: the usual entry points. Everything runs from .venv (made by `make venv`).
.PHONY: venv run test test-fast lint bench clean distclean validate test-slurm status sweeps report

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.echo-installed
CORES ?= 2
# The shipped design-space sweeps (config/sweeps/); `make report SWEEPS=a,b` shows only those.
SWEEPS ?= gpt3-175b-a100-1024,llama3-70b-h100-512
REPORT_CONFIG = --config 'sweeps=[$(SWEEPS)]'
comma := ,

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

# Real runs on this machine next to their predictions, and the published cluster measurements
# (results/validate/; the table of errors is printed and written to results/validate/errors.md).
# The real runs are redone every time: they time this machine now.
validate: venv
	$(BIN)/snakemake --forcerun measure --cores $(CORES) results/validate/errors.md
	@cat results/validate/errors.md

# The hardware fits, results/fit/{hardware}.json (echo.fit.kernels, on the reference folder's per-kernel
# tables and the split of config/splits/kernel_tables.yaml; not part of `make run`: they need the
# reference folder). `python -m echo fit --write` runs the same fit and writes each file's
# compute_model section (tests/test_kernel_model.py and tests/test_fit.py say when it is due).
.PHONY: fit
FITS ?= a100-sxm-80gb h100-sxm-80gb h200-sxm-141gb b200-sxm gb200 b300-sxm gb300
fit: venv
	$(BIN)/snakemake --cores $(CORES) $(foreach h,$(FITS),results/fit/$(h).json)

# Everything, the real single-node SLURM test included (it installs SLURM with apt as root): on
# every core (pytest-xdist, one test file per worker at a time, in collection order: the long files
# first, tests/conftest.py LONG_FILES; xdist's own order is by number of tests), then the tests that
# bound times measured on this machine (marker timing) alone, so that no other test shares the cores
# they time. Both parts always run; either failing fails the target.
TEST_WORKERS ?= auto
test: venv
	@start=$$(date +%s); rc=0; \
	$(BIN)/pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not timing" --durations=15 || rc=$$?; \
	$(BIN)/pytest -q -m timing --durations=5 || rc=$$?; \
	echo "make test: $$(( $$(date +%s) - start )) s"; exit $$rc

# The unit tests (no snakemake runs, no SLURM, no real training runs): under 3 minutes here.
test-fast: venv
	@start=$$(date +%s); $(BIN)/pytest -q -m "not slow and not slurm" --durations=5; rc=$$?; \
	echo "make test-fast: $$(( $$(date +%s) - start )) s"; exit $$rc

test-slurm: venv
	$(BIN)/pytest -q -m slurm -s

# What is cached and what would re-run (and why).
status: venv
	$(BIN)/python -m echo status

# The shipped sweeps (tens of minutes on 2 cores: every distinct layout is traced once).
sweeps: venv
	$(BIN)/snakemake --cores $(CORES) $(foreach s,$(subst $(comma), ,$(SWEEPS)),results/sweep/$(s)/ranking.parquet)

# Snakemake's HTML report of the default experiments and the sweeps, and screenshots of it taken
# in headless Chromium (apt-get install chromium).
report: venv
	$(BIN)/snakemake --cores $(CORES) $(REPORT_CONFIG)
	$(BIN)/snakemake --report results/report/report.html $(REPORT_CONFIG)
	$(BIN)/python -m echo.report.html results/report/report.html results/report/screenshots

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
