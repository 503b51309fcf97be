# specrt — the two commands the README starts with: `make demo` and `make test`.
SHELL := /bin/bash
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
ENGINES ?= engines/default
PROMPTS ?= data/humaneval_dev.jsonl
K_MAX ?= 8
MAX_CTX ?= 1024
# the CPU wheel of torch==2.13.0 lies here on this project's machines (an unpinned torch pulls a CUDA build)
PIP_FIND := $(if $(wildcard /opt/wheels),--find-links /opt/wheels,)

# benchmark anchors: own venvs where their pins clash with the main one
OPT_VENV ?= .venv-optimum
OG_VENV ?= .venv-ortgenai
OV_VENV ?= .venv-openvino
LL_VENV ?= .venv-llamacpp
LLAMA_CPP_PYTHON ?= 0.3.36
LL_SRC := $(LL_VENV)/src/llama_cpp_python-$(LLAMA_CPP_PYTHON)
# no download at build time (the web UI, curl/openssl) and this CPU's instructions (AVX2/FMA)
LL_CMAKE := -DGGML_NATIVE=ON -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF
# no AMX code in ggml: its AMX matmul segfaults on the Intel Xeon (AMX) hosts; a no-op where the CPU lacks AMX
NOAMX := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
REPEATS ?= 3
THREADS ?= 2
COMPARE_OUT ?= bench_out/compare

.PHONY: lint lint-c test-sanitize install kernels export demo test test-fast bench bench-envs bench-compare models clean gpu-check load-test ray-check real-pair demo-real bench-real bench-agents test-real

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# base (runtime) + [export] (torch==2.13.0 CPU, transformers, onnx) + [dev] (pytest ...)
install: $(BIN)/python
	$(BIN)/pip install -q $(PIP_FIND) -e '.[export,dev]'

# rebuild specrt's C kernels in place after editing runtime/kernels/*.c|h (make install builds them too)
kernels: $(BIN)/python
	$(BIN)/python setup.py -q build_ext --inplace

# the default flavor: int4 builder graphs, the fastest CPU flavor whose quality holds
# (docs/guide/engines.md); `make export PRECISION=fp32 ENGINES=engines/fp32` for the fp32 engines
PRECISION ?= int4

# models/tuned_defaults.json: the decoding defaults chosen with `specrt tune` (docs/guide/engines.md, decoding defaults)
# models/target/tokenizer_config.json holds the chat template copied into the engine folder
$(ENGINES)/manifest.json: models/target/model.safetensors models/draft/model.safetensors models/tuned_defaults.json models/target/tokenizer_config.json
	$(BIN)/specrt export --draft models/draft --target models/target --out $(ENGINES) --k-max $(K_MAX) --max-ctx $(MAX_CTX) --precision $(PRECISION) --defaults models/tuned_defaults.json

TRT_PRECISION ?= fp16

# export the embedded default pair (models/) to ONNX engines with parity checks; then TensorRT
# plans only where `import tensorrt` works and a GPU is visible (else it says it skipped);
# TensorRT plans are built from standard graphs only (fp32/fp16/bf16 exports)
export: install $(ENGINES)/manifest.json
	$(if $(filter fp32 fp16 bf16,$(PRECISION)),$(BIN)/specrt plans --engines $(ENGINES) --precision $(TRT_PRECISION) --if-available --skip-if-built,@echo "TensorRT plans: not built ($(PRECISION) engines are onnxruntime-genai builder graphs; export --precision fp32|fp16|bf16 for TensorRT)")

# on a GPU machine with TensorRT: plans, GPU tests, a short bench, one JSON (docs/guide/gpu.md)
# (plans need standard graphs: the script exports the embedded pair in fp32 when ENGINES is int4/int8)
gpu-check: install
	bash scripts/gpu_check.sh bench_out/gpu_check.json

