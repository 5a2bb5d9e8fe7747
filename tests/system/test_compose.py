"""docker-compose.yml: valid Compose, two one-GPU nodes, and a job that really runs.

podman-compose merges and interpolates the files, and the merged file is validated against
the Compose Specification's schema. The CPU variant then runs under `podman-compose up` in two
real containers of our image, as the file's header tells users to, with one test-only
override: each service joins a network namespace of tests/support/netns.py, named as on a compose
network (podman-compose would otherwise create a bridge network, which adds firewall rules
to this machine).
"""

from __future__ import annotations

import json
import os
import re
import resource
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import jsonschema
import pytest
import yaml
from support.image import APP_TAG
from support.netns import Network
from support.outputs import read_summary
from support.runs import REPO
from support.users import UID

SCHEMA = jsonschema.Draft7Validator(json.loads((REPO / "tests/schemas/compose-spec.json").read_text()))
PODMAN_COMPOSE = Path(sys.executable).with_name("podman-compose")
CPU = ("docker-compose.yml", "docker-compose.cpu.yml")


INTERPOLATED = ("TRAINER_IMAGE", "NODE0_GPU", "NODE1_GPU", "NCCL_DEBUG")
"""The variables the compose file reads: the tests' own environment sets none of them."""


class ConfigLoader(yaml.SafeLoader):
    """`config` prints the x- fragments as written, `!reset` tags and all."""


ConfigLoader.add_constructor("!reset", lambda loader, node: None)


def compose(*files: str, env: dict[str, str] | None = None) -> dict:
    """The files merged and interpolated (with `env` set), as podman-compose will run them."""
    argv = [PODMAN_COMPOSE, *[arg for name in files for arg in ("-f", REPO / name)], "config"]
    environ = {key: value for key, value in os.environ.items() if key not in INTERPOLATED}
    result = subprocess.run(argv, capture_output=True, text=True, check=True, env={**environ, **(env or {})})
    config = yaml.load(result.stdout, Loader=ConfigLoader)
    SCHEMA.validate(config)
    return config


def gpu_devices(service: dict) -> list[dict]:
    return service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])


def option(command: list[str], name: str) -> str:
    (value,) = [arg.split("=", 1)[1] for arg in command if arg.startswith(f"{name}=")]
    return value


def test_compose_files_are_valid_and_describe_two_one_gpu_nodes():
    gpu = compose("docker-compose.yml")
    assert set(gpu["services"]) == {"node0", "node1"}
    device_ids = []
    for service in gpu["services"].values():
        (device,) = gpu_devices(service)
        assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
        assert len(device["device_ids"]) == 1 and "count" not in device
        device_ids += device["device_ids"]
        command = service["command"]
        assert command[:3] == ["python", "-m", "trainer.cli.torchrun"]  # torchrun, with the restart verdict
        assert option(command, "--nnodes") == "2"
        assert option(command, "--nproc-per-node") == "1"  # one process per reserved GPU
        assert option(command, "--rdzv-backend") == "trainer-c10d"
        assert option(command, "--rdzv-conf") == "join_timeout=300"
        assert option(command, "--rdzv-endpoint").split(":")[0] == "node0"
        assert service["shm_size"] or service.get("ipc") == "host"
        assert any(volume.startswith("runs:") for volume in service["volumes"])
    assert len(set(device_ids)) == 2, "each node needs its own GPU"

    cpu = compose(*CPU)
    assert set(cpu["services"]) == {"node0", "node1"}
    assert all(not gpu_devices(service) for service in cpu["services"].values())
    for name in ("node0", "node1"):  # the CPU variant changes nothing but the GPU request
        gpu_service, cpu_service = gpu["services"][name], cpu["services"][name]
        # The CUDA base image asks the NVIDIA runtime for every GPU (NVIDIA_VISIBLE_DEVICES=all).
        assert cpu_service["environment"] == {**gpu_service["environment"], "NVIDIA_VISIBLE_DEVICES": "void"}
        assert {**gpu_service, "deploy": None, "environment": None} == \
            {**cpu_service, "deploy": None, "environment": None}


