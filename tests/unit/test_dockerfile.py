"""The Dockerfile, read: pinned to our lock. (Lint-clean, and the image it builds runs as
shipped: tests/system/test_docker.py.)"""

import re

from support.runs import REPO

from trainer.runtime.devices import CUDA_DRIVER_FLOOR

DOCKERFILE = (REPO / "Dockerfile").read_text()


def test_base_and_dependencies_match_the_lock():
    """The default base is the CUDA image of the lock's torch; the label names whichever base
    a build used; every pip install is constrained by the lock."""
    (default_base,) = re.findall(r"^ARG BASE_IMAGE=(\S+)$", DOCKERFILE, re.M)
    assert re.findall(r"^FROM (\S+)", DOCKERFILE, re.M) == ["${BASE_IMAGE}"]
    lock = (REPO / "requirements.lock").read_text()
    torch_version = re.search(r"^torch==(\S+)$", lock, re.M).group(1)
    assert default_base.startswith(f"docker.io/pytorch/pytorch:{torch_version}-cuda"), default_base
    assert "latest" not in default_base
    assert 'org.opencontainers.image.base.name="${BASE_IMAGE}"' in DOCKERFILE
    installs = [line for line in DOCKERFILE.splitlines() if "pip install" in line]
    assert installs and all("-c requirements.lock" in line for line in installs)




def test_the_image_states_the_driver_its_cuda_needs():
    """TRAINER_MIN_CUDA_DRIVER, which `doctor` checks the host's driver against, is the floor of
    the default base's CUDA, overridable with the base (--build-arg MIN_CUDA_DRIVER), and
    docs/containers.md says the same."""
    (default_base,) = re.findall(r"^ARG BASE_IMAGE=(\S+)$", DOCKERFILE, re.M)
    cuda = re.search(r"-cuda(\d+\.\d+)-", default_base).group(1)
    (floor,) = re.findall(r"^ARG MIN_CUDA_DRIVER=(\S+)$", DOCKERFILE, re.M)
    # doctor's own table (a new base's CUDA is looked up in NVIDIA's release notes, not guessed)
    assert floor == CUDA_DRIVER_FLOOR[cuda.split(".")[0]], (cuda, floor)
    assert re.search(r"^\s+TRAINER_MIN_CUDA_DRIVER=\$\{MIN_CUDA_DRIVER\}$", DOCKERFILE, re.M)
    assert f"CUDA {cuda}" in (REPO / "docs/containers.md").read_text()
    assert f"`TRAINER_MIN_CUDA_DRIVER={floor}`" in (REPO / "docs/containers.md").read_text()
