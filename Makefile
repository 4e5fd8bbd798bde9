# The two commands of the README. Each creates .venv when missing and installs what it needs.
# On a machine without an NVIDIA GPU, torch is pinned to the CPU build (2.13.0) and every later
# pip call is held to it, so no CUDA torch is pulled in. With a GPU, the torch already in the
# environment (or pip's default CUDA build) is kept.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.oppo-installed
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
CPU_TORCH := torch==2.13.0
# PyPI's Linux torch wheel pulls CUDA libraries (gigabytes): the CPU build comes from torch's own
# index, asked beside pip's when it answers (a machine without it, offline with a local mirror
# of CPU wheels, installs the pin from what pip's configuration has)
CPU_TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
CONSTRAINTS := $(VENV)/constraints.txt

.PHONY: demo test bench install clean-cache gpu-wheels

$(STAMP): setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
ifeq ($(HAS_GPU),1)
	$(PIP) install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q torch
	$(PY) -c "import torch; print('torch==' + torch.__version__)" > $(CONSTRAINTS)
else
	if $(PY) -c "import urllib.request as u; u.urlopen('$(CPU_TORCH_INDEX)/torch/', timeout=10)" \
		2>/dev/null; then \
		$(PIP) install -q "$(CPU_TORCH)" --extra-index-url "$(CPU_TORCH_INDEX)"; \
	else \
		$(PIP) install -q "$(CPU_TORCH)"; \
	fi
	echo "$(CPU_TORCH)" > $(CONSTRAINTS)
endif
	DS_BUILD_OPS=0 $(PIP) install -q -c $(CONSTRAINTS) -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

# The main job on the built-in workload: prepare (SFT actor + reward model, cached), then PPO.
demo: $(STAMP)
	$(PY) -m oppo_ds.train --config examples/configs/tiny.yaml

# --durations: the slowest tests at the end of every run (CI logs keep them: the suite's 60
# minutes are a budget, and its time has moved between machines).
# TEST_JOBS pytest workers (pytest-xdist), each given whole files (--dist loadfile: a module's
# fixtures, such as the Slurm test's controller, exist once), each at one OpenMP thread.
# Measured on 2 cores: 2 workers at one thread ran the suite in 31.5 min against 52.8 min for
# one process; 2 workers at 2 threads each were 3.2x slower than one process (idle threads
# spinning on busy cores). `make test TEST_JOBS=1` runs it in one worker. TEST_THREADS sets each
# worker's OpenMP threads (OMP_NUM_THREADS; 1 by default whatever the environment says: with
# more cores than workers, cores / TEST_JOBS).
# PYTHONDONTWRITEBYTECODE, where the environment sets it, is cleared for the suite: every
# process the tests launch (ranks, launchers, CLIs) would compile oppo_ds from source again
# (0.8 s of a 4.4 s import on this VM); the bytecode goes to oppo_ds/__pycache__ (git-ignored).
TEST_JOBS ?= 2
TEST_THREADS ?= 1
test: $(STAMP)
	PYTHONDONTWRITEBYTECODE= OMP_NUM_THREADS=$(TEST_THREADS) $(PY) -m pytest tests -q -n $(TEST_JOBS) \
		--dist loadfile --durations=25

# Every mode and the TRL 1.12 PPO peer on the built-in workload, one after another (about
# 5 minutes on 2 CPU cores once the workload is prepared): bench/results.json, results.md,
# plots.png (reward and gold against samples and time, step time by phase) and
# plots-timeline.png (one step per mode, lanes as in the paper's Figure 1).
# BENCH_REPEAT=3 runs every mode 3 times round-robin and reports medians over the rounds
# (single runs on a shared machine vary by 20-50%; docs/benchmarks.md).
BENCH_STEPS ?= 100
BENCH_REPEAT ?= 1
bench: $(STAMP)
	$(PY) -m oppo_ds.cli.bench --modes sequential,intra,inter,oppo --peers trl \
		--steps $(BENCH_STEPS) --repeat $(BENCH_REPEAT) --json bench/results.json \
		--table bench/results.md --plot bench/plots.png

# Wheels for a GPU machine without deepspeed or a registry (tools/gpu_session.sh installs them
# there): deepspeed (pure Python) and its dependencies the image may lack, for PYVER's Python.
PYVER ?= 3.12
GPU_WHEELS ?= .whl
gpu-wheels: $(STAMP)
	$(PIP) wheel -q --no-deps -w $(GPU_WHEELS) "deepspeed==$$($(PY) -c 'from importlib.metadata import version; print(version("deepspeed"))')"
	$(PIP) download -q --only-binary=:all: --python-version $(PYVER) --implementation cp \
		--platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d $(GPU_WHEELS) \
		pydantic hjson py-cpuinfo msgpack ninja psutil einops pytest
	# the TRL peer (the image has accelerate, pandas, pyarrow, xxhash; not these)
	$(PIP) download -q --no-deps --only-binary=:all: --python-version $(PYVER) --implementation cp \
		--platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d $(GPU_WHEELS) \
		"trl==$$($(PY) -c 'from importlib.metadata import version; print(version("trl"))')" \
		"datasets==$$($(PY) -c 'from importlib.metadata import version; print(version("datasets"))')" \
		dill multiprocess

clean-cache:
	rm -rf .cache/oppo-builtin
