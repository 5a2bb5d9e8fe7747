"""The Dockerfile, read: pinned to our lock. (Lint-clean, and the image it builds runs as
shipped: tests/system/test_docker.py.)"""

import re

from conftest import REPO

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
