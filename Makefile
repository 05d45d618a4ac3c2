# Two commands for a new user: `make demo` and `make test`. Both build .venv first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test test-all test-zoo bench clean lint notebooks gpu-check

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# A bare `torch` requirement may pull a multi-GB CUDA build: take the CPU wheel unless a torch is importable.
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

demo: setup
	$(BIN)/python -m benchmarks.gpt_budget --demo

lint: setup
	$(BIN)/ruff check optsched solvers tests benchmarks

# two workers (the CI machine's two cores), tests that share a module fixture kept on one worker (xdist_group,
# tests/conftest.py), each hypothesis property at most 25 examples; the slowest tests listed at the end
test: setup lint
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup --durations=15

# every test (slow and zoo ones included), each hypothesis property at its full count (tests/hypothesis_profiles.py)
test-all: setup
	$(BIN)/python -m pytest -q -m '' --hypothesis-profile=full

# every zoo case (the default subset included): transformers' and torch.nn models under optsched's contracts
test-zoo: setup
	$(BIN)/python -m pytest -q tests/test_zoo.py -m 'zoo or not zoo'

# Every benchmark whose JSON (benchmarks/results/) feeds a table in README.md, docs/benchmarks.md or
# docs/distributed.md, or a notebook; then the tables, the notebooks, and the check that all of them are
# current, each with the commit it was measured at. About 1 h 40 min on 2 CPU cores (zoo 26 min, loops 10,
# tight_budgets 8, chunking 8, adam_step 6, scaling_llama 5, the four gpt_budget runs 11, the rest 1-3
# each, notebooks 12): docs/benchmarks.md, "Durations", lists what each JSON recorded. Commit first: each
# JSON records whether the tree was clean.
bench: setup
	$(BIN)/python -m benchmarks.gpt_budget
	$(BIN)/python -m benchmarks.gpt_budget --executor inductor --budgets 0.55 --mincut-backend inductor --json benchmarks/results/gpt_inductor.json
	$(BIN)/python -m benchmarks.gpt_budget --layers 12 --width 128 --batch 8 --budgets 0.5 --no-mincut --json benchmarks/results/gpt12_budget.json
	$(BIN)/python -m benchmarks.gpt_budget --model hf-gpt2 --layers 6 --batch 8 --budgets 0.5 --json benchmarks/results/hf_gpt2_budget.json
	$(BIN)/python -m benchmarks.scaling
	$(BIN)/python -m benchmarks.offload
	$(BIN)/python -m benchmarks.adam_step
	$(BIN)/python -m benchmarks.plan_offline
	$(BIN)/python -m benchmarks.seed_order
	$(BIN)/python -m benchmarks.zoo
	$(BIN)/python -m benchmarks.loops
	$(BIN)/python -m benchmarks.tight_budgets --label after
	$(BIN)/python -m benchmarks.two_processes
	$(BIN)/python -m benchmarks.planning_time
	$(BIN)/python -m benchmarks.scaling_llama --label after --depths 8,16,32,80
	$(BIN)/python -m benchmarks.chunking
	$(BIN)/python -m benchmarks.fsdp_offline
	$(BIN)/python -m benchmarks.whole_step
	$(BIN)/python -m benchmarks.report
	$(BIN)/python notebooks/execute.py
	$(BIN)/python -m benchmarks.report --check

# on a CUDA machine, with its own python and torch (no venv is made): pytest -m gpu, the Llama headline, a step
# that does not fit, offload vs recompute; writes benchmarks/results/gpu_check.json. E.g.
# PYTHONPATH=/tmp/site:$PWD make gpu-check PY=python3
# On a device machine whose copy of .git may lag the tree, set OPTSCHED_COMMIT=<the commit sent> so the JSON's
# meta names it (python -m benchmarks.report renders the README's GPU table from that JSON).
gpu-check:
	$(PY) -m benchmarks.gpu_check

# notebooks/: every notebook at full size, outputs and plots written into the files (about 12 minutes); they
# read benchmarks/results/*.json, so run them after the benchmarks (`make bench` does)
notebooks: setup
	$(BIN)/python notebooks/execute.py

clean:
	rm -rf $(VENV) build *.egg-info