# the main job on the default pair: export, then generate on HumanEval prompts and print stats
demo: export
	$(BIN)/specrt generate --engines $(ENGINES) --max-new-tokens 96 --prompt "$$(head -1 $(PROMPTS) | $(BIN)/python -c 'import json,sys; print(json.load(sys.stdin)["prompt"], end="")')"
	$(BIN)/specrt bench --engines $(ENGINES) --prompts $(PROMPTS) --limit 20 --max-new-tokens 128 --out bench_out/demo.json

# ---- the real pair (issue 22): Qwen2.5-Coder-0.5B-Instruct drafting for 1.5B-Instruct Q4_K_M ----
# GGUF files from pinned registry packages (export/gguf_sources.json), cached in REAL_CACHE;
# converted (cached beside them), exported to REAL_ENGINES. docs/guide/real-pair.md
REAL_CACHE ?= $(HOME)/.cache/specrt/gguf
REAL_ENGINES ?= engines/qwen2.5-coder
REAL_DRAFT := $(REAL_CACHE)/qwen2.5-coder-0.5b-instruct.gguf
REAL_TARGET := $(REAL_CACHE)/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf
# 4096: the agent histories of make bench-agents reach 3,300 tokens
REAL_MAX_CTX ?= 4096

$(REAL_DRAFT) $(REAL_TARGET): | install
	@echo "real pair: 1.6 GB of GGUF from the package registry (28 wheels, each SHA-256-checked); 13.3 GB of disk in $(REAL_CACHE) and $(REAL_ENGINES) together; with the GGUF files fetched and converted already, 17.5 min on a 2-core Intel Xeon (measured 2026-12-03: docs/bench/real_pair/make_real_pair_2026-12-03.json); a first run also downloads and converts"
	$(BIN)/specrt fetch $(basename $(notdir $@)) --cache $(REAL_CACHE)

$(REAL_ENGINES)/manifest.json: $(REAL_DRAFT) $(REAL_TARGET) models/real_tuned_defaults.json
	$(BIN)/specrt export --draft $(REAL_DRAFT) --target $(REAL_TARGET) --out $(REAL_ENGINES) --k-max 8 --max-ctx $(REAL_MAX_CTX) \
		--precision $(PRECISION) --gguf-cache $(REAL_CACHE) --defaults models/real_tuned_defaults.json

# the real pair in one command: fetch (cached), convert (cached), export
real-pair: install $(REAL_ENGINES)/manifest.json

# the main job on the real pair: a HumanEval-style completion, a chat request through the chat template, a short bench
demo-real: real-pair
	$(BIN)/specrt generate --engines $(REAL_ENGINES) --max-new-tokens 96 --prompt "$$(sed -n 21p $(PROMPTS) | $(BIN)/python -c 'import json,sys; print(json.load(sys.stdin)["prompt"], end="")')"
	$(BIN)/specrt generate --engines $(REAL_ENGINES) --max-new-tokens 96 --chat --prompt "Write a Python function that checks whether a string is a palindrome."
	$(BIN)/specrt bench --engines $(REAL_ENGINES) --prompts $(PROMPTS) --limit 4 --max-new-tokens 64 --out bench_out/demo_real.json

# the comparison table of docs/results/real-pair.md in one interleaved, repeated run (about an hour):
# llama-server (best settings searched first), onnxruntime-genai, OpenVINO GenAI, transformers, specrt rows
REAL_BENCH_OUT ?= bench_out/real_pair
REAL_REPEATS ?= 2
bench-real: real-pair $(LL_VENV)/bin/llama-server $(OG_VENV)/.installed $(OV_VENV)/.installed
	$(BIN)/python -m specrt.bench.real --engines $(REAL_ENGINES) --repeats $(REAL_REPEATS) --threads $(THREADS) --out $(REAL_BENCH_OUT)

# coding-agent conversations, each turn the whole history: specrt prefix cache on/off vs llama-server
# and onnxruntime-genai (a new generator per request, or one kept and rewound)
# (docs/guide/prefix-cache.md)
AGENTS_OUT ?= bench_out/agents
bench-agents: real-pair $(LL_VENV)/bin/llama-server $(OG_VENV)/.installed
	$(BIN)/python -m specrt.bench.agents --engines $(REAL_ENGINES) --threads $(THREADS) --llama-server $(LL_VENV)/bin/llama-server --out $(AGENTS_OUT)