def test_compose_runs_the_image_and_gpus_it_is_given():
    """NODE0_GPU and NODE1_GPU choose the GPUs; TRAINER_IMAGE names an image that is used as it
    is (pulled if missing), never rebuilt: there is nothing to build, so `up --build` cannot
    retag a local build as a registry's image."""
    default = compose("docker-compose.yml")
    assert {service["image"] for service in default["services"].values()} == {"ddp-trainer:0.1.0"}
    chosen = compose("docker-compose.yml", env={"NODE0_GPU": "2", "NODE1_GPU": "5",
                                                "TRAINER_IMAGE": "registry.example/ddp-trainer:0.1.0"})
    assert [gpu_devices(chosen["services"][name])[0]["device_ids"] for name in ("node0", "node1")] == [["2"], ["5"]]
    for config in (chosen, compose(*CPU)):
        for service in config["services"].values():
            assert "build" not in service and service["pull_policy"] == "missing"
    assert {service["image"] for service in chosen["services"].values()} == {"registry.example/ddp-trainer:0.1.0"}


def seconds(duration: str) -> float:
    """A Compose duration (`1m30s`, `120s`, `500ms`) in seconds."""
    units = {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6}
    parts = re.findall(r"(\d+(?:\.\d+)?)(h|ms|us|m|s)", duration)
    assert "".join(number + unit for number, unit in parts) == duration, duration
    return sum(float(number) * units[unit] for number, unit in parts)


