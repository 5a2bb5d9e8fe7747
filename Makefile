# Two commands on a fresh machine:
#   make demo   create .venv and run the offline demo (2 CPU ranks; 46 s once .venv exists)
#   make test   create .venv and run the whole test suite: tests/unit, tests/e2e, tests/system (root)
# and the inner loop of a change:
#   make test-unit   create .venv and run tests/unit (in process, under a minute, no root)
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1

.PHONY: install system image-base demo test test-unit test-cpu-bound test-waiting test-benchmarks lint bench kill-drill clean

install: $(VENV)/.installed

# Every version comes from requirements.lock (a constraints file), here and in the Dockerfile.
$(VENV)/.installed: pyproject.toml requirements.lock
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -c requirements.lock -e '.[dev]'
	touch $@

data/reviews/train.jsonl: trainer/data/demo.py | install
	$(BIN)/python -m trainer.data.demo data/reviews

demo: install data/reviews/train.jsonl
	rm -rf runs/demo
	$(BIN)/torchrun --standalone --nproc-per-node=2 -m trainer train -c configs/demo.yaml

# The venv (pip) and the system tools (apt) install side by side: each mostly waits on downloads.
# Then the lint and two pytest sessions run side by side, make failing if any fails
# (--output-sync prints each one's report whole, when it ends). The system tier mostly waits (on
# the Slurm scheduler, the image build, containers, rendezvous timeouts: about 1.1 of 2 cores
# busy when alone), so its session also takes the e2e files in E2E_BESIDE_SYSTEM, which wait
# too (on timeouts, a hung rank's end); the other session is the unit tier and the rest of e2e.
# (At b052dbb the sessions took 1,226 s and 1,415 s with test_gpu_check, 74 s of CPU in 78 s,
# beside the system tier: it is in the other session now.)
E2E_BESIDE_SYSTEM := tests/e2e/test_no_hang.py
# Every benchmark driver's smoke mode (tests/e2e/test_benchmarks.py) is not in `make test`: 8.5
# minutes of tiny launches on 2 cores (509 s beside the system tier, 2026-11-29), which would
# take the suite past its 20 minutes. `make test-benchmarks` runs it.
NOT_IN_TEST := tests/e2e/test_benchmarks.py

# The trainer's bytecode is compiled once, here: where PYTHONDONTWRITEBYTECODE is set (CI's
# environment sets it) no process writes it, and each of the suite's fresh interpreters (a
# Slurm job's ranks, a sweep's trials, a restarted node's ranks) compiled the trainer's
# modules again: importing them took 0.35 s, against 0.10 s from bytecode.
# The image tests' CPU base (debootstrap, a wheelhouse, torch installed in it: minutes on a
# fresh machine, then cached per lock) is built beside pip, which keeps one core busy of two;
# a failure here is the system session's to report, which tries the build again.
test:
	$(MAKE) --no-print-directory -j3 install system image-base
	$(BIN)/python -m compileall -q trainer
	$(MAKE) --no-print-directory -j3 --output-sync=target lint test-cpu-bound test-waiting

image-base: system
	-cd tests && $(PYTHON) -m support.image --base

test-cpu-bound: install
	$(BIN)/python -m pytest tests/unit tests/e2e $(addprefix --ignore=,$(E2E_BESIDE_SYSTEM) $(NOT_IN_TEST))

test-waiting: install system
	$(BIN)/python -m pytest tests/system $(E2E_BESIDE_SYSTEM)

test-benchmarks: install
	$(BIN)/python -m pytest $(NOT_IN_TEST)

# ruff (lint and import order) over trainer/, tests/ and docs/, and mypy over trainer/, as
# configured in pyproject.toml; the pre-commit hooks (.pre-commit-config.yaml) run the same.
lint: install
	$(BIN)/ruff check trainer tests docs
	$(BIN)/mypy

# No `system` step and nothing that needs root: the unit tier never builds the image either.
test-unit: install
	$(BIN)/python -m pytest tests/unit

# The Slurm tests start a real cluster from Debian's slurm-wlm and munge (root, no systemd); the
# image tests build our Dockerfile with buildah on a debootstrap base and run it with podman (runc).
SYSTEM_TOOLS := slurmctld munged buildah podman runc debootstrap
system:
	@for tool in $(SYSTEM_TOOLS); do command -v $$tool >/dev/null || missing=1; done; [ -z "$$missing" ] || { \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	    slurm-wlm munge buildah podman runc debootstrap >/dev/null; }

# Not part of `make test`: ~17 minutes on 2 CPUs, and wants a quiet machine. Flags: ARGS="--reps 5",
# ARGS="--ablations --name cpu-minilm-ablations" (each speed feature off and on, ~18 minutes)
bench: install
	$(BIN)/python -m benchmarks $(ARGS)

# Not part of `make test` either: 20 random SIGKILL points on two nodes (~10 minutes, root).
kill-drill: install
	$(BIN)/python tests/support/kill_drill.py --points 20

clean:
	rm -rf runs data .pytest_cache
