# Every target creates the virtual environment it needs; nothing else has to be installed first.
PY      := .venv/bin/python
TORCHRUN:= .venv/bin/torchrun
STAMP   := .venv/.installed

.PHONY: setup run test bench notebooks clean

$(STAMP): requirements.txt
	python3 -m venv .venv
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	touch $(STAMP)

setup: $(STAMP)

# The main job (chapter 01 for now: 4 data-parallel CPU ranks).
run: $(STAMP)
	$(TORCHRUN) --nproc_per_node=4 01_data_parallel/train_dp.py --steps 200

# The whole test suite (CPU, gloo; under 10 minutes on 2 cores).
test: $(STAMP)
	$(PY) -m pytest -q tests

notebooks: $(STAMP)
	$(PY) -m jupytext --to ipynb notebooks/*.py

clean:
	rm -rf .venv runs .pytest_cache