def test_compose_gives_a_stopped_node_time_to_save():
    """Between SIGTERM and SIGKILL a node has stop_grace_period; torchrun gives its ranks
    TORCH_ELASTIC_SHUTDOWN_TIMEOUT of it, a little less, so that torchrun itself still exits
    before the SIGKILL. TRAINER_GRACE_S, the budget `doctor` holds a checkpoint save to, is
    what the ranks really get. Locked memory and stacks as NGC sets them."""
    for service in compose("docker-compose.yml")["services"].values():
        grace = seconds(service["stop_grace_period"])
        env = service["environment"]
        shutdown = int(env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"])
        assert 5 <= grace - shutdown <= 0.2 * grace, (grace, shutdown)
        assert int(env["TRAINER_GRACE_S"]) == shutdown
        assert shutdown > 30  # more than torchrun's default, or the setting would be pointless
        assert service["ulimits"] == {"memlock": -1, "stack": 64 * 2**20}


def test_compose_rejects_what_compose_rejects():
    """The validation above can fail: Compose's schema refuses an unknown service key."""
    config = compose("docker-compose.yml")
    config["services"]["node0"]["gpus_per_node"] = 1
    with pytest.raises(jsonschema.ValidationError, match="gpus_per_node"):
        SCHEMA.validate(config)


@dataclass
class Up:
    proc: subprocess.Popen
    project: str
    files: list
    started: float


def compose_up(engine, network: Network, tmp: Path, services: dict | None = None) -> Up:
    """Start `podman-compose up --abort-on-container-failure` of the CPU
    variant, each service on its host of `network` (and `services` merged over it), as its
    own project; `ended` waits for it. Root here may not raise limits above the host's, so the
    locked-memory limit is the host's, and the limits podman would otherwise set to its own
    defaults once any is given are those of image.py's containers.conf."""
    _, memlock = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    ulimits = {"memlock": -1 if memlock == resource.RLIM_INFINITY else memlock, "nofile": 16384, "nproc": 32768}
    override = {"x-podman": {"in_pod": False}, "services": {
        name: {"network_mode": f"ns:/run/netns/{network.namespaces[name]}", "cpuset": network.cpus[name],
               "extra_hosts": [f"{host}:{network.addresses[host]}" for host in network.namespaces],
               "ulimits": ulimits, **(services or {}).get(name, {})}
        for name in network.namespaces}}
    (tmp / "docker-compose.test.yml").write_text(yaml.safe_dump(override))
    project = f"{tmp.name}-{engine.run_dir.name}".lower()
    files = [arg for name in CPU for arg in ("-f", REPO / name)] + ["-f", tmp / "docker-compose.test.yml"]
    proc = subprocess.Popen([PODMAN_COMPOSE, "-p", project, *files, "up", "--abort-on-container-failure"],
                            env={**engine.env, "TRAINER_IMAGE": APP_TAG},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    return Up(proc, project, files, time.monotonic())


@dataclass
class Ended:
    code: int
    """The command's exit code."""
    output: str
    elapsed: float
    runs: Path
    """The `runs` volume's folder."""
    nodes: dict[str, int]
    """Each service's container's own exit code."""


def ended(engine, up: Up) -> Ended:
    """How the command ended; the project's containers are removed."""
    try:
        output, _ = up.proc.communicate(timeout=400)
        elapsed = time.monotonic() - up.started
        volume = engine("volume", "inspect", "--format", "{{.Mountpoint}}", f"{up.project}_runs").stdout.strip()
        listed = engine("ps", "-a", "--filter", f"label=com.docker.compose.project={up.project}", "--format",
                        '{{index .Labels "com.docker.compose.service"}} {{.ExitCode}}').stdout.split()
        nodes = {service: int(code) for service, code in zip(listed[::2], listed[1::2], strict=True)}
        return Ended(up.proc.returncode, output, elapsed, Path(volume), nodes)
    finally:
        up.proc.kill()
        subprocess.run([PODMAN_COMPOSE, "-p", up.project, *up.files, "down", "--timeout=0"], env=engine.env,
                       capture_output=True)


def test_compose_cpu_variant_runs_a_two_node_job_and_a_node_that_cannot_join_ends_it(engine, app_image, tmp_path):
    """The CPU variant as shipped: two containers, node0 and node1, complete the job with world
    size 2, written to the shared `runs` volume by the image's user, and the command and both
    nodes exit 0. (With --abort-on-container-exit, node1 ending well stopped node0 in the last
    second of its own shutdown, and the finished job read as stopped.)

    At the same time, the same files with node1's rendezvous pointed at itself (a wrong
    endpoint): node1 gives up after its join timeout, and --abort-on-container-failure stops
    node0, which would otherwise wait 300 s for a peer that never comes. Its SIGTERM reaches
    torchrun through the image's tini (torchrun as PID 1 would ignore it while it waits,
    until the SIGKILL), so node0 exits 128 + SIGTERM, at once, and the command's exit code is
    node1's verdict. (Side by side because that pair never gets past its torchrun agents'
    rendezvous: it costs the other job next to nothing.)"""
    command = compose(*CPU)["services"]["node1"]["command"]
    join_timeout = 8
    wrong = [{"--rdzv-endpoint=node0:29500": "--rdzv-endpoint=node1:29500",
              "--rdzv-conf=join_timeout=300": f"--rdzv-conf=join_timeout={join_timeout}"}.get(arg, arg)
             for arg in command]
    assert wrong != command
    (tmp_path / "good").mkdir()
    (tmp_path / "bad").mkdir()
    with Network({"node0": [], "node1": []}) as network, Network({"node0": [], "node1": []}) as other:
        good = compose_up(engine, network, tmp_path / "good")
        bad = compose_up(engine, other, tmp_path / "bad", {"node1": {"command": wrong}})
        try:
            failed = ended(engine, bad)
        finally:
            done = ended(engine, good)
        assert f"{join_timeout}s: 1 of 2 nodes arrived" in failed.output, failed.output[-5000:]
        verdict = re.findall(r"trainer\.cli\.torchrun: exiting with (\d+)", failed.output)
        assert failed.nodes == {"node0": 128 + signal.SIGTERM, "node1": int(verdict[0])}, failed.output[-5000:]
        assert failed.code == failed.nodes["node1"] != 0
        assert failed.elapsed < 120, f"took {failed.elapsed:.0f}s"

        assert (done.code, done.nodes) == (0, {"node0": 0, "node1": 0}), done.output[-5000:]
        assert (done.runs / "smoke/summary.json").stat().st_uid == UID  # the image's user, not root
        summary = read_summary(done.runs / "smoke")
    assert summary["world_size"] == 2
    assert sorted(summary["hosts"]) == ["node0", "node1"]
    assert summary["steps"] == 12
