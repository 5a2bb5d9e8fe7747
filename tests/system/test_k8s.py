"""k8s/: what a cluster with the Kubeflow operator accepts, and a job that really runs.

No API server here, so each layer of acceptance is checked against the real thing:
- the PyTorchJob and TrainJob against their real CRD schemas (tests/schemas, closed: an
  unknown field is an error), the core objects with `kubernetes-validate --strict`;
- the PyTorchJob validating webhook's rules;
- the NetworkPolicies' selectors, against the labels the operators give the pods;
- the operator contract: each pod's training container runs in our image (tests/image.py)
  with its pod's security context, its env plus exactly what the operator injects, its
  ConfigMap materialized and its PVC shared, on a host named like the pod's Service. The
  2-pod job must finish with world size 2; so must the elastic variant (k8s/elastic/), from
  the elastic rendezvous the operator injects, and the TrainJob;
- the image override renders with `kubectl kustomize`, and names the image we build.
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml
from conftest import REPO
from image import Container, Ended, run_containers
from kubeflow import Pod, pytorchjob_pods, pytorchjob_webhook_violations, trainjob_pods
from netns import Network
from support import read_summary
from users import UID

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
POLICY_FILES = {"pytorchjob": REPO / "k8s/networkpolicy.yaml", "elastic": REPO / "k8s/elastic/networkpolicy.yaml",
                "trainjob": REPO / "k8s/trainjob/networkpolicy.yaml"}


def test_k8s_folder_holds_exactly_the_job_objects():
    objects = k8s_objects()
    assert set(objects) == {"PyTorchJob", "ConfigMap", "PersistentVolumeClaim", "NetworkPolicy"}
    assert objects["PyTorchJob"]["apiVersion"] == "kubeflow.org/v1"
    core = [REPO / "k8s/configmap.yaml", REPO / "k8s/pvc.yaml", *POLICY_FILES.values()]
    result = subprocess.run([BIN / "kubernetes-validate", "--strict", *core], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("passed") == len(core), result.stdout


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
        assert pod.spec["securityContext"]["runAsUser"] == UID != 0
        assert container["securityContext"]["allowPrivilegeEscalation"] is False
        assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        volumes = {v["name"]: v for v in pod.spec["volumes"]}
        mounts = {m["mountPath"]: volumes[m["name"]] for m in container["volumeMounts"]}
        assert mounts["/dev/shm"]["emptyDir"]["medium"] == "Memory"
        assert "medium" not in mounts["/tmp"]["emptyDir"]  # the read-only root's scratch, on disk
        claim = objects["PersistentVolumeClaim"]["metadata"]["name"]
        assert mounts["/workspace"]["persistentVolumeClaim"]["claimName"] == claim
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


def selects(selector: dict, labels: dict[str, str]) -> bool:
    """A Kubernetes label selector: matchLabels and matchExpressions, all of them."""
    if any(labels.get(key) != value for key, value in selector.get("matchLabels", {}).items()):
        return False
    for expression in selector.get("matchExpressions", []):
        key, operator, values = expression["key"], expression["operator"], expression.get("values", [])
        if not {"In": key in labels and labels[key] in values, "NotIn": labels.get(key) not in values,
                "Exists": key in labels, "DoesNotExist": key not in labels}[operator]:
            return False
    return True


def job_pods() -> dict[str, list[Pod]]:
    return {"pytorchjob": pytorchjob_pods(k8s_objects()["PyTorchJob"]), "elastic": pytorchjob_pods(ELASTIC),
            "trainjob": trainjob_pods(TRAINJOB, RUNTIME)}


@pytest.mark.parametrize("variant", list(POLICY_FILES))
def test_network_policy_admits_the_jobs_own_pods_and_no_other(variant):
    """The job's pods take connections only from the job's pods, on every port (the c10d
    store, and gloo's and NCCL's ephemeral ones), and egress (DNS) is left open. Its selectors
    match the labels the operator gives the job's pods, and no other job's: the other
    variants, the same job renamed, and a job of another operator that has the same name."""
    (policy,) = load_all(POLICY_FILES[variant])
    spec = policy["spec"]
    assert spec["policyTypes"] == ["Ingress"], "an Egress policy would need DNS let through"
    (rule,) = spec["ingress"]
    assert "ports" not in rule, "every port: gloo and NCCL listen on ephemeral ones"
    (peer,) = rule["from"]
    assert set(peer) == {"podSelector"}, "pods of the job's namespace only"
    pods = job_pods()
    for pod in pods[variant]:
        assert selects(spec["podSelector"], pod.labels) and selects(peer["podSelector"], pod.labels), pod.name
    others = [pod for name, each in pods.items() if name != variant for pod in each]
    renamed = copy.deepcopy(k8s_objects()["PyTorchJob"])
    renamed["metadata"]["name"] = "other-job"
    others += pytorchjob_pods(renamed) + trainjob_pods({**TRAINJOB, "metadata": {"name": "other-job"}}, RUNTIME)
    if variant != "trainjob":  # a TFJob of the same name: its job-name label matches, its operator's does not
        others += [Pod(pod.name, [], {}, {**pod.labels, "training.kubeflow.org/operator-name": "tfjob-controller"},
                       {}, {}, {}) for pod in pods[variant]]
    for pod in others:
        assert not selects(spec["podSelector"], pod.labels) and not selects(peer["podSelector"], pod.labels), \
            (pod.name, pod.labels)


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
    assert f"ddp-trainer:{version}" == IMAGE
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


def security_options(pod: Pod) -> list[str]:
    """The pod's and its container's securityContext as podman applies it. A field this does
    not know fails the test, rather than running the container with less than the manifest asks."""
    pod_context, context = pod.spec.get("securityContext", {}), pod.container.get("securityContext", {})
    assert set(pod_context) <= {"runAsNonRoot", "runAsUser", "runAsGroup", "fsGroup", "seccompProfile"}, pod_context
    assert set(context) <= {"allowPrivilegeEscalation", "readOnlyRootFilesystem", "capabilities"}, context
    user, group = pod_context["runAsUser"], pod_context.get("runAsGroup", 0)
    assert not pod_context.get("runAsNonRoot") or user != 0
    options = [f"--user={user}:{group}"]
    if "fsGroup" in pod_context:
        options.append(f"--group-add={pod_context['fsGroup']}")
    assert pod_context["seccompProfile"] == {"type": "RuntimeDefault"}  # podman's default profile
    options += [f"--cap-drop={cap}" for cap in context.get("capabilities", {}).get("drop", [])]
    assert not context.get("capabilities", {}).get("add")
    if context.get("allowPrivilegeEscalation") is False:
        options.append("--security-opt=no-new-privileges")
    if context.get("readOnlyRootFilesystem"):
        options += ["--read-only", "--read-only-tmpfs=false"]  # no tmpfs the kubelet would not add
    return options


def pod_container(pod: Pod, root: Path, claims: dict[str, Path]) -> Container:
    """The pod's training container as the kubelet starts it: its command, its env plus what
    the operator injects, its security context, and every volume made real: a ConfigMap's
    files (read-only), one shared folder per PVC (group-owned by fsGroup, as the kubelet
    sets it), a memory-backed /dev/shm of the emptyDir's size, a private emptyDir."""
    configmap = k8s_objects()["ConfigMap"]
    configmaps = {configmap["metadata"]["name"]: configmap}
    volumes = {v["name"]: v for v in pod.spec["volumes"]}
    fs_group = pod.spec["securityContext"].get("fsGroup", 0)
    mounts, options = [], security_options(pod)
    for mount in pod.container["volumeMounts"]:
        volume, target = volumes[mount["name"]], mount["mountPath"]
        read_only = ":ro" if mount.get("readOnly") else ""
        if "configMap" in volume:
            path = root / "configmaps" / mount["name"]
            path.mkdir(parents=True)
            for key, text in configmaps[volume["configMap"]["name"]]["data"].items():
                (path / key).write_text(text)
        elif "persistentVolumeClaim" in volume:
            path = claims.setdefault(volume["persistentVolumeClaim"]["claimName"],
                                     root.parent / "claims" / volume["persistentVolumeClaim"]["claimName"])
            path.mkdir(parents=True, exist_ok=True)
            os.chown(path, 0, fs_group)
            path.chmod(0o2775)
        elif volume["emptyDir"].get("medium") == "Memory":
            assert target == "/dev/shm", target
            options.append(f"--shm-size={volume['emptyDir']['sizeLimit'].replace('Gi', 'g')}")
            continue
        else:
            path = root / "emptydirs" / mount["name"]
            path.mkdir(parents=True)
            path.chmod(0o777)
        mounts.append(f"{path}:{target}{read_only}")
    env = {e["name"]: e["value"] for e in pod.container.get("env", []) if "value" in e}
    for e in pod.container.get("env", []):  # an absent optional Secret leaves the variable unset
        assert "value" in e or e["valueFrom"]["secretKeyRef"]["optional"], e
    if "workingDir" in pod.container:
        options.append(f"--workdir={pod.container['workingDir']}")
    return Container(pod.name, pod.container["command"] + pod.container.get("args", []), {**env, **pod.injected_env},
                     mounts, options, pod.dns_names[1:])


