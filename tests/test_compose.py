"""docker-compose.yml: valid Compose, two one-GPU nodes, and a job that really runs.

No Docker engine here, so the contract is tested as Compose would carry it out: the file
(and its CPU override) is validated against the Compose Specification's schema, interpolated
and merged by Compose's rules, and each service's command and environment are run in its own
network namespace, with the service names resolving as they do on
the compose network. Break the file's command, environment, hostnames or volumes and the
run fails.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import yaml

from container import Service, build_app_dir, read_dockerfile, run_services
from conftest import REPO

SCHEMA = jsonschema.Draft7Validator(json.loads((REPO / "tests/schemas/compose-spec.json").read_text()))
RESET = object()  # Compose's `!reset` tag: drop the key when merging


class ComposeLoader(yaml.SafeLoader):
    pass


ComposeLoader.add_constructor("!reset", lambda loader, node: RESET)


def load(name: str) -> dict:
    return yaml.load((REPO / name).read_text(), Loader=ComposeLoader)


def merge(base, override):
    """Compose's merge for the mapping keys we use: mappings merge, `!reset` removes,
    anything else replaces."""
    if not (isinstance(base, dict) and isinstance(override, dict)):
        return override
    merged = dict(base)
    for key, value in override.items():
        if value is RESET:
            merged.pop(key, None)
        else:
            merged[key] = merge(base.get(key), value)
    return merged


_VARIABLE = re.compile(r"\$(?:(\$)|\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?+])([^}]*))?\}|([A-Za-z_][A-Za-z0-9_]*))")


def interpolate(value, environ: dict[str, str]):
    """Compose interpolation: $$, $VAR, ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?err}."""
    if isinstance(value, dict):
        return {key: interpolate(item, environ) for key, item in value.items()}
    if isinstance(value, list):
        return [interpolate(item, environ) for item in value]
    if not isinstance(value, str):
        return value

    def substitute(match: re.Match) -> str:
        dollar, name, op, arg, bare = match.groups()
        if dollar:
            return "$"
        name = name or bare
        unset_or_empty = not environ.get(name)
        if op in (":-", "-"):
            return arg if (unset_or_empty if op == ":-" else name not in environ) else environ[name]
        if op in (":?", "?"):
            if unset_or_empty if op == ":?" else name not in environ:
                raise ValueError(f"required variable {name}: {arg}")
            return environ[name]
        if op in (":+", "+"):
            return "" if unset_or_empty else arg
        return environ.get(name, "")

    return _VARIABLE.sub(substitute, value)


def compose(*files: str, environ: dict[str, str] | None = None) -> dict:
    merged = {}
    for name in files:
        merged = merge(merged, load(name))
    config = interpolate(merged, environ or {})
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
        assert command[0] == "torchrun" and option(command, "--nnodes") == "2"
        assert option(command, "--nproc-per-node") == "1"  # one process per reserved GPU
        assert option(command, "--rdzv-backend") == "trainer-c10d"
        assert option(command, "--rdzv-conf") == "join_timeout=300"
        assert option(command, "--rdzv-endpoint").split(":")[0] == "node0"
        assert service["shm_size"] or service.get("ipc") == "host"
        assert any(volume.startswith("runs:") for volume in service["volumes"])
    assert len(set(device_ids)) == 2, "each node needs its own GPU"

    cpu = compose("docker-compose.yml", "docker-compose.cpu.yml")
    assert set(cpu["services"]) == {"node0", "node1"}
    assert all(not gpu_devices(service) for service in cpu["services"].values())
    for name in ("node0", "node1"):  # the CPU variant changes nothing but the GPU request
        gpu_service, cpu_service = gpu["services"][name], cpu["services"][name]
        # The CUDA base image asks the NVIDIA runtime for every GPU (NVIDIA_VISIBLE_DEVICES=all).
        assert cpu_service["environment"] == {**gpu_service["environment"], "NVIDIA_VISIBLE_DEVICES": "void"}
        assert {**gpu_service, "deploy": None, "environment": None} == \
            {**cpu_service, "deploy": None, "environment": None}


def test_compose_rejects_what_compose_rejects():
    """The validation above can fail: Compose's schema refuses an unknown service key."""
    config = compose("docker-compose.yml")
    config["services"]["node0"]["gpus_per_node"] = 1
    with pytest.raises(jsonschema.ValidationError, match="gpus_per_node"):
        SCHEMA.validate(config)


def test_compose_cpu_variant_runs_a_two_node_job(tmp_path_factory):
    """Each service's command and environment, after interpolation, run in two hosts named
    like the services: the job completes with world size 2 across both."""
    config = compose("docker-compose.yml", "docker-compose.cpu.yml")
    image = read_dockerfile()
    base = tmp_path_factory.mktemp("compose")
    app_dir = build_app_dir(image, base / "app")
    named_volumes = {name: base / "volumes" / name for name in config["volumes"]}
    for path in named_volumes.values():
        path.mkdir(parents=True)

    services = config["services"]
    started = run_services([
        Service(name, [service.get("hostname", name)], service["command"], [service.get("environment", {})],
                service.get("working_dir", image.workdir),
                {target: named_volumes[source] for source, target, *_ in
                 (spec.split(":") for spec in service["volumes"])}, image.uid)
        for name, service in services.items()
    ], image, app_dir, base, timeout=300)
    assert started.codes == [0, 0], started.logs_tail()

    output_dir = option(services["node0"]["command"], "output_dir")
    summary_file = started.containers["node0"].host_path(f"{output_dir}/summary.json")
    assert summary_file.stat().st_uid == image.uid != 0  # written by the image's user, not root
    summary = json.loads(summary_file.read_text())
    assert summary["world_size"] == 2
    assert sorted(summary["hosts"]) == ["node0", "node1"]
    assert summary["steps"] == 12