# speculative == target-only on the real pair (not CI: it needs `make real-pair`)
test-real: real-pair
	SPECRT_REAL_ENGINES=$(REAL_ENGINES) $(BIN)/python -m pytest -q -m real tests/test_real_pair.py

# ruff: lint and format check (configured in pyproject.toml)
lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# all tests (tiny random pairs + the default pair)
test: export
	$(BIN)/python -m pytest -q

# ---- the kernels' C under the compiler's checks (CI runs both: .ci/run) ----
KDIR := runtime/kernels/c
KUNITS := $(addprefix $(KDIR)/,api.c team.c types.c isa_portable.c isa_avx2.c isa_avx512.c)
# setup.py's flags (no -march: each isa_*.c names its own target) and its warnings, as errors here
KFLAGS := -std=gnu11 -ffp-contract=off -fno-fast-math -fvisibility=hidden -pthread -fPIC
KWARN := -Wall -Wextra -Wshadow -Werror
SAN_LIB := build/sanitize/_sk_sanitize.so
SANITIZE := -fsanitize=address,undefined,float-cast-overflow,pointer-overflow -fno-sanitize-recover=all -fno-omit-frame-pointer
KSTAMP = $(shell $(BIN)/python -c 'from specrt.runtime.kernels import source_hash; print(source_hash())')