def run_pods(engine, app_image, pods: list[Pod], tmp: Path) -> tuple[Ended, dict[str, Path]]:
    """Every pod's training container in our image, each on a host named as its Service;
    returns how they ended and the host folder of each PVC."""
    assert {pod.container["image"] for pod in pods} == {IMAGE}
    claims: dict[str, Path] = {}
    containers = [pod_container(pod, tmp / pod.name, claims) for pod in pods]
    with Network({pod.name: pod.dns_names[1:] for pod in pods}) as network:
        return run_containers(engine, app_image.id, containers, timeout=400, network=network), claims


def assert_job_completed(run: tuple[Ended, dict[str, Path]], output_dir: str | None = None) -> dict:
    """Every pod exited 0, and the job's summary (in `output_dir`, default the ConfigMap's)
    says both pods trained every step; returns the summary."""
    ended, claims = run
    assert ended.codes == [0] * len(ended.codes), ended.tail()
    config = yaml.safe_load(k8s_objects()["ConfigMap"]["data"]["config.yaml"])
    (workspace,) = claims.values()
    run_dir = workspace / Path(output_dir or config["output_dir"]).relative_to("/workspace")
    assert (run_dir / "summary.json").stat().st_uid == UID  # the pod's runAsUser wrote it
    summary = read_summary(run_dir)
    assert summary["world_size"] == 2 and len(summary["hosts"]) == 2, summary
    assert summary["steps"] == config["train"]["max_steps"]
    return summary


def test_pytorchjob_runs_as_the_operator_starts_it(engine, app_image, tmp_path):
    pods = pytorchjob_pods(k8s_objects()["PyTorchJob"])
    assert [pod.name for pod in pods] == ["ddp-trainer-master-0", "ddp-trainer-worker-0"]
    assert pods[1].injected_env["WORLD_SIZE"] == "2" and pods[1].injected_env["RANK"] == "1"
    assert_job_completed(run_pods(engine, app_image, pods, tmp_path))


def test_elastic_pytorchjob_runs_as_the_operator_starts_it(engine, app_image, tmp_path):
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
    summary = assert_job_completed(run_pods(engine, app_image, pods, tmp_path), output_dir)
    assert summary["global_batch"] == 32


def test_trainjob_runs_as_the_runtime_starts_it(engine, app_image, tmp_path):
    pods = trainjob_pods(TRAINJOB, RUNTIME)
    assert pods[0].injected_env["PET_MASTER_ADDR"] == "ddp-trainer-node-0-0.ddp-trainer"
    assert_job_completed(run_pods(engine, app_image, pods, tmp_path))
