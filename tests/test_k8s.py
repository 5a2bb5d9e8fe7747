"""k8s/: what a cluster with the Kubeflow operator accepts, and a job that really runs.

No API server here, so each layer of acceptance is checked against the real thing:
- the PyTorchJob and TrainJob against their real CRD schemas (tests/schemas, closed: an
  unknown field is an error), the core objects with `kubernetes-validate --strict`;
- the PyTorchJob validating webhook's rules;
- the operator contract: each pod's command, with its env plus exactly what the operator
  injects, its ConfigMap materialized and its PVC shared, runs in a network namespace named
  like the pod's Service. The 2-pod job must finish with world size 2; so must the elastic
  variant (k8s/elastic/), from the elastic rendezvous the operator injects;
- the image override renders with `kubectl kustomize`, and names the image we build.
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

from container import Service, Started, build_app_dir, read_dockerfile, run_services
from conftest import REPO
from kubeflow import Pod, pytorchjob_pods, pytorchjob_webhook_violations, trainjob_pods

SCHEMAS = REPO / "tests/schemas"
BIN = Path(sys.executable).parent
IMAGE = "ddp-trainer:0.1.0"


def load_all(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def k8s_objects() -> dict[str, dict]:
    """Every object `kubectl apply -f k8s/` would apply, by kind: it reads the folder's
    .yaml, .yml and .json files, not subfolders, and skips other files (README.md)."""
    objects = {}
    for path in sorted((REPO / "k8s").glob("*")):
        if path.is_file() and path.suffix in (".yaml", ".yml", ".json"):
            for doc in load_all(path):
                assert doc["kind"] not in objects, f"{path}: a second {doc['kind']}"
                objects[doc["kind"]] = doc
    return objects


def closed(schema):
    """Kubernetes prunes unknown fields; for a test, treating them as errors is stricter."""
    if isinstance(schema, list):
        return [closed(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    result = {key: closed(value) for key, value in schema.items()}
    if ("properties" in schema and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")):
        result["additionalProperties"] = False
    return result


def crd_validator(file: str) -> jsonschema.Validator:
    crd = yaml.safe_load((SCHEMAS / file).read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["served"] and v["storage"]]
    return jsonschema.Draft4Validator(closed(version["schema"]["openAPIV3Schema"]))


PYTORCHJOB_SCHEMA = crd_validator("kubeflow.org_pytorchjobs.yaml")
TRAINJOB_SCHEMA = crd_validator("trainer.kubeflow.org_trainjobs.yaml")
TRAINJOB = yaml.safe_load((REPO / "k8s/trainjob/trainjob.yaml").read_text())
ELASTIC = yaml.safe_load((REPO / "k8s/elastic/pytorchjob.yaml").read_text())
RUNTIME = yaml.safe_load((SCHEMAS / "torch_distributed_runtime.yaml").read_text())


def test_k8s_folder_holds_exactly_the_job_objects():
    objects = k8s_objects()
    assert set(objects) == {"PyTorchJob", "ConfigMap", "PersistentVolumeClaim"}
    assert objects["PyTorchJob"]["apiVersion"] == "kubeflow.org/v1"
    result = subprocess.run([BIN / "kubernetes-validate", "--strict",
                             REPO / "k8s/configmap.yaml", REPO / "k8s/pvc.yaml"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("passed") == 2, result.stdout


def test_jobs_validate_against_their_crds():
    PYTORCHJOB_SCHEMA.validate(k8s_objects()["PyTorchJob"])
    PYTORCHJOB_SCHEMA.validate(ELASTIC)
    TRAINJOB_SCHEMA.validate(TRAINJOB)
    # ... and the closed schemas do reject what a cluster would drop or refuse:
    job = copy.deepcopy(k8s_objects()["PyTorchJob"])
    job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["gpus"] = 1
    with pytest.raises(jsonschema.ValidationError, match="gpus"):
        PYTORCHJOB_SCHEMA.validate(job)
    job = copy.deepcopy(TRAINJOB)
    job["spec"]["trainer"]["numProcPerNode"] = "1"
    with pytest.raises(jsonschema.ValidationError, match="integer"):
        TRAINJOB_SCHEMA.validate(job)


def mutate(path: str, value):
    def apply(job: dict) -> dict:
        job = copy.deepcopy(job)
        *parents, last = path.split(".")
        node = job
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        if value is None:
            del node[last]
        else:
            node[last] = value
        return job
    return apply


REPLICAS = "spec.pytorchReplicaSpecs"


@pytest.mark.parametrize("change, problem", [
    (mutate("metadata.name", "DDP_trainer"), "DNS-1035"),
    (mutate("metadata.name", "1-trainer"), "DNS-1035"),
    (mutate(f"{REPLICAS}.Chief", {"replicas": 1, "template": {"spec": {"containers": [{"name": "pytorch"}]}}}),
     "not Master or Worker"),
    (mutate(f"{REPLICAS}.Worker.template.spec.containers.0.name", "trainer"), "Worker: no container named pytorch"),
    (mutate(f"{REPLICAS}.Master.replicas", None), "Master.replicas must be set to 1"),
    (mutate(f"{REPLICAS}.Master.replicas", 2), "Master.replicas must be set to 1"),
    (mutate(f"{REPLICAS}.Worker.replicas", 0), "Worker.replicas must be at least 1"),
    (mutate("spec.elasticPolicy", {"nProcPerNode": 1}), "both set"),
])
def test_webhook_rules(change, problem):
    job = k8s_objects()["PyTorchJob"]
    assert pytorchjob_webhook_violations(job) == []
    # YAML anchors make Master and Worker share one template: mutate a real copy.
    job = yaml.safe_load(json.dumps(job))
    assert any(problem in p for p in pytorchjob_webhook_violations(change(job)))


def test_the_elastic_job_passes_the_webhook_and_sizes_its_global_batch_for_every_world_size():
    assert pytorchjob_webhook_violations(ELASTIC) == []
    assert "Master" not in ELASTIC["spec"]["pytorchReplicaSpecs"]  # all Workers: any of them may go
    without_workers = mutate(f"{REPLICAS}.Worker", None)(ELASTIC)
    assert "an elastic job needs a Worker spec" in pytorchjob_webhook_violations(without_workers)
    policy, spec = ELASTIC["spec"]["elasticPolicy"], ELASTIC["spec"]
    assert policy["rdzvBackend"] == "trainer-c10d" and policy["maxRestarts"] >= 1
    assert spec["pytorchReplicaSpecs"]["Worker"]["replicas"] == policy["maxReplicas"]
    (container,) = spec["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"]
    (global_batch,) = [int(arg.split("=")[1]) for arg in container["command"] if arg.startswith("train.global_batch=")]
    for pods in range(policy["minReplicas"], policy["maxReplicas"] + 1):
        assert global_batch % (pods * int(spec["nprocPerNode"])) == 0, pods
    # The non-elastic job and the elastic one are not both applied by `kubectl apply -f k8s/`.
    assert ELASTIC["metadata"]["name"] != k8s_objects()["PyTorchJob"]["metadata"]["name"]


def test_manifests_follow_our_rules():
    """What the operator would accept but our users must not get: checked for every pod."""
    objects = k8s_objects()
    job = objects["PyTorchJob"]
    assert job["spec"]["nprocPerNode"] == "1"
    assert {"backoffLimit", "cleanPodPolicy"} <= set(job["spec"]["runPolicy"])
    for pod in pytorchjob_pods(job) + pytorchjob_pods(ELASTIC) + trainjob_pods(TRAINJOB, RUNTIME):
        container = pod.container
        assert container["image"] == IMAGE
        assert container["command"][:2] == ["torchrun", "-m"], "torchrun, with no rendezvous flags"
        assert not [arg for arg in container["command"] if arg.startswith("--")], container["command"]
        assert pod.annotations["sidecar.istio.io/inject"] == "false"
        assert pod.spec["securityContext"]["runAsNonRoot"] is True
        assert pod.spec["securityContext"]["runAsUser"] == read_dockerfile().uid != 0
        assert container["securityContext"]["allowPrivilegeEscalation"] is False
        assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]
        volumes = {v["name"]: v for v in pod.spec["volumes"]}
        mounts = {m["mountPath"]: volumes[m["name"]] for m in container["volumeMounts"]}
        assert mounts["/dev/shm"]["emptyDir"]["medium"] == "Memory"
        assert mounts["/workspace"]["persistentVolumeClaim"]["claimName"] == objects["PersistentVolumeClaim"]["metadata"]["name"]
        assert mounts["/etc/trainer"]["configMap"]["name"] == objects["ConfigMap"]["metadata"]["name"]
        (key,) = [e for e in container["env"] if e["name"] == "WANDB_API_KEY"]
        assert key["valueFrom"]["secretKeyRef"]["optional"] is True and "value" not in key
        assert not [e for e in container["env"] if e["name"].startswith("PET_")]
    for each in (job, ELASTIC):
        for replica in each["spec"]["pytorchReplicaSpecs"].values():
            assert replica["restartPolicy"] in ("OnFailure", "ExitCode")
            (container,) = replica["template"]["spec"]["containers"]
            assert container["resources"]["limits"]["nvidia.com/gpu"] == int(each["spec"]["nprocPerNode"])
    trainer = TRAINJOB["spec"]["trainer"]
    assert trainer["resourcesPerNode"]["limits"]["nvidia.com/gpu"] == trainer["numProcPerNode"]


def test_image_override_renders_and_names_our_image():
    rendered = subprocess.run(
        [BIN / "kubectl", "kustomize", "--load-restrictor=LoadRestrictionsNone", REPO / "k8s/image"],
        capture_output=True, text=True, check=True).stdout
    docs = {doc["kind"]: doc for doc in yaml.safe_load_all(rendered)}
    kustomization = yaml.safe_load((REPO / "k8s/image/kustomization.yaml").read_text())
    (override,) = kustomization["images"]
    assert override["name"] == IMAGE.split(":")[0]
    wanted = f"{override['newName']}:{override['newTag']}"
    pods = pytorchjob_pods(docs["PyTorchJob"])
    assert [pod.container["image"] for pod in pods] == [wanted, wanted]
    # Nothing else changed: the rendered objects are k8s/*.yaml with the image replaced.
    objects = yaml.safe_load(json.dumps(k8s_objects()).replace(f'"{IMAGE}"', f'"{wanted}"'))
    assert docs == objects

    # The image the manifests name is the one the Dockerfile, compose and README build.
    version = re.search(r'^version = "(.+)"', (REPO / "pyproject.toml").read_text(), re.M).group(1)
    assert IMAGE == f"ddp-trainer:{version}"
    assert f'org.opencontainers.image.version="{version}"' in (REPO / "Dockerfile").read_text()
    assert f"docker build -t {IMAGE} ." in (REPO / "k8s/README.md").read_text()
    assert f"${{TRAINER_IMAGE:-{IMAGE}}}" in (REPO / "docker-compose.yml").read_text()
    assert TRAINJOB["spec"]["trainer"]["image"] == IMAGE


def test_trainjob_fits_the_runtime():
    """The runtime's replicated job and container are called `node`, and TrainJob refuses
    PET_* in trainer.env: the runtime owns them."""
    (pod, *_) = trainjob_pods(TRAINJOB, RUNTIME)
    assert pod.container["name"] == "node"
    assert not [e for e in TRAINJOB["spec"]["trainer"]["env"] if e["name"].startswith("PET_")]
    assert TRAINJOB["spec"]["runtimeRef"]["name"] == RUNTIME["metadata"]["name"]


def run_pods(pods: list[Pod], tmp: Path) -> Started:
    """Run every pod's training container as the operator would start it, each volume made
    real: a ConfigMap's files, one shared folder per PVC, a private emptyDir."""
    image = read_dockerfile()
    configmaps = {k8s_objects()["ConfigMap"]["metadata"]["name"]: k8s_objects()["ConfigMap"]}
    claims: dict[str, Path] = {}
    services = []
    for pod in pods:
        root = tmp / pod.name
        volumes = {v["name"]: v for v in pod.spec["volumes"]}
        mounts: dict[str, Path] = {}
        for mount in pod.container["volumeMounts"]:
            volume = volumes[mount["name"]]
            if "configMap" in volume:
                path = root / "configmaps" / mount["name"]
                path.mkdir(parents=True)
                for key, text in configmaps[volume["configMap"]["name"]]["data"].items():
                    (path / key).write_text(text)
            elif "persistentVolumeClaim" in volume:
                claim = volume["persistentVolumeClaim"]["claimName"]
                path = claims.setdefault(claim, tmp / "claims" / claim)
                path.mkdir(parents=True, exist_ok=True)
            else:
                assert "emptyDir" in volume, volume
                path = root / "emptydirs" / mount["name"]
                path.mkdir(parents=True)
            mounts[mount["mountPath"]] = path
        env = {e["name"]: e["value"] for e in pod.container.get("env", []) if "value" in e}
        for e in pod.container.get("env", []):  # an absent optional Secret leaves the variable unset
            assert "value" in e or e["valueFrom"]["secretKeyRef"]["optional"], e
        services.append(Service(pod.name, pod.dns_names[1:], pod.container["command"] + pod.container.get("args", []),
                                [env, pod.injected_env], pod.container.get("workingDir", image.workdir), mounts,
                                pod.spec["securityContext"]["runAsUser"]))
    return run_services(services, image, build_app_dir(image, tmp / "app"), tmp, timeout=400)


