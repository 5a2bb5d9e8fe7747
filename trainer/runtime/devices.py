"""This process's device and compute: the device a launch may use (and the driver it needs),
the precision, the CPU threads and deterministic kernels, all decided before a process group
or a model exists.
"""

from __future__ import annotations

import logging
import os
import platform
import re
from collections.abc import Mapping
from pathlib import Path

import torch

from trainer.config.schema import TrainConfig
from trainer.errors import ConfigError, LaunchError
from trainer.runtime.environment import DistEnv

log = logging.getLogger(__name__)


def granted_gpus(environ: Mapping[str, str] = os.environ) -> str | None:
    """The variable that shows the scheduler or container runtime granted this job GPUs,
    as `NAME=value`, or None. Slurm sets SLURM_GPUS_ON_NODE and CUDA_VISIBLE_DEVICES for
    a GPU allocation; the NVIDIA container runtime reads NVIDIA_VISIBLE_DEVICES (CUDA
    images set it to `all`); `void`, `none`, empty or -1 mean none."""
    slurm = environ.get("SLURM_GPUS_ON_NODE", "").strip()
    if slurm.isdigit() and int(slurm) > 0:
        return f"SLURM_GPUS_ON_NODE={slurm}"
    for name, none in (("CUDA_VISIBLE_DEVICES", {"", "-1", "nodevfiles"}),
                       ("NVIDIA_VISIBLE_DEVICES", {"", "void", "none"})):
        value = environ.get(name)
        if value is not None and value.strip().lower() not in none:
            return f"{name}={value}"
    return None


CUDA_DRIVER_FLOOR = {"12": "525.60.13", "13": "580.65.06"}
"""The oldest Linux driver each CUDA major version runs on (NVIDIA's minor version
compatibility); TRAINER_MIN_CUDA_DRIVER, which the image sets for its base, wins."""


def nvidia_driver(version_file: Path = Path("/proc/driver/nvidia/version")) -> str | None:
    """The host's NVIDIA kernel driver version (a container sees the host's), or None."""
    try:
        found = re.search(r"Kernel Module(?: for \S+)?\s+(\d+(?:\.\d+)+)", version_file.read_text())
    except OSError:
        return None
    return found.group(1) if found else None


def driver_check(driver: str | None, environ: Mapping[str, str] = os.environ) -> tuple[str, str | None]:
    """(a line on `driver` and the CUDA torch is built for, why it is too old or None)."""
    cuda = torch.version.cuda
    if driver is None or cuda is None:
        return ("no NVIDIA driver" if driver is None else f"NVIDIA driver {driver}, CPU-only torch"), None
    floor = environ.get("TRAINER_MIN_CUDA_DRIVER") or CUDA_DRIVER_FLOOR.get(cuda.split(".")[0])
    line = f"NVIDIA driver {driver}, torch built for CUDA {cuda}" + (f" (needs {floor} or newer)" if floor else "")
    def parts(version: str) -> tuple[int, ...]:
        return tuple(int(n) for n in version.split("."))
    if floor and parts(driver) < parts(floor):
        return line, (f"the NVIDIA driver {driver} is older than {floor}, the oldest CUDA {cuda} runs on: upgrade "
                      "the nodes' driver, or use a torch (an image) built for an older CUDA")
    return line, None


def _no_usable_cuda(why_gpus: str) -> LaunchError:
    _, old_driver = driver_check(nvidia_driver())
    build = (f"torch {torch.__version__} is built for CUDA {torch.version.cuda} (is the driver older, or "
             "was the container started without --gpus / --nv?)" if torch.version.cuda
             else f"torch {torch.__version__} is a CPU-only build (torch.version.cuda is None)")
    if old_driver:
        build = old_driver
    return LaunchError(
        f"train.device: {why_gpus}, but torch.cuda.is_available() is False: {build}; "
        "to train on CPU on purpose, set train.device=cpu dist.backend=gloo"
    )


