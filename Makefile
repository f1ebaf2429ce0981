# Two entry points for a fresh machine: `make demo` and `make test`. Both create .venv and
# install everything they need (torch, the package, test tools) on first use.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# CPU machines get the CPU build (pip finds torch==2.13.0 on this workplace's disk; elsewhere set
# TORCH_SPEC or TORCH_INDEX, e.g. TORCH_INDEX=--index-url=https://download.pytorch.org/whl/cpu).
TORCH_SPEC  ?= torch==2.13.0
TORCH_INDEX ?=
STAMP  := $(VENV)/.mdtk-installed

export TORCH_EXTENSIONS_DIR := $(CURDIR)/build/torch_extensions
export PYTHONUNBUFFERED := 1

.PHONY: demo test lint install clean gpu-check gpu-wheels

install: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -m pip install -q --upgrade pip >/dev/null 2>&1 || true
	@# Leave an existing torch (e.g. a CUDA build) alone; otherwise CUDA machines get the default
	@# wheel and CPU machines the CPU build. pip compiles the bytecode here (~40 s): with
	@# --no-compile, a machine that sets PYTHONDONTWRITEBYTECODE would compile torch at every
	@# process start (import torch 3.2 s instead of 1.4 s), and the tests start hundreds.
	@if $(PY) -c "import torch" >/dev/null 2>&1; then \
	    echo "torch already installed: $$($(PY) -c 'import torch; print(torch.__version__)')"; \
	elif command -v nvidia-smi >/dev/null 2>&1; then \
	    $(PY) -m pip install -q torch; \
	else \
	    $(PY) -m pip install -q $(TORCH_INDEX) "$(TORCH_SPEC)"; \
	fi
	@$(PY) -m pip install -q -e ".[test]"
	@bash scripts/install_libaio.sh || true
	@# DeepSpeed's CPU ops, built once in one process, not by racing ranks: CPU Adam now; async_io
	@# (NVMe offload, ~3 min on 2 cores) in the background at low priority, so that the tests or
	@# the demo start at once; the first NVMe user waits on its build lock (toolkit/runtime/ops.py).
	@$(PY) -m toolkit.runtime.ops cpu_adam || echo "warning: DeepSpeed CPU Adam unavailable; optimizer offload will not run"
	@mkdir -p build && nohup nice -n 19 $(PY) -m toolkit.runtime.ops async_io >build/async_io-build.log 2>&1 </dev/null &
	@touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/mdtk demo

test: $(STAMP)
	$(PY) -m pytest -q -ra

# On a GPU machine (one H100 / H200): every GPU claim measured in one run of under 8 minutes
# (docs/benchmarks.md, "GPU check"); `make gpu-check ARGS=--dry-run` plans it on a CPU. A GPU
# machine without a package index gets the lock's wheels from `make gpu-wheels`, run where pip
# works (the folder .whl travels with the checkout).
GPU_PY        ?= $(if $(wildcard $(PY)),$(PY),python3)
GPU_CHECK_OUT ?= build/gpu-check
gpu-check:
	$(GPU_PY) scripts/gpu_check.py $(GPU_CHECK_OUT) $(if $(wildcard .whl/*.whl),--wheels .whl) $(ARGS)

gpu-wheels: $(STAMP)
	$(PY) scripts/gpu_check.py --prepare-wheels .whl

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) build .pytest_cache
