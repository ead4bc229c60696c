# forge — the two entry points. Each creates .venv if missing and installs what it needs.
#   make demo   a real search on the default device (CUDA if present, else the Triton interpreter)
#   make test   ruff + the CPU test suite (GPU tests are skipped without CUDA)

VENV  ?= .venv
PY    := $(VENV)/bin/python
# The CPU build of torch 2.13.0 installs from local disk on our CPU machines; on a CUDA machine
# pass a CUDA build, e.g. `make demo TORCH='torch==2.11.*'`.
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.forge-installed
TEST_STAMP := $(VENV)/.forge-test-installed

.PHONY: demo test test-triton36 lint clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q '$(TORCH)'
	$(PY) -m pip install -q -e .
	touch $@

# The tests also need the dev tools, Ray (the --executor ray tests start a local Ray) and transformers
# (tests/test_trace_capture.py builds tiny Hugging Face models from configs).
$(TEST_STAMP): $(STAMP)
	$(PY) -m pip install -q -e '.[dev,ray,hf]'
	touch $@

demo: $(STAMP)
	@if $(PY) -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then \
	  $(VENV)/bin/forge search rmsnorm --shape 2048x4096 --dtype float16 --budget 50; \
	else \
	  echo "no CUDA GPU: searching with the Triton interpreter on the CPU at a small shape"; \
	  $(VENV)/bin/forge search rmsnorm --shape 64x1000 --dtype float16 --budget 12 --device cpu; \
	fi

lint: $(TEST_STAMP)
	$(VENV)/bin/ruff check .

test: lint
	$(PY) -m pytest -q

# The GPU machine runs triton 3.6; CI's main venv gets the newest triton. This runs the interpreter
# tests (every template, end-to-end searches, fault injection) once more on triton 3.6.
T36 := .venv-triton36
$(T36)/.forge-installed: pyproject.toml
	test -x $(T36)/bin/python || python3 -m venv $(T36)
	$(T36)/bin/python -m pip install -q '$(TORCH)' 'triton==3.6.0'
	$(T36)/bin/python -m pip install -q -e '.[dev]'
	touch $@

test-triton36: $(T36)/.forge-installed
	$(T36)/bin/python -m pytest -q tests/test_templates.py tests/test_any_dims.py tests/test_strided.py tests/test_search_e2e.py tests/test_faults.py tests/test_launch.py \
		tests/test_op_linear.py tests/test_op_swiglu.py tests/test_op_pointwise.py tests/test_torch_op.py \
		tests/test_op_add_norm.py tests/test_op_cat.py tests/test_screening.py tests/test_halving.py

clean:
	rm -rf $(VENV) $(T36) .pytest_cache .ruff_cache *.egg-info
