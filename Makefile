# Everything runs in a virtual environment at .venv with pinned dependencies.
# `make demo`: generate on the embedded default model, comparing `ar` with `anpd`.
# `make test`: the whole test suite (CI runs exactly this).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: demo test install clean

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

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
