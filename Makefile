# kv-sidecar: two commands do all the set-up on a fresh machine.
#   make demo   - build .venv, run the reference engine with a fault, watch the sidecar catch it
#   make test   - build .venv (and .venv-vllm, .venv-lmcache, .venv-sglang), run lint, the docs site build, unit, lean-install, Prometheus/Alertmanager e2e, vLLM, LMCache, SGLang and Kubernetes-manifest tests
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
FAULT ?= zero-block
DEMO_ARGS ?=

.PHONY: demo test venv lint docs test-unit test-lean test-e2e test-vllm test-lmcache test-sglang test-deploy bench stack clean

venv: $(VENV)/.installed

# torch first and pinned, so no other requirement drags in a CUDA build (ENGINES.md).
# The testbed (reference engines, faults, demo, bench) is a distribution of its own: testbed/.
$(VENV)/.installed: pyproject.toml testbed/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[demo,hf,events,dev,plot]'
	$(PY) -m pip install -q --no-deps -e ./testbed
	touch $@

demo: venv
	@$(VENV)/bin/kv-sidecar demo --fault $(FAULT) $(DEMO_ARGS)

lint: venv
	$(VENV)/bin/ruff check sidecar testbed tests dashboards alerts examples deploy
	$(VENV)/bin/mypy sidecar testbed/kvtestbed

# The docs site (docs/, mkdocs.yml): broken links, missing pages or anchors fail the build.
# Its generated pages are checked for staleness by tests/test_docs_generated.py.
docs: venv
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

test-unit: venv
	$(PY) -m pytest -q -m "not e2e and not vllm and not lmcache and not sglang and not deploy" tests

test-e2e: venv
	bash scripts/test-e2e.sh

# `pip install .` in a fresh venv: runtime dependencies only, the CLI names missing extras.
test-lean:
	bash scripts/test-lean-install.sh

test-vllm: venv
	bash scripts/test-vllm.sh

# Real LMCache storage tiers (CPU + disk) in a venv of its own (its pins conflict with ours).
test-lmcache:
	bash scripts/test-lmcache.sh

# Kubernetes manifests, operator resources and the mixin, offline (scripts/test-deploy.sh).
test-deploy: venv
	bash scripts/test-deploy.sh

# A real SGLang server (0.5.23, CPU) with the kv-sidecar radix-cache backend, in its own venv.
test-sglang:
	bash scripts/test-sglang.sh

test: lint docs test-unit test-lean test-e2e test-vllm test-lmcache test-sglang test-deploy

# Prometheus + Alertmanager + the demo on 127.0.0.1 (needs the Debian packages; Ctrl-C stops all).
stack: venv
	$(PY) examples/stack/stack.py --fault $(FAULT)

bench: venv
	$(VENV)/bin/kv-sidecar bench detection

clean:
	rm -rf $(VENV) .venv-vllm .venv-lmcache .venv-sglang .pytest_cache .mypy_cache .ruff_cache site

# N demo replicas (one with FAULT) behind one Prometheus + Alertmanager on 127.0.0.1; the page
# names the bad replica (docs/operations/fleet.md). Ctrl-C stops all.
N ?= 4
.PHONY: fleet
fleet: venv
	$(PY) examples/fleet/fleet.py --replicas $(N) --fault $(FAULT)
