SHELL := bash
.SHELLFLAGS := -eu -o pipefail -c
.DELETE_ON_ERROR:
MAKEFLAGS += --no-builtin-rules

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PEERS_VENV := .venv-peers
BUF := node_modules/.bin/buf
NPM_STAMP := node_modules/.installed
# Generated, never committed (setup.py build_assets): the protobuf modules (agentmesh/<package>/v1,
# mirroring the proto packages so that their imports are absolute) and the web UI's browser libraries
# (gateway/static/ui/vendor, from node_modules).
VENDOR := gateway/static/ui/vendor
PROTOS := $(shell find protos -name '*.proto' | sort)
GEN_STAMP := agentmesh/.generated
# mypy reads the one import root from a tree of links (it cannot follow the editable install's mapping)
TYPECHECK := $(VENV)/typecheck
CHROMIUM := /usr/bin/chromium
# kubectl (with kustomize built in) from Debian's kubernetes-client package, unpacked into the venv:
# installing the package would clash with any other kubectl on the machine. KUBECTL=kubectl uses yours.
LOCAL_KUBECTL := $(VENV)/kubernetes-client/usr/bin/kubectl
KUBECTL ?= $(LOCAL_KUBECTL)

.PHONY: help
help: ## Show the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-13s %s\n", $$1, $$2}'

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml setup.py | $(BIN)/python
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

$(NPM_STAMP): package.json package-lock.json
	npm ci --no-audit --no-fund --silent
	touch $@

$(GEN_STAMP): $(PROTOS) setup.py $(VENV)/.installed $(NPM_STAMP)
	$(BIN)/python setup.py -q build_assets --inplace
	touch $@

$(LOCAL_KUBECTL): | $(BIN)/python
	rm -rf $(VENV)/kubernetes-client $(VENV)/kubernetes-client.deb
	mkdir -p $(VENV)/kubernetes-client.deb
	cd $(VENV)/kubernetes-client.deb && { apt-get download -qq kubernetes-client 2>/dev/null || \
	  { apt-get update -qq && apt-get download -qq kubernetes-client; }; }
	dpkg-deb -x $(VENV)/kubernetes-client.deb/kubernetes-client_*.deb $(VENV)/kubernetes-client
	rm -rf $(VENV)/kubernetes-client.deb
	$@ version --client >/dev/null

$(CHROMIUM):
	apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null

.PHONY: setup
setup: $(VENV)/.installed $(GEN_STAMP) ## Create the venv, install dependencies, generate code

.PHONY: proto
proto: $(NPM_STAMP) ## Format, lint and breaking-check the protos, then generate
	$(BUF) format -w
	$(BUF) lint
	if git rev-parse --verify -q main >/dev/null && git ls-tree -r --name-only main | grep -q '^protos/'; then \
	  $(BUF) breaking --against '.git#branch=main'; fi
	$(MAKE) --no-print-directory $(GEN_STAMP)

.PHONY: run
run: setup ## Start the whole mesh on loopback with the demo agents
	$(BIN)/agentmesh up

# One worker per core; a test module and its fixtures stay on one worker. PYTEST_ARGS="-n 0 -k ..." runs serially.
PYTEST_ARGS ?= -n auto --dist loadfile

.PHONY: test
test: setup $(CHROMIUM) $(filter $(LOCAL_KUBECTL),$(KUBECTL)) ## Run every test
	$(BIN)/python -m pytest $(PYTEST_ARGS)

.PHONY: screenshots
screenshots: setup $(CHROMIUM) ## Retake the README's screenshots (tests/e2e/ui/screenshots) with the UI tests
	AGENTMESH_SCREENSHOTS=1 $(BIN)/python -m pytest tests/e2e/ui -q

.PHONY: lint
lint: setup $(NPM_STAMP) ## buf lint/format/breaking, ruff, mypy
	$(BUF) lint
	$(BUF) format --diff --exit-code
	if git rev-parse --verify -q main >/dev/null && git ls-tree -r --name-only main | grep -q '^protos/'; then \
	  $(BUF) breaking --against '.git#branch=main'; fi
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	rm -rf $(TYPECHECK) && mkdir -p $(TYPECHECK)/agentmesh
	ln -s $(CURDIR)/agentmesh/* $(CURDIR)/services $(CURDIR)/gateway $(CURDIR)/libs $(TYPECHECK)/agentmesh/
	ln -s $(CURDIR)/tests $(CURDIR)/bench $(TYPECHECK)/
	cd $(TYPECHECK) && $(CURDIR)/$(BIN)/mypy --config-file $(CURDIR)/pyproject.toml -p agentmesh -p tests -p bench

.PHONY: deploy-check
deploy-check: setup $(filter $(LOCAL_KUBECTL),$(KUBECTL)) ## Render the k8s overlays, validate them and compose.yaml
	$(BIN)/python deploy/check.py --kubectl $(KUBECTL)
	$(BIN)/hadolint deploy/Dockerfile

$(VENV)/.bench-installed: $(VENV)/.installed
	$(BIN)/pip install -q -e '.[dev,bench]'
	touch $@

$(PEERS_VENV)/.installed: bench/peers/requirements.txt
	$(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/pip install -q --upgrade pip
	$(PEERS_VENV)/bin/pip install -q -r $<
	touch $@

.PHONY: bench
bench: setup $(VENV)/.bench-installed $(PEERS_VENV)/.installed ## Benchmarks A-G with the LangGraph server beside the mesh, then the chaos run (BENCH_ARGS=--quick for a short run); bench/results/
	$(BIN)/python -m bench.run --peers langgraph --peers-venv $(PEERS_VENV) $(BENCH_ARGS)
	$(BIN)/python -m bench.chaos $(CHAOS_ARGS)

.PHONY: chaos
chaos: setup $(VENV)/.bench-installed ## Mixed turns while services are killed and restarted (CHAOS_ARGS=--minutes 1)
	$(BIN)/python -m bench.chaos $(CHAOS_ARGS)

.PHONY: profile
profile: setup ## py-spy on every service under a paced load (PROFILE_ARGS="--sessions 20 --compare DIR")
	$(BIN)/python -m bench.profile $(PROFILE_ARGS)

.PHONY: bench-peers
bench-peers: setup $(VENV)/.bench-installed $(PEERS_VENV)/.installed ## The benchmarks with the LangGraph server beside the mesh, without the chaos run
	$(BIN)/python -m bench.run --peers langgraph --peers-venv $(PEERS_VENV) $(BENCH_ARGS)

.PHONY: clean
clean: ## Remove the venvs, generated code and installed packages
	rm -rf $(VENV) $(PEERS_VENV) $(patsubst protos/%,%,$(sort $(dir $(PROTOS)))) $(GEN_STAMP) node_modules $(VENDOR) build