# every translation unit compiled with -Wall -Wextra -Wshadow -Werror at -O3 (setup.py's level),
# and the C formatted as .clang-format says (clang-format from the [dev] extra)
lint-c: install
	@for f in $(KUNITS); do $(CC) -c $(KFLAGS) -O3 $(KWARN) -o /dev/null $$f || exit 1; done
	$(BIN)/clang-format --dry-run -Werror $(KDIR)/*.c $(KDIR)/*.h
	@echo "lint-c: $(words $(KUNITS)) translation units clean; clang-format clean"

# the kernels built with AddressSanitizer + UndefinedBehaviorSanitizer (any report fails the
# run), loaded instead of the installed build (SPECRT_KERNELS_LIB), through the kernels' tests:
# every ISA path this CPU runs (tests/test_kernels.py walks them), and the safety cases;
# --capture=sys: a sanitizer report (written to fd 2 as the process exits) reaches the log
test-sanitize: install
	@mkdir -p $(dir $(SAN_LIB))
	$(CC) -shared $(KFLAGS) $(KWARN) -O1 -g $(SANITIZE) -DSK_SOURCES='"$(KSTAMP)"' $(KUNITS) -lm -o $(SAN_LIB)
	LD_PRELOAD=$$($(CC) -print-file-name=libasan.so) ASAN_OPTIONS=detect_leaks=0:halt_on_error=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
	SPECRT_KERNELS_LIB=$(SAN_LIB) $(BIN)/python -m pytest -q -p no:cacheprovider --capture=sys tests/test_kernels.py tests/test_kernels_safety.py -k "not pytorch"

# full benchmark: 100 HumanEval prompts, 128 new tokens, interleaved; then the side-by-side comparison
bench: export
	$(BIN)/specrt bench --engines $(ENGINES) --prompts $(PROMPTS) --max-new-tokens 128 --out bench_out/bench.json
	$(MAKE) bench-compare

# optimum-onnx needs transformers < 4.58; onnxruntime-genai (+ its model builder) gets its own venv too
$(OPT_VENV)/.installed:
	$(PY) -m venv $(OPT_VENV)
	$(OPT_VENV)/bin/pip install -q --upgrade pip
	$(OPT_VENV)/bin/pip install -q $(PIP_FIND) torch==2.13.0 'transformers<4.58' optimum-onnx==0.1.0 onnxruntime==1.32.0
	touch $@

$(OG_VENV)/.installed:
	$(PY) -m venv $(OG_VENV)
	$(OG_VENV)/bin/pip install -q --upgrade pip
	$(OG_VENV)/bin/pip install -q $(PIP_FIND) torch==2.13.0 'transformers>=5,<6' onnxruntime-genai==0.18.0 onnxruntime==1.32.0 onnx onnx_ir
	touch $@

# OpenVINO GenAI + optimum-intel (optimum-cli export openvino --weight-format int4); torch==2.13.0
# CPU for the export, no torchvision
$(OV_VENV)/.installed:
	$(PY) -m venv $(OV_VENV)
	$(OV_VENV)/bin/pip install -q --upgrade pip
	$(OV_VENV)/bin/pip install -q $(PIP_FIND) torch==2.13.0 'optimum-intel[openvino]' openvino-genai nncf
	# optimum pulls a torchvision built for another torch, whose import then breaks the export
	$(OV_VENV)/bin/pip uninstall -y -q torchvision
	touch $@

# llama.cpp: llama-cpp-python built from its source package (torch + transformers for the
# convert_hf_to_gguf.py it ships), then the native llama-server built with cmake from the same
# source's vendor/llama.cpp
$(LL_VENV)/.installed:
	$(PY) -m venv $(LL_VENV)
	$(LL_VENV)/bin/pip install -q --upgrade pip
	$(LL_VENV)/bin/pip install -q $(PIP_FIND) torch==2.13.0 'transformers>=5,<6' sentencepiece protobuf numpy
	CMAKE_ARGS="$(LL_CMAKE)" $(LL_VENV)/bin/pip install -q --no-binary llama-cpp-python llama-cpp-python==$(LLAMA_CPP_PYTHON)
	touch $@

$(LL_SRC)/.unpacked: $(LL_VENV)/.installed
	$(LL_VENV)/bin/pip download -q --no-binary :all: --no-deps -d $(LL_VENV)/src llama-cpp-python==$(LLAMA_CPP_PYTHON)
	tar xzf $(LL_VENV)/src/llama_cpp_python-$(LLAMA_CPP_PYTHON).tar.gz -C $(LL_VENV)/src
	touch $@

$(LL_VENV)/bin/llama-server: $(LL_SRC)/.unpacked
	cmake -S $(LL_SRC)/vendor/llama.cpp -B $(LL_VENV)/src/build -G Ninja -DCMAKE_BUILD_TYPE=Release $(LL_CMAKE) \
		-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DCMAKE_C_FLAGS="$(NOAMX)" -DCMAKE_CXX_FLAGS="$(NOAMX)" -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON
	cmake --build $(LL_VENV)/src/build --target llama-server -j 2
	cp $(LL_VENV)/src/build/bin/llama-server $@

bench-envs: install $(OPT_VENV)/.installed $(OG_VENV)/.installed $(OV_VENV)/.installed $(LL_VENV)/bin/llama-server
	$(BIN)/pip install -q matplotlib py-spy

# specrt vs transformers (generate, assisted), optimum, onnxruntime-genai: table, JSON, plots in $(COMPARE_OUT)
# extra specrt flavors as rows, e.g. COMPARE_FLAVORS="--flavor fp32=engines/fp32" (export them first)
COMPARE_FLAVORS ?=
bench-compare: export bench-envs
	$(BIN)/python -m specrt.bench.compare --target models/target --draft models/draft --engines $(ENGINES) --prompts $(PROMPTS) \
		--max-new-tokens 128 --repeats $(REPEATS) --threads $(THREADS) --out $(COMPARE_OUT) $(COMPARE_FLAVORS)

# serving (docs/guide/serving.md): bounded loopback load runs against `specrt serve` on the default pair:
# /v1/completions, then /v1/chat/completions (the engine's chat template)
load-test: export
	$(BIN)/python -m specrt.bench.load --engines $(ENGINES) --workers 2 --threads 1 --requests 200 --concurrency 8 --max-tokens 64 --out bench_out/load.json
	$(BIN)/python -m specrt.bench.load --engines $(ENGINES) --workers 2 --threads 1 --requests 200 --concurrency 8 --max-tokens 64 --chat --out bench_out/load_chat.json

# scale-out: Ray Serve (own venv: ray is large) with 2 replicas of the default pair on 127.0.0.1, checked end to end
RAY_VENV ?= .venv-ray
# (re-installed when pyproject.toml changes: an editable install maps the packages it had then)
$(RAY_VENV)/.installed: pyproject.toml
	$(PY) -m venv $(RAY_VENV)
	$(RAY_VENV)/bin/pip install -q --upgrade pip
	$(RAY_VENV)/bin/pip install -q -e '.[serve,ray]' pytest
	touch $@

ray-check: export $(RAY_VENV)/.installed
	$(RAY_VENV)/bin/python scripts/ray_serve_check.py --engines $(ENGINES) --replicas 2 --out bench_out/ray_check.json

# re-train the default pair (about an hour on 2 cores; see models/README.md)
models: install
	$(BIN)/python scripts/train_default_pair.py --out models --target-steps 800 --draft-steps 400

clean:
	rm -rf $(ENGINES)/*.onnx $(ENGINES)/manifest.json $(ENGINES)/tokenizer.json bench_out

# kernel spike (spikes/kernel/README.md, docs/results/kernel-spike.md): a Q4_K/Q6_K matmul straight
# from the GGUF's blocks against onnxruntime's MatMulNBits and ggml's mul_mat, q = 1..9 (real target GGUF).
# ggml: the CPU library only, from the llama-cpp-python sdist, native ISA without AMX (AMX segfaults here)
KS_DIR := spikes/kernel
KS_BUILD := $(KS_DIR)/build
KS_LL := $(KS_BUILD)/llama_cpp_python-$(LLAMA_CPP_PYTHON)
KS_NOAMX := $(NOAMX)
KS_OUT ?= docs/bench/kernel_spike/intel_xeon_avx512vnni_amx.json
KS_REPS ?= 15

$(KS_BUILD)/libq4k.so: $(KS_DIR)/q4k.c
	mkdir -p $(KS_BUILD)
	gcc -O3 -march=native $(KS_NOAMX) -ffp-contract=off -fopenmp -shared -fPIC -Wall -o $@ $<

$(KS_LL)/.unpacked:
	mkdir -p $(KS_BUILD)
	$(BIN)/pip download -q --no-binary :all: --no-deps -d $(KS_BUILD) llama-cpp-python==$(LLAMA_CPP_PYTHON)
	tar xzf $(KS_BUILD)/llama_cpp_python-$(LLAMA_CPP_PYTHON).tar.gz -C $(KS_BUILD)
	touch $@

$(KS_BUILD)/ggml-build/bin/libggml-cpu.so: $(KS_LL)/.unpacked
	cmake -S $(KS_LL)/vendor/llama.cpp -B $(KS_BUILD)/ggml-build -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
		-DGGML_NATIVE=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DGGML_OPENMP=ON \
		-DCMAKE_C_FLAGS="$(KS_NOAMX)" -DCMAKE_CXX_FLAGS="$(KS_NOAMX)" \
		-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TOOLS=OFF \
		-DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF
	cmake --build $(KS_BUILD)/ggml-build --target ggml-cpu ggml -j 2

$(KS_BUILD)/libggml_harness.so: $(KS_DIR)/ggml_harness.c $(KS_BUILD)/ggml-build/bin/libggml-cpu.so
	gcc -O2 -shared -fPIC -o $@ $< -I$(KS_LL)/vendor/llama.cpp/ggml/include -L$(KS_BUILD)/ggml-build/bin \
		-lggml -lggml-base -lggml-cpu -Wl,-rpath,'$$ORIGIN/ggml-build/bin'

kernel-spike: $(KS_BUILD)/libq4k.so $(KS_BUILD)/libggml_harness.so
	$(BIN)/python $(KS_DIR)/bench.py --reps $(KS_REPS) --out $(KS_OUT)

.PHONY: kernel-spike