def assert_job_completed(started: Started, output_dir: str | None = None) -> dict:
    """Every pod exited 0, and the job's summary (in `output_dir`, default the ConfigMap's)
    says both pods trained every step; returns the summary."""
    assert started.codes == [0] * len(started.codes), started.logs_tail()
    config = yaml.safe_load(k8s_objects()["ConfigMap"]["data"]["config.yaml"])
    first = next(iter(started.containers.values()))
    summary_file = first.host_path(f"{output_dir or config['output_dir']}/summary.json")
    assert summary_file.stat().st_uid == read_dockerfile().uid != 0  # the pod's runAsUser wrote it
    summary = json.loads(summary_file.read_text())
    assert summary["world_size"] == 2 and len(summary["hosts"]) == 2, summary
    assert summary["steps"] == config["train"]["max_steps"]
    return summary


def test_pytorchjob_runs_as_the_operator_starts_it(tmp_path_factory):
    pods = pytorchjob_pods(k8s_objects()["PyTorchJob"])
    assert [pod.name for pod in pods] == ["ddp-trainer-master-0", "ddp-trainer-worker-0"]
    assert pods[1].injected_env["WORLD_SIZE"] == "2" and pods[1].injected_env["RANK"] == "1"
    assert_job_completed(run_pods(pods, tmp_path_factory.mktemp("pytorchjob")))


