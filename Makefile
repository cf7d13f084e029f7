# Every target creates the virtual environment it needs; nothing else has to be installed first.
PY      := .venv/bin/python
TORCHRUN:= .venv/bin/torchrun
STAMP   := .venv/.installed

.PHONY: setup run test bench overhead gpu-check gpu-efficiency notebooks lab-answers exercises grade bug museum wrong-answers copies clean

# The venv's own Jupyter kernel ("python3", installed inside .venv) runs the notebooks with the venv's
# Python, whatever other kernels the machine has.
# pip installs without byte-compiling, then compileall compiles the same files on every core (-j 0): the same
# .pyc files in less time on 2 cores (a fresh setup here, its packages in pip's cache: 50 s → 42 s). A file that does not compile is
# compiled again (and fails the same way) when imported, so compileall's own failures do not stop the setup.
$(STAMP): requirements.txt
	python3 -m venv .venv
	$(PY) -m pip install --quiet --no-compile -r requirements.txt
	$(PY) -m compileall -q -j 0 .venv/lib > /dev/null || true
	$(PY) -m ipykernel install --prefix .venv --name python3 --display-name "Python 3 (.venv)" > /dev/null
	touch $(STAMP)

setup: $(STAMP)

# The main job: the full DP×TP×PP run on 8 ranks (CPU, or one GPU per rank), then its loss curve.
run: $(STAMP)
	$(TORCHRUN) --nproc_per_node=8 04_3d_combined/train_3d.py --metrics runs/3d/metrics.jsonl
	$(PY) 04_3d_combined/plot_loss.py runs/3d/metrics.jsonl

# The whole test suite (CPU, gloo; about 7 to 8 minutes on 2 cores from a fresh clone, setup included). Three
# workers on two cores: part of a test's time is spent waiting (ranks starting, messages between ranks that
# share the cores, a killed rank's peers timing out), which another fills; every rank takes one thread
# (tests/conftest.py). A fourth worker only crowds the cores (two paired runs in one clone here: -n 4 427 s and
# 442 s, -n 3 407 s and 421 s). Each worker takes a whole file at a time (its tests share their spawned groups), the
# longest files first (tests/conftest.py's LONGEST_FIRST: --no-loadscope-reorder keeps that order, where
# pytest-xdist would hand out the files with the most tests first, whatever their time). `make test CHAPTER=03`:
# one chapter's tests
# (01 … 07, or common: tests/conftest.py maps each test file to its chapter, each notebook by its name).
test: $(STAMP)
	$(PY) -m pytest -q -n 3 --dist loadfile --no-loadscope-reorder $(if $(filter-out all,$(CHAPTER)),--chapter $(CHAPTER)) tests

# Every chapter's benchmark, one after another (about 39 minutes on 2 cores: 2½ + 2½ + 5 + 2 + 1 + 2½ + 4 + 4½ + 10 + 5);
# each writes the tables (and plots) under its chapter's results/ that the READMEs show.
bench: $(STAMP)
	$(PY) 01_data_parallel/bench_dp.py
	$(PY) 01_data_parallel/bench_zero.py
	$(PY) 02_tensor_parallel/bench_tp.py
	$(PY) 03_pipeline_parallel/bench_pp.py
	$(PY) 03_pipeline_parallel/bubble_pp.py --pp 2 4
	$(PY) 03_pipeline_parallel/breakdown_pp.py
	$(PY) 04_3d_combined/bench_3d.py
	$(PY) 05_moe_expert_parallel/bench_4d.py
	$(PY) 05_moe_expert_parallel/bench_moe.py
	$(PY) 06_context_parallel/bench_cp.py

# The trainer's own cost: each chapter's script at world size 1 against a plain loop on the same model
# (results/overhead.md; about 6 minutes on 2 cores).
overhead: $(STAMP)
	$(PY) -m common.bench_overhead

# Every script on one GPU (fp32, bf16), then MFU with and without --compile: results/gpu_check.md. Needs no
# setup (a GPU machine's own Python with PyTorch and rich will do); without CUDA it says so and exits 0,
# without PyTorch it says so in one line and exits 1.
GPU_PY := $(if $(wildcard $(PY)),$(PY),python3)
gpu-check:
	$(GPU_PY) common/gpu_check.py

# A GPU's own device file for chapter 07's planner (its matmul rate by size, fused attention, copy bandwidth):
# 07_choosing_a_layout/devices/<gpu>-measured.json; `make gpu-efficiency GPUS=8` also measures NCCL all-reduces
# among a node's 8 GPUs (the links' efficiency and latency). Without CUDA it says so and exits 0; without
# PyTorch it says so in one line and exits 1.
gpu-efficiency:
	$(if $(GPUS),$(GPU_PY) -m torch.distributed.run --nproc_per_node=$(GPUS),$(GPU_PY)) 07_choosing_a_layout/gpu_efficiency.py

# Each notebooks/*.py (jupytext percent format) becomes notebooks/*.ipynb, executed through the kernel
# so it opens with its outputs and plots; the plots are also saved as PNGs under notebooks/figures/.
notebooks: $(STAMP)
	$(PY) -m jupytext --to ipynb --set-kernel python3 notebooks/*.py
	.venv/bin/jupyter nbconvert --to notebook --execute --inplace notebooks/*.ipynb

# Each chapter's instructor answer key, LAB_ANSWERS.md, rebuilt from real runs of its lab's commands.
lab-answers: $(STAMP)
	for key in 0*/lab_answers.py; do $(PY) $$key || exit 1; done

# Exercise mode (common/exercises): a student copy of the course with one chapter's marked bodies
# removed (CHAPTER=01 … 07 or all), and its grader: one verdict line per exercise, exit 0 when all are
# done. REPO= grades a copy with this checkout's environment (a copy has no .venv of its own).
CHAPTER ?= all
exercises: $(STAMP)
	$(if $(OUT),,$(error name the new copy's folder: make exercises CHAPTER=02 OUT=dir))
	$(PY) -m common.exercises make --chapter $(CHAPTER) --out $(OUT)

grade: $(STAMP)
	$(PY) -m common.exercises grade --chapter $(CHAPTER) $(if $(REPO),--repo $(REPO))

# The museum of real bugs: `make bug ID=06.bug1 OUT=../bug` plants one in a copy of the course
# (`make bug` alone lists them); `make museum` plants each in turn and runs the tests that must catch it,
# writing common/exercises/MUSEUM.md (about 4 minutes on 2 cores, 17 bugs: 230 s of tests plus the copies).
bug: $(STAMP)
	$(PY) -m common.exercises bug $(if $(ID),$(ID) --out $(OUT),list)

museum: $(STAMP)
	$(PY) -m common.exercises bug --check

# Each realistic wrong answer that common/exercises/catalog.py lists, written into a copy and graded: every
# one must read `wrong:`; then every exercise written in the LABs' order, each `done` as soon as it is written.
# Writes common/exercises/WRONG_ANSWERS.md (the time of each is in it).
wrong-answers: $(STAMP)
	$(PY) -m common.exercises wrong --check

# A fresh student copy of each chapter (CHAPTER=NN for one) against that chapter's own tests: a table of what
# passes and what fails on an open exercise (its stub's NotImplementedError); exit 1 if a test fails otherwise.
copies: $(STAMP)
	$(PY) -m common.exercises copies --chapter $(or $(CHAPTER),all)

clean:
	rm -rf .venv runs .pytest_cache
