# The training image: torch + CUDA + NCCL, this package, the offline demo model and data.
#
#   docker build -t ddp-trainer:0.1.0 .
#   docker run --gpus all --shm-size=2g -v runs:/workspace/runs ddp-trainer:0.1.0   # the demo, every GPU
#   docker run --shm-size=2g ddp-trainer:0.1.0 torchrun --nproc-per-node=2 -m trainer train \
#       -c configs/demo.yaml output_dir=/workspace/runs/demo                       # on 2 CPU ranks
#
# Outputs go under /workspace (writable by the image's user); /app is read-only code and data.
#
# Base: the official PyTorch runtime image. Its torch is exactly the torch==2.13.0 of our
# requirements.lock, built for CUDA 13.0 with cuDNN 9 and its matching NCCL, so pip keeps it
# instead of fetching another 3 GB of CUDA wheels. It is also the image the Kubeflow Trainer's
# torch-distributed runtime uses, so a node that ran either has the big layers cached.
# For a reproducible build, pin the digest too: BASE_IMAGE=docker.io/pytorch/pytorch:2.13.0-...@sha256:<digest>
# Another base (a mirror, or the CPU base tests/image.py builds where no registry is reachable)
# must hold torch==2.13.0 for pip to keep: --build-arg BASE_IMAGE=...
ARG BASE_IMAGE=docker.io/pytorch/pytorch:2.13.0-cuda13.0-cudnn9-runtime
FROM ${BASE_IMAGE}
ARG BASE_IMAGE

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
    TORCHINDUCTOR_CACHE_DIR=/workspace/cache/torchinductor

# NCCL reaches InfiniBand and RoCE through the RDMA userspace libraries: libibverbs, its
# providers (mlx5, efa, ...) and librdmacm. The PyTorch base has none, so NCCL would fall back
# to TCP sockets without a word; `doctor` reports the transport it chose. ibverbs-utils gives
# `ibv_devinfo` to check the ports. Not the rdma-core package itself: it adds only daemons
# and udev rules, which a container does not run. Debian and Ubuntu name these alike.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends libibverbs1 ibverbs-providers librdmacm1 ibverbs-utils \
 && rm -rf /var/lib/apt/lists/*

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
 && python -m trainer.demo_data data/reviews \
 && useradd --uid 1000 --create-home --shell /usr/sbin/nologin trainer \
 && mkdir -p /workspace/cache /workspace/runs \
 && chown -R trainer:trainer /workspace \
 && ln -s /workspace/runs /app/runs

USER 1000:1000

# Plain `docker run --gpus all IMAGE` trains the demo on every local GPU (`gpu` refuses to start
# without one; on CPUs pass a command with --nproc-per-node=N).
# Clusters pass their own command: `torchrun [rendezvous flags] -m trainer train -c CONFIG`.
CMD ["torchrun", "--nproc-per-node=gpu", "-m", "trainer", "train", "-c", "configs/demo.yaml", "output_dir=/workspace/runs/demo"]
