# Two set-up commands on a fresh clone: `make train` and `make test`. Each installs what it needs.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# The torch build that this project is tested with; override for another CUDA/CPU build.
TORCH  ?= torch==2.14.1 torchvision==0.29.1
ARGS   ?=

.PHONY: install train test test-durations test-fast docs lint parity benchmark gpu-dry-run gpu-wheels clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

train: install            ## train the default (ViT on the embedded digits data, CPU, offline)
	$(BIN)/python -m vitlab.train $(ARGS)

# Test files run side by side, each whole in one worker (its module fixtures, such as the Slurm cluster or a trained
# checkpoint, are built once), the longest first: tests/durations.json holds each file's seconds, conftest.py orders
# the files by them, and --no-loadscope-reorder keeps that order (xdist's own puts the files with most tests first).
PARALLEL ?= -n auto --maxprocesses 4 --dist loadfile --no-loadscope-reorder

test: install             ## the whole suite, as CI runs it, then its 15 slowest tests
	$(BIN)/python -m pytest $(PARALLEL) --durations=15 $(ARGS)

test-durations: install   ## the whole suite, writing each file's seconds to tests/durations.json (commit it)
	$(BIN)/python -m pytest $(PARALLEL) --record-durations=tests/durations.json $(ARGS)

test-fast: install        ## every unit folder, without tests/end_to_end/'s command-line suites (~4 min on 2 cores)
	$(BIN)/python -m pytest $(PARALLEL) --ignore=tests/end_to_end $(ARGS)

# The documentation site (mkdocs.yml): docs/ and the pages generated from conf/ and experiments/, built into site/ with
# --strict (as make test builds it), then served with live reload; offline. DOCS_ADDR=0.0.0.0:8000 to reach it remotely.
DOCS_ADDR ?= 127.0.0.1:8000
docs: install             ## build the documentation into site/ and serve it at http://$(DOCS_ADDR)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve --dev-addr $(DOCS_ADDR)

lint: install
	$(BIN)/ruff check src tests
	$(BIN)/ruff format --check src tests

parity: install           ## e.g. make parity ARGS="model=vit_b16"
	$(BIN)/python -m vitlab.parity $(ARGS)

benchmark: install
	$(BIN)/python -m vitlab.benchmark $(ARGS)

# A lent GPU (experiments/gpu/README.md): its script's commands at tiny sizes on this CPU, and the wheels its image
# lacks, computed from what that dry run imports against experiments/gpu/image.txt (carried to the device as .whl/).
# The dry run: about 3 minutes on a quiet 2-core machine (tests/durations.json: 179 s for 15 points, compile a no-op:
# TORCH_COMPILE_DISABLE=1), up to its 560 s deadline on a busy one; its run directories are removed as it ends or is
# stopped.
GPU_DRY := $(or $(TMPDIR),/tmp)/vitlab-gpu-dry
gpu-dry-run: install      ## every GPU point's commands at tiny sizes, on the CPU (3-10 minutes: see above)
	$(BIN)/python experiments/gpu/points.py $(GPU_DRY) --dry-run $(ARGS)

gpu-wheels: install       ## .whl/: the wheels the GPU image lacks, for the device tool's carry
	rm -rf $(GPU_DRY)-imports
	VITLAB_RECORD_IMPORTS=$(GPU_DRY)-imports PYTHONPATH=experiments/gpu/record \
	  $(BIN)/python experiments/gpu/points.py $(GPU_DRY) --dry-run
	$(BIN)/python experiments/gpu/wheels.py download $(GPU_DRY)-imports .whl

clean:
	rm -rf outputs multirun lightning_logs wandb site .pytest_cache .ruff_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
