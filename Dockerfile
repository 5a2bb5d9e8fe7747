# The training image: torch + CUDA + NCCL, this package, the offline demo model and data.
#
#   docker build -t ddp-trainer:0.1.0 .
#   docker run --gpus all --shm-size=2g -v runs:/workspace/runs ddp-trainer:0.1.0   # the demo, every GPU
#   docker run --shm-size=2g ddp-trainer:0.1.0 python -m trainer.cli.torchrun --nproc-per-node=2 -m trainer train \
#       -c configs/demo.yaml output_dir=/workspace/runs/demo                       # on 2 CPU ranks
#
# Outputs go under /workspace (writable by the image's user); /app is read-only code and data.
#
# Base: the official PyTorch runtime image. Its torch is exactly the torch==2.13.0 of our
# requirements.lock, built for CUDA 13.0 with cuDNN 9 and its matching NCCL, so pip keeps it
# instead of fetching another 3 GB of CUDA wheels. It is also the image the Kubeflow Trainer's
# torch-distributed runtime uses, so a node that ran either has the big layers cached.
# For a reproducible build, pin the digest too: BASE_IMAGE=docker.io/pytorch/pytorch:2.13.0-...@sha256:<digest>
# Another base (a mirror, an NGC image, or the CPU base tests/support/image.py builds where no registry
# is reachable) must hold torch==2.13.0 for pip to keep: --build-arg BASE_IMAGE=... (and
# MIN_CUDA_DRIVER=, the driver its CUDA needs).
ARG BASE_IMAGE=docker.io/pytorch/pytorch:2.13.0-cuda13.0-cudnn9-runtime
FROM ${BASE_IMAGE}
ARG BASE_IMAGE
# The oldest host driver the base's CUDA runs on: CUDA 13.0 needs the 580 branch, from
# 580.65.06, its GA driver (NVIDIA's CUDA 13.0 release notes, table "CUDA Toolkit and
# Corresponding Driver Versions"). On an older driver torch finds no usable GPU; `doctor`
# names the cause by comparing the host's driver with TRAINER_MIN_CUDA_DRIVER. A base with
# another CUDA needs its own value.
ARG MIN_CUDA_DRIVER=580.65.06

LABEL org.opencontainers.image.title="ddp-trainer" \
      org.opencontainers.image.description="Multi-node DDP fine-tuning of Hugging Face sequence classifiers under torchrun, Slurm and Kubernetes" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.base.name="${BASE_IMAGE}"

# Writable state lives under /workspace: mount a volume there (the compose file and the
# Kubernetes PVC do) so checkpoints, the HF cache and wandb runs outlive the container.
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HOME=/workspace/cache/huggingface \
    WANDB_DIR=/workspace/wandb \
    WANDB_CACHE_DIR=/workspace/cache/wandb \
    WANDB_CONFIG_DIR=/workspace/cache/wandb-config \
    TRITON_CACHE_DIR=/workspace/cache/triton \
    TORCHINDUCTOR_CACHE_DIR=/workspace/cache/torchinductor \
    XDG_CACHE_HOME=/workspace/cache \
    MPLCONFIGDIR=/workspace/cache/matplotlib \
    CUDA_CACHE_PATH=/workspace/cache/cuda \
    TRAINER_MIN_CUDA_DRIVER=${MIN_CUDA_DRIVER}

# NCCL reaches InfiniBand and RoCE through the RDMA userspace libraries: libibverbs, its
# providers (mlx5, efa, ...) and librdmacm. The PyTorch base has none, so NCCL would fall back
# to TCP sockets without a word; `doctor` reports the transport it chose. ibverbs-utils gives
# `ibv_devinfo` to check the ports. Not the rdma-core package itself: it adds only daemons
# and udev rules, which a container does not run. Debian and Ubuntu name these alike.
# tini is the init (PID 1) of `docker run` and compose: it forwards SIGTERM to torchrun, which
# as PID 1 would ignore it until it sets its own handlers (so a stop during the rendezvous
# waits for the SIGKILL), and it reaps the orphans DataLoader workers and compilers leave.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends libibverbs1 ibverbs-providers librdmacm1 ibverbs-utils tini \
 && rm -rf /var/lib/apt/lists/*

# The image's user: uid and gid 1000, named trainer, owning /workspace. Ubuntu 24.04, and so
# the NGC images a BASE_IMAGE may be, already has user and group `ubuntu` at 1000, where
# `useradd --uid 1000` fails: whatever holds 1000 is renamed to trainer, and created if absent.
RUN if group="$(getent group 1000)"; then groupmod --new-name trainer "${group%%:*}"; \
    else groupadd --gid 1000 trainer; fi \
 && if user="$(getent passwd 1000)"; then \
      usermod --login trainer --gid 1000 --home /home/trainer --move-home --shell /usr/sbin/nologin "${user%%:*}"; \
    else useradd --uid 1000 --gid 1000 --create-home --shell /usr/sbin/nologin trainer; fi \
 && mkdir -p /workspace/cache /workspace/runs \
 && chown -R 1000:1000 /workspace

WORKDIR /app

# Dependencies first, from the same lock file as `make install`: this layer is rebuilt only
# when pyproject.toml or requirements.lock change, not on every code edit. The stub package
# lets pip resolve the project's dependencies without its sources.
COPY pyproject.toml requirements.lock ./
RUN mkdir trainer && touch trainer/__init__.py \
 && pip install -c requirements.lock . \
 && pip uninstall -y trainer && rm -rf trainer build trainer.egg-info

COPY trainer/ trainer/
COPY configs/ configs/
# runs/ -> /workspace/runs: every shipped config's relative `output_dir: runs/...` lands on
# the writable volume, never in /app, which the image's user cannot write.
RUN pip install --no-deps -c requirements.lock . \
 && rm -rf build trainer.egg-info \
 && python -m trainer.data.demo data/reviews \
 && ln -s /workspace/runs /app/runs

USER 1000:1000

ENTRYPOINT ["tini", "--"]
# Plain `docker run --gpus all IMAGE` trains the demo on every local GPU (`gpu` refuses to start
# without one; on CPUs pass a command with --nproc-per-node=N). trainer.cli.torchrun is torchrun,
# same arguments, whose exit code says what happened and whether to retry (docs/restarts.md).
# Clusters pass their own command: `python -m trainer.cli.torchrun [rendezvous flags] -m trainer train -c CONFIG`.
CMD ["python", "-m", "trainer.cli.torchrun", "--nproc-per-node=gpu", "-m", "trainer", "train", "-c", "configs/demo.yaml", \
     "output_dir=/workspace/runs/demo"]
