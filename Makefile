# make demo: train the tiny demo model with both scripts and the classifier (CPU is enough); make test: the suite;
# make test-quick: its in-process tier, for the edit loop; make lint: ruff's checks (both tests run it first).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
DEMO_RANKS ?= 2
export HF_HUB_OFFLINE ?= 1
# on a machine without NVIDIA GPUs, tell DeepSpeed it is the CPU (it would guess so, and say it on every import)
export DS_ACCELERATOR ?= $(if $(shell command -v nvidia-smi),cuda,cpu)
DEEPSPEED := $(VENV)/bin/deepspeed --log_level error --num_gpus $(DEMO_RANKS)

.PHONY: demo test test-quick lint clean

$(VENV)/installed: requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned: a package that depends on torch must not pull another build
	$(PY) -m pip install -q torch==$$(sed -n 's/^torch==//p' requirements.txt)
	$(PY) -m pip install -q -r requirements.txt
	touch $@

demo: $(VENV)/installed
	$(PY) single-gpu.py --demo --batch-size 16 --output-dir out/demo-single-gpu --overwrite
	$(DEEPSPEED) zero-optimization.py --demo --zero-stage 3 --batch-size $$((16 / $(DEMO_RANKS))) \
		--output-dir out/demo-zero --overwrite
	$(DEEPSPEED) sequence_classification.py --demo --deepspeed ds_config_zero2.json \
		--output-dir out/demo-classification --overwrite
	@$(PY) -c 'from finetune.internals import demo; demo.summary("out/demo-single-gpu", "out/demo-zero", "out/demo-classification")'

$(VENV)/tests-installed: $(VENV)/installed tests/requirements.txt
	$(PY) -m pip install -q -r tests/requirements.txt
	# the DeepSpeed ops the suite's CPU runs load (the all-reduce over shared memory, the offload's Adam), compiled
	# here once (2 minutes on 2 cores) rather than inside the first test that needs each; with the venv's ninja, as the
	# tests have it first on PATH (a build log of another ninja makes the next build compile the op anew)
	@PATH="$(CURDIR)/$(VENV)/bin:$$PATH" DS_ACCELERATOR=cpu $(PY) -c 'import importlib, deepspeed.accelerator as a; \
		importlib.import_module("deepspeed.comm.torch").build_shm_op(); \
		a.get_accelerator().create_op_builder("CPUAdamBuilder").load()' >$(VENV)/ops-build.log 2>&1 \
		|| echo "could not build DeepSpeed's CPU ops (see $(VENV)/ops-build.log): the tests will try again"
	touch $@

# two files at a time (tests/conftest.py orders them); TEST_WORKERS=0 runs one test after another. The 15 slowest
# steps are listed at the end: where a new test's time goes
TEST_WORKERS ?= 2
test: lint
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15 tests

test-quick: lint
	$(PY) -m pytest -q -m quick tests

# ruff's checks and its format of tests/, bench/ and basics/ (pyproject.toml), a second and no test's time
lint: $(VENV)/tests-installed
	$(VENV)/bin/ruff check --quiet .
	$(VENV)/bin/ruff format --check --quiet tests bench basics

clean:
	rm -rf $(VENV) out .demo