def pick_device(dist_env: DistEnv, backend: str, device_choice: str = "auto",
                environ: Mapping[str, str] = os.environ) -> tuple[torch.device, str]:
    """The device for this rank and the collective backend, checked before the process group.

    Never a silent fall back to the CPU: a job granted GPUs that CUDA cannot use would train
    hundreds of times slower on gloo. Training on CPU there takes train.device=cpu.
    """
    if device_choice == "cpu":
        if backend == "nccl":
            raise ConfigError("dist.backend: nccl needs GPUs, and train.device is cpu; use gloo or auto")
        return torch.device("cpu"), "gloo"
    has_cuda = torch.cuda.is_available()
    if not has_cuda:
        granted = granted_gpus(environ)
        if granted:
            raise _no_usable_cuda(f"{granted} grants this job GPUs")
        if device_choice == "cuda":
            raise _no_usable_cuda("cuda")
    if backend == "auto":
        backend = "nccl" if has_cuda else "gloo"
    if backend == "nccl" and not has_cuda:
        raise ConfigError("dist.backend: nccl needs CUDA, and no GPU is visible; use gloo or auto")
    if not has_cuda:
        return torch.device("cpu"), backend
    visible = torch.cuda.device_count()
    if dist_env.local_rank >= visible:
        if backend == "gloo":
            # gloo all-reduces CUDA tensors through host memory, so ranks may share a GPU
            # (a one-GPU workstation testing a multi-rank job): an explicit choice.
            return torch.device("cuda", dist_env.local_rank % visible), backend
        # NCCL refuses two ranks on one GPU ("Duplicate GPU detected") only at the first
        # collective. Usually torchrun --nproc-per-node exceeds the GPUs per node.
        raise LaunchError(
            f"environment: LOCAL_RANK={dist_env.local_rank} but only {visible} GPU(s) are visible; "
            "--nproc-per-node must not exceed the GPUs per node (or share GPUs with dist.backend=gloo)"
        )
    return torch.device("cuda", dist_env.local_rank), backend


def has_native_bf16(device: torch.device) -> bool:
    """Whether the device runs bf16 matmuls in hardware."""
    if device.type == "cuda":
        # Not torch.cuda.is_bf16_supported() as called by default: it also answers True where
        # bf16 is only emulated (V100, T4), far slower than fp16 there.
        return bool(torch.version.hip) or torch.cuda.get_device_capability(device) >= (8, 0)
    if platform.machine() in ("x86_64", "AMD64"):
        # AVX512-BF16 or AMX: bf16 matmuls ~2.5x fp32 (benchmarks/RESULTS.md). Not mkldnn's own
        # check, which answers True for any AVX-512 CPU, those without bf16 instructions too;
        # and not where ATEN_CPU_CAPABILITY keeps torch's kernels below AVX-512.
        return (torch.backends.cpu.get_cpu_capability() == "AVX512"
                and (torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()))
    # Arm: mkldnn checks the BF16 extension (Neoverse V1 and newer, Apple M2 and newer).
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def resolve_precision(precision: str, device: torch.device) -> torch.dtype:
    """The autocast dtype (float32: no autocast). auto: bf16 where the device has it in
    hardware; else fp16 (with a loss scaler) on a GPU, where it has tensor cores since
    Volta, and fp32 on a CPU, where fp16 has no fast kernels."""
    explicit = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    if precision in explicit:
        if precision == "bf16" and not has_native_bf16(device):
            if device.type == "cuda":
                log.warning("train.precision: bf16 is emulated on %s, and slow; fp16 (or auto) is fast there",
                            torch.cuda.get_device_name(device))
            else:
                log.warning("train.precision: bf16 is emulated on this CPU (%s), about 15x slower than fp32; "
                            "fp32 (or auto) is fast here", _missing_cpu_bf16())
        return explicit[precision]
    if has_native_bf16(device):
        return torch.bfloat16
    return torch.float16 if device.type == "cuda" else torch.float32


def _missing_cpu_bf16() -> str:
    if platform.machine() in ("x86_64", "AMD64"):
        return "no AVX512-BF16, no AMX"
    return f"{platform.machine()}: no BF16 extension"


def cpu_threads(dist_env: DistEnv, threads: int | None) -> int:
    """Intra-op threads: the CPUs this process may use, shared among the node's ranks."""
    return threads or max(1, len(os.sched_getaffinity(0)) // dist_env.local_world_size)


def configure_compute(train_cfg: TrainConfig, dist_env: DistEnv, device: torch.device) -> torch.dtype:
    """This process's compute as train.* sets it, before the model is built: deterministic
    kernels, the CPU threads, and the autocast dtype it returns (resolve_precision). Every
    command that runs the model calls it once (trainer/train/build.py)."""
    if train_cfg.deterministic:
        use_deterministic_kernels()
    if device.type == "cpu":
        torch.set_num_threads(cpu_threads(dist_env, train_cfg.threads))
    return resolve_precision(train_cfg.precision, device)


def use_deterministic_kernels() -> None:
    """Make every kernel bitwise reproducible, or fail at the first one that cannot be.

    Before the first cuBLAS call: cuBLAS reads its workspace setting when it creates its
    handle, and with the default one its reductions are split in a varying order.
    """
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
