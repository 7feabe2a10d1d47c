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

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
