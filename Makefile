SHELL := bash
.SHELLFLAGS := -eu -o pipefail -c
.DELETE_ON_ERROR:
MAKEFLAGS += --no-builtin-rules

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PEERS_VENV := .venv-peers
BUF := node_modules/.bin/buf
PROTOS := $(wildcard protos/agentmesh/v1/*.proto)
GEN_STAMP := agentmesh/v1/.stamp
CHROMIUM := /usr/bin/chromium

.PHONY: help
help: ## Show the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-12s %s\n", $$1, $$2}'

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[dev]' --config-settings editable_mode=compat
	touch $@

$(BUF): package.json
	npm install --no-audit --no-fund --silent
	touch $@

$(GEN_STAMP): $(PROTOS) $(VENV)/.installed
	mkdir -p agentmesh/v1
	$(BIN)/python -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. $(PROTOS)
	touch $@

$(CHROMIUM):
	apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null

.PHONY: setup
setup: $(VENV)/.installed $(GEN_STAMP) ## Create the venv, install dependencies, generate code

.PHONY: proto
proto: $(BUF) ## Format, lint and breaking-check the protos, then generate
	$(BUF) format -w
	$(BUF) lint
	if git rev-parse --verify -q main >/dev/null && git ls-tree -r --name-only main | grep -q '^protos/'; then \
	  $(BUF) breaking --against '.git#branch=main'; fi
	$(MAKE) --no-print-directory $(GEN_STAMP)

.PHONY: run
run: setup ## Start the whole mesh on loopback with the demo agents
	$(BIN)/agentmesh up

.PHONY: test
test: setup $(CHROMIUM) ## Run every test
	$(BIN)/python -m pytest $(PYTEST_ARGS)

.PHONY: lint
lint: setup $(BUF) ## buf lint/format/breaking, ruff, mypy
	$(BUF) lint
	$(BUF) format --diff --exit-code
	if git rev-parse --verify -q main >/dev/null && git ls-tree -r --name-only main | grep -q '^protos/'; then \
	  $(BUF) breaking --against '.git#branch=main'; fi
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy agentmesh/cli.py agentmesh/mock_llm services gateway libs

$(VENV)/.bench-installed: $(VENV)/.installed
	$(BIN)/pip install -q -e '.[dev,bench]' --config-settings editable_mode=compat
	touch $@

$(PEERS_VENV)/.installed: tests/bench/peers/requirements.txt
	$(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/pip install -q --upgrade pip
	$(PEERS_VENV)/bin/pip install -q -r $<
	touch $@

.PHONY: bench
bench: setup $(VENV)/.bench-installed ## Benchmarks A-D (BENCH_ARGS=--quick for a short run); tests/bench/results/
	$(BIN)/python -m tests.bench.run $(BENCH_ARGS)

.PHONY: bench-peers
bench-peers: setup $(VENV)/.bench-installed $(PEERS_VENV)/.installed ## The benchmarks with the LangGraph server beside the mesh
	$(BIN)/python -m tests.bench.run --peers langgraph --peers-venv $(PEERS_VENV) $(BENCH_ARGS)

.PHONY: clean
clean: ## Remove the venvs and generated code
	rm -rf $(VENV) $(PEERS_VENV) agentmesh/v1 node_modules