def test_elastic_pytorchjob_runs_as_the_operator_starts_it(tmp_path_factory):
    """Two Worker pods, no Master: torchrun takes its elastic rendezvous from the operator's
    PET_* variables (worker-0 serves it), and the job trains at world size 2 on the global
    batch its command fixes."""
    pods = pytorchjob_pods(ELASTIC)
    assert [pod.name for pod in pods] == ["ddp-trainer-elastic-worker-0", "ddp-trainer-elastic-worker-1"]
    env = pods[1].injected_env
    assert (env["PET_NNODES"], env["PET_RDZV_BACKEND"], env["PET_RDZV_ENDPOINT"]) == \
        ("1:2", "trainer-c10d", "ddp-trainer-elastic-worker-0:23456")
    assert "MASTER_ADDR" not in env and "RANK" not in env
    (output_dir,) = [arg.split("=", 1)[1] for arg in pods[0].container["command"] if arg.startswith("output_dir=")]
    summary = assert_job_completed(run_pods(pods, tmp_path_factory.mktemp("elastic")), output_dir)
    assert summary["global_batch"] == 32


def test_trainjob_runs_as_the_runtime_starts_it(tmp_path_factory):
    pods = trainjob_pods(TRAINJOB, RUNTIME)
    assert pods[0].injected_env["PET_MASTER_ADDR"] == "ddp-trainer-node-0-0.ddp-trainer"
    assert_job_completed(run_pods(pods, tmp_path_factory.mktemp("trainjob")))
