# labkit: `make lab` to learn, `make test` to check everything.
# Both create .venv from pyproject.toml + constraints.txt the first time, and again only
# when one of those two files changes (the stamp's name is their hash).

PYTHON  ?= python3
VENV    ?= .venv
HOST    ?= 127.0.0.1
PORT    ?= 8888
EXTRAS  ?= tensorflow,dev
# Seconds a single notebook cell may run before nbval gives up on it (the 180 s per-notebook
# budget is enforced separately by tests/notebook_budget.py).
CELL_TIMEOUT ?= 600

PY    := $(VENV)/bin/python
HASH  := $(shell cat pyproject.toml constraints.txt | sha256sum | cut -c1-16)
STAMP := $(VENV)/.labkit-installed-$(HASH)
# One BLAS/OpenMP thread per process: notebooks start several workers on 2 cores, and
# oversubscribed threads make every timing meaningless.
SINGLE_THREAD := OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
NOTEBOOKS := $(sort $(wildcard notebooks/*.ipynb))
# Parallel pytest workers (pytest-xdist) for the unit tests and the notebooks: one per core.
# Each worker keeps its own warm ranks and starts its own launches, so more workers than cores
# oversubscribe the CPU (timeouts) and the memory; --dist loadfile keeps a file's tests (a
# notebook's cells, one kernel) on one worker, in order. JOBS=0: everything in one process.
# A worker that dies (the OOM killer, a segfault) fails the run at once: xdist's replacement
# worker could leave the run waiting forever on the dead one's file.
XDIST = --dist loadfile --max-worker-restart=0
JOBS    ?= $(shell nproc 2>/dev/null || echo 2)
NB_JOBS ?= $(JOBS)
TIMES   := .pytest_cache/labkit-times

.PHONY: help install lab test lint unit notebooks bench gpu-check container-check lock clean

help:
	@echo "make lab    start JupyterLab on notebooks/ (HOST=$(HOST) PORT=$(PORT))"
	@echo "make test   lint, unit tests, every notebook in the smoke profile (JOBS=$(JOBS) workers)"
	@echo "make bench  run the benchmarks and print their figures"
	@echo "make gpu-check  the GPU paths in <5 min, no venv or Jupyter (PYTHON=$(PYTHON))"

install: $(STAMP)

$(STAMP):
	@echo ">> installing labkit into $(VENV) (first run, or pyproject/constraints changed)"
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --constraint constraints.txt pip
	$(PY) -m pip install --quiet --constraint constraints.txt --editable ".[$(EXTRAS)]"
	@rm -f $(VENV)/.labkit-installed-*
	@touch $@
	@echo ">> $(VENV) ready"

lab: install
	$(PY) -m labkit lab --host $(HOST) --port $(PORT) --root notebooks

# Lint, unit tests, notebooks: stops at the first that fails, then (pass or fail) prints where
# the time went, the ten slowest tests and notebooks, so that a regression shows as it happens.
test: install
	@rm -f $(TIMES)/unit.json $(TIMES)/notebooks.json
	@status=0; $(MAKE) --no-print-directory lint unit notebooks || status=$$?; \
		echo ">> where the time went"; $(PY) -m tests.timing_report unit notebooks; exit $$status

lint: install
	$(PY) -m ruff check labkit tests

unit: install
	$(SINGLE_THREAD) $(PY) -m pytest -n $(JOBS) $(XDIST) \
		-p tests.timing_report --labkit-times=unit tests

# A notebook cell that prints a line over 100 characters fails (tests/notebook_lines.py): the
# learner's output area would wrap it mid-word. LINE_CHECK= (empty) turns the check off.
LINE_CHECK ?= 1
LINE_CHECK_PLUGIN := $(if $(LINE_CHECK),-p tests.notebook_lines)

notebooks: install
ifeq ($(NOTEBOOKS),)
	@echo ">> no notebooks yet"
else
	LABKIT_PROFILE=smoke LABKIT_HOME=$(CURDIR)/.pytest_cache/labkit-home $(SINGLE_THREAD) \
		$(PY) -m pytest -n $(NB_JOBS) $(XDIST) -p tests.notebook_budget $(LINE_CHECK_PLUGIN) \
		-p tests.solution_cells -p tests.timing_report --labkit-times=notebooks \
		--nbval-lax --nbval-current-env --nbval-cell-timeout=$(CELL_TIMEOUT) $(NOTEBOOKS) \
		$(sort $(wildcard solutions/*.ipynb))
endif

bench: install
	$(SINGLE_THREAD) $(PY) -m labkit bench

# On a lent GPU machine: no venv, no install, no Jupyter; any Python with torch (PYTHON=...).
# Tests, VGG16 figures, cold and warm NCCL launches in under 5 minutes, one summary at the end.
gpu-check:
	PYTHONPATH=. $(PYTHON) tests/gpu_check.py

# docker/Dockerfile built with buildah and run as a learner would (JupyterLab behind its token,
# labkit doctor, notebooks under nbval, torch kept): as root, no Docker engine. Skips, saying
# why, where buildah or root is missing; stand-ins and images stay in LABKIT_CONTAINER_CACHE.
container-check:
	@start=$$(date +%s); status=0; bash tests/container/check.sh || status=$$?; \
		echo ">> container-check took $$(( $$(date +%s) - start )) s"; exit $$status

# Re-resolve constraints.txt from pyproject's ranges in a scratch venv.
lock:
	rm -rf /tmp/labkit-lock && $(PYTHON) -m venv /tmp/labkit-lock
	/tmp/labkit-lock/bin/pip install --quiet "pip==26.3"
	/tmp/labkit-lock/bin/pip install --quiet --editable ".[$(EXTRAS)]"
	{ sed -n '1,3p' constraints.txt; echo "pip==26.3"; /tmp/labkit-lock/bin/pip freeze --exclude-editable; } > constraints.txt.new
	mv constraints.txt.new constraints.txt && rm -rf /tmp/labkit-lock

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
