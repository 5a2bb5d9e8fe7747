# Two commands on a fresh machine:
#   make demo   create .venv and run the offline demo (2 CPU ranks, ~3 minutes)
#   make test   create .venv and run the whole test suite
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1

.PHONY: install slurm demo test bench kill-drill clean

install: $(VENV)/.installed

# Every version comes from requirements.lock (a constraints file), here and in the Dockerfile.
$(VENV)/.installed: pyproject.toml requirements.lock
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -c requirements.lock -e '.[dev]'
	touch $@

data/reviews/train.jsonl: trainer/demo_data.py | install
	$(BIN)/python -m trainer.demo_data data/reviews

demo: install data/reviews/train.jsonl
	rm -rf runs/demo
	$(BIN)/torchrun --standalone --nproc-per-node=2 -m trainer train -c configs/demo.yaml

# The venv (pip) and Slurm (apt) install side by side: each mostly waits on downloads.
test:
	$(MAKE) --no-print-directory -j2 install slurm
	$(BIN)/python -m pytest

# The Slurm tests start a real cluster from Debian's slurm-wlm and munge (root, no systemd).
slurm:
	@command -v slurmctld >/dev/null && command -v munged >/dev/null || { \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	    slurm-wlm munge >/dev/null; }

# Not part of `make test`: ~17 minutes on 2 CPUs, and wants a quiet machine. Flags: ARGS="--reps 5",
# ARGS="--ablations --name cpu-minilm-ablations" (each speed feature off and on, ~18 minutes)
bench: install
	$(BIN)/python -m benchmarks $(ARGS)

# Not part of `make test` either: 20 random SIGKILL points on two nodes (~10 minutes, root).
kill-drill: install
	$(BIN)/python tests/kill_drill.py --points 20

clean:
	rm -rf runs data .pytest_cache
