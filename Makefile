# make demo: train the tiny demo model with both scripts (CPU is enough); make test: the test suite.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
DEMO_RANKS ?= 2
export HF_HUB_OFFLINE ?= 1

.PHONY: demo test clean

$(VENV)/installed: requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned: a package that depends on torch must not pull another build
	$(PY) -m pip install -q torch==$$(sed -n 's/^torch==//p' requirements.txt)
	$(PY) -m pip install -q -r requirements.txt
	touch $@

demo: $(VENV)/installed
	$(PY) single-gpu.py --demo --batch-size 16 --output-dir out/demo-single-gpu --overwrite
	$(VENV)/bin/deepspeed --num_gpus $(DEMO_RANKS) zero-optimization.py --demo --zero-stage 3 \
		--batch-size $$((16 / $(DEMO_RANKS))) --output-dir out/demo-zero --overwrite
	$(PY) -c 'import common; common.compare_runs("out/demo-single-gpu", "out/demo-zero")'
	$(VENV)/bin/deepspeed --num_gpus $(DEMO_RANKS) sequence_classification.py --demo --deepspeed ds_config_zero2.json \
		--output-dir out/demo-classification --overwrite

test: $(VENV)/installed
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) out .demo
