"""k8s/: what a cluster with the Kubeflow operator accepts, and a job that really runs.

No API server here, so each layer of acceptance is checked against the real thing:
- the PyTorchJob and TrainJob against their real CRD schemas (tests/schemas, closed: an
  unknown field is an error), the core objects with `kubernetes-validate --strict`;
- the PyTorchJob validating webhook's rules;
- the NetworkPolicies' selectors, against the labels the operators give the pods;
- the operator contract: each pod's training container runs in our image (tests/support/image.py)
  with its pod's security context, its env plus exactly what the operator injects, its
  ConfigMap materialized and its PVC shared, on a host named like the pod's Service. The
  2-pod job must finish with world size 2; so must the elastic variant (k8s/elastic/), from
  the elastic rendezvous the operator injects, and the TrainJob;
- the kustomize base renders to k8s/*.yaml exactly, and every overlay (sizes, the pinned
  image, the restricted namespace) and every component (Kueue, priority, GPU nodes), under a
  namePrefix/nameSuffix too, renders with `kubectl kustomize` (the load restrictions of
  `kubectl apply -k`) into objects that pass the same checks;
- every pod the operators would create, init containers included, passes the "restricted"
  Pod Security Standard (tests/support/k8s_pss.py);
- the restart contract (trainer/exit_codes.py) compiled into each job's restart rules: what
  the operator, or the Job and JobSet controllers, do with each verdict's exit code;
- the scoring Job (k8s/score): an Indexed Job under the same pod rules, its failure policy
  against the restart contract, renamed with every component, and its pods run in our image as
  the Job controller starts them, one of them killed and recreated: the scores equal one
  process's, every row once;
- the Katib Experiment (k8s/kustomize/katib) against Katib's CRD, API types and webhook rules
  (tests/support/katib.py), its trials equal to the base job but for Katib's parts, their pods under
  our pod rules, their commands through the trainer's config check, and Katib's collector rule
  on a real run's output.
"""

from __future__ import annotations

import copy
import dataclasses
import ipaddress
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml
from support.image import Container, Ended, run_containers
from support.k8s_pss import restricted_violations
from support.kubeflow import (
    Pod,
    jobset_action,
    pytorchjob_pods,
    pytorchjob_retries,
    pytorchjob_webhook_violations,
    trainjob_pods,
)
from support.netns import Network
from support.outputs import read_summary
from support.processes import wait_for
from support.runs import REPO
from support.users import UID

from trainer.cli import run_config, stage
from trainer.exit_codes import Exit, for_launcher

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
RUNTIME_SCHEMA = crd_validator("trainer.kubeflow.org_trainingruntimes.yaml")
TRAINJOB = yaml.safe_load((REPO / "k8s/trainjob/trainjob.yaml").read_text())
ELASTIC = yaml.safe_load((REPO / "k8s/elastic/pytorchjob.yaml").read_text())
RUNTIME = yaml.safe_load((REPO / "k8s/trainjob/trainingruntime.yaml").read_text())
CLUSTER_RUNTIME = yaml.safe_load((SCHEMAS / "torch_distributed_runtime.yaml").read_text())
POLICY_FILES = {"pytorchjob": REPO / "k8s/networkpolicy.yaml", "elastic": REPO / "k8s/elastic/networkpolicy.yaml",
                "trainjob": REPO / "k8s/trainjob/networkpolicy.yaml"}
SCORE_FILES = [REPO / "k8s/score/job.yaml", REPO / "k8s/score/networkpolicy.yaml"]
SCORE_JOB, SCORE_POLICY = (yaml.safe_load(path.read_text()) for path in SCORE_FILES)


def test_k8s_folder_holds_exactly_the_job_objects():
    objects = k8s_objects()
    assert set(objects) == {"PyTorchJob", "ConfigMap", "PersistentVolumeClaim", "NetworkPolicy"}
    assert objects["PyTorchJob"]["apiVersion"] == "kubeflow.org/v1"
    core = [REPO / "k8s/configmap.yaml", REPO / "k8s/pvc.yaml", *POLICY_FILES.values(), *SCORE_FILES]
    result = subprocess.run([BIN / "kubernetes-validate", "--strict", *core], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("passed") == len(core), result.stdout


def test_jobs_validate_against_their_crds():
    PYTORCHJOB_SCHEMA.validate(k8s_objects()["PyTorchJob"])
    PYTORCHJOB_SCHEMA.validate(ELASTIC)
    TRAINJOB_SCHEMA.validate(TRAINJOB)
    RUNTIME_SCHEMA.validate(RUNTIME)
    # ... and the closed schemas do reject what a cluster would drop or refuse:
    job = copy.deepcopy(k8s_objects()["PyTorchJob"])
    job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["gpus"] = 1
    with pytest.raises(jsonschema.ValidationError, match="gpus"):
        PYTORCHJOB_SCHEMA.validate(job)
    job = copy.deepcopy(TRAINJOB)
    job["spec"]["trainer"]["numProcPerNode"] = "1"
    with pytest.raises(jsonschema.ValidationError, match="integer"):
        TRAINJOB_SCHEMA.validate(job)
    runtime = mutate("spec.template.spec.failurePolicy.rules.0.action", "Retry")(RUNTIME)
    with pytest.raises(jsonschema.ValidationError, match="Retry"):
        RUNTIME_SCHEMA.validate(runtime)


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
    (mutate(f"{REPLICAS}.Master", {"template": {"spec": {"containers": [{"name": "pytorch"}]}}}),
     "Master.replicas must be set to 1"),
    (mutate(f"{REPLICAS}.Master", {"replicas": 2, "template": {"spec": {"containers": [{"name": "pytorch"}]}}}),
     "Master.replicas must be set to 1"),
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
    assert {"backoffLimit", "cleanPodPolicy", "ttlSecondsAfterFinished"} <= set(job["spec"]["runPolicy"])
    assert RUNTIME["spec"]["template"]["spec"]["ttlSecondsAfterFinished"] > 0
    for pod in pytorchjob_pods(job) + pytorchjob_pods(ELASTIC) + trainjob_pods(TRAINJOB, RUNTIME):
        container = pod.container
        assert container["image"] == IMAGE
        # tini as PID 1 (a `command:` replaces the image's entrypoint), then torchrun through
        # trainer.cli.torchrun (its exit code is the verdict), with no rendezvous flags.
        assert container["command"][:6] == ["tini", "--", "python", "-m", "trainer.cli.torchrun", "-m"], \
            container["command"]
        assert not [arg for arg in container["command"][6:] if arg.startswith("--")], container["command"]
        # The data checked before any rank starts (trainer.cli.torchrun's TRAINER_CHECK).
        assert {e["name"]: e.get("value") for e in container["env"]}["TRAINER_CHECK"] == "1"
        assert pod.annotations["sidecar.istio.io/inject"] == "false"
        assert pod.spec["securityContext"]["runAsNonRoot"] is True
        assert pod.spec["securityContext"]["runAsUser"] == UID != 0
        assert pod.spec["securityContext"]["fsGroupChangePolicy"] == "OnRootMismatch"
        assert pod.spec["automountServiceAccountToken"] is False
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
        # Secrets by reference, each optional: a pod starts without them (k8s/README.md's names).
        # No Hub token unless asked for (components/hf-token: test_the_hub_token_is_only_where_it_is_needed).
        secrets = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container["env"] if "valueFrom" in e}
        assert secrets == {"WANDB_API_KEY": {"name": "wandb", "key": "api-key", "optional": True}}, pod.name
        assert not [e for e in container["env"] if e["name"].startswith("PET_")]
    for each in (job, ELASTIC):
        for replica in each["spec"]["pytorchReplicaSpecs"].values():
            assert replica["restartPolicy"] == "ExitCode"
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


KUSTOMIZE = REPO / "k8s/kustomize"
OVERLAYS = sorted(path.name for path in (KUSTOMIZE / "overlays").iterdir())
COMPONENTS = sorted(path.name for path in (KUSTOMIZE / "components").iterdir())


def kustomize(folder: Path) -> list[dict]:
    """`kubectl kustomize` as `kubectl apply -k` runs it: with the default load restrictions."""
    result = subprocess.run([BIN / "kubectl", "kustomize", folder], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def by_kind(objects: list[dict]) -> dict[str, dict]:
    kinds = {o["kind"]: o for o in objects}
    assert len(kinds) == len(objects), [o["kind"] for o in objects]
    return kinds


@pytest.fixture(scope="module")
def renderings(tmp_path_factory) -> dict[str, dict[str, dict]]:
    """Every overlay's objects by kind, and a user's overlay of 4x8 with every component and
    the job renamed (namePrefix and nameSuffix): the kustomization beside the tests reaches
    the repository by a relative path, as `kubectl apply -k` requires."""
    found = {"base": by_kind(kustomize(KUSTOMIZE / "base"))}
    found.update({name: by_kind(kustomize(KUSTOMIZE / "overlays" / name)) for name in OVERLAYS})
    user = tmp_path_factory.mktemp("overlay")
    up = Path(os.path.relpath(KUSTOMIZE, user))
    (user / "kustomization.yaml").write_text(yaml.safe_dump({
        "resources": [str(up / "overlays/4x8")], "components": [str(up / "components" / c) for c in COMPONENTS],
        "namePrefix": "team-a-", "nameSuffix": "-v2"}))
    found["renamed-4x8-with-every-component"] = by_kind(kustomize(user))
    return found


def test_top_level_manifests_are_the_base_rendering(renderings):
    """`kubectl apply -f k8s/` and `kubectl apply -k k8s/kustomize/base` apply the same objects."""
    assert renderings["base"] == k8s_objects()
    assert not (REPO / "k8s/kustomization.yaml").exists(), "it would break `kubectl apply -f k8s/`"


def test_every_rendering_validates_and_fences_its_own_pods(renderings, tmp_path):
    """Each rendering's PyTorchJob against the CRD and the webhook, its core objects with
    kubernetes-validate --strict, and its NetworkPolicy selects every pod of its job (renamed
    or not) and no pod of the job as the base names it."""
    core = []
    base_pods = pytorchjob_pods(renderings["base"]["PyTorchJob"])
    for name, objects in renderings.items():
        job = objects["PyTorchJob"]
        PYTORCHJOB_SCHEMA.validate(job)
        assert pytorchjob_webhook_violations(job) == [], name
        core += [o for kind, o in objects.items() if kind != "PyTorchJob"]
        spec = objects["NetworkPolicy"]["spec"]
        (rule,) = spec["ingress"]
        (peer,) = rule["from"]
        pods = pytorchjob_pods(job)
        for pod in pods:
            assert selects(spec["podSelector"], pod.labels), (name, pod.name)
            assert selects(peer["podSelector"], pod.labels), (name, pod.name)
            volumes = {v["name"]: v for v in pod.spec["volumes"]}
            assert volumes["config"]["configMap"]["name"] == objects["ConfigMap"]["metadata"]["name"], name
            assert volumes["workspace"]["persistentVolumeClaim"]["claimName"] == \
                objects["PersistentVolumeClaim"]["metadata"]["name"], name
        if job["metadata"]["name"] != "ddp-trainer":
            assert not any(selects(spec["podSelector"], pod.labels) for pod in base_pods), name
    assert renderings["renamed-4x8-with-every-component"]["PyTorchJob"]["metadata"]["name"] == "team-a-ddp-trainer-v2"
    files = tmp_path / "core.yaml"
    files.write_text(yaml.safe_dump_all(core))
    result = subprocess.run([BIN / "kubernetes-validate", "--strict", files], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def env_of(container: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


def quantity_gi(value: str) -> int:
    assert value.endswith("Gi"), value
    return int(value[:-2])


def test_overlays_size_the_pod_together(renderings):
    """nprocPerNode, the GPU limit, CPU, memory, /dev/shm and OMP_NUM_THREADS move together,
    and the backoff limit follows the pod count."""
    sizes = {}
    for name, objects in renderings.items():
        job = objects["PyTorchJob"]
        nproc = int(job["spec"]["nprocPerNode"])
        (pod, *_) = pods = pytorchjob_pods(job)
        resources, env = pod.container["resources"], env_of(pod.container)
        assert resources["limits"]["nvidia.com/gpu"] == nproc, name
        assert int(env["OMP_NUM_THREADS"]) * nproc == int(resources["requests"]["cpu"]), name
        assert resources["requests"]["memory"] == resources["limits"]["memory"], name
        shm = {v["name"]: v for v in pod.spec["volumes"]}["dshm"]["emptyDir"]["sizeLimit"]
        # /dev/shm's pages count against the memory limit: at most half of it.
        assert 2 * quantity_gi(shm) <= quantity_gi(resources["limits"]["memory"]), name
        assert job["spec"]["runPolicy"]["backoffLimit"] == 3 * len(pods), name
        sizes[name] = (len(pods), nproc)
    assert {sizes[n] for n in ("1x8", "2x8", "4x8")} == {(1, 8), (2, 8), (4, 8)}


def test_grace_settings_agree():
    """torchrun kills its ranks TORCH_ELASTIC_SHUTDOWN_TIMEOUT after forwarding SIGTERM, the
    kubelet kills torchrun terminationGracePeriodSeconds after sending it: the first must end
    before the second (torchrun then still exits with its verdict), and TRAINER_GRACE_S, what
    doctor holds the checkpoint save time against, is what the ranks really get."""
    pods = [*pytorchjob_pods(k8s_objects()["PyTorchJob"]), *pytorchjob_pods(ELASTIC), *trainjob_pods(TRAINJOB, RUNTIME)]
    for pod in pods:
        env, grace = env_of(pod.container), pod.spec["terminationGracePeriodSeconds"]
        shutdown = int(env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"])
        assert 5 <= grace - shutdown <= 15, pod.name
        assert int(env["TRAINER_GRACE_S"]) == shutdown, pod.name


def test_the_pvc_asks_for_a_shared_class_by_name():
    """ReadWriteMany, and a storage class the user must name: the placeholder is not a DNS
    subdomain, so the API server refuses the claim (naming spec.storageClassName) instead of
    leaving it Pending on a ReadWriteOnce default class."""
    spec = k8s_objects()["PersistentVolumeClaim"]["spec"]
    assert spec["accessModes"] == ["ReadWriteMany"]
    dns_subdomain = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
    assert not dns_subdomain.match(spec["storageClassName"])
    assert dns_subdomain.match("efs-sc") and dns_subdomain.match("azurefile-csi")


def test_pods_pass_the_restricted_pod_security_standard(renderings):
    """Every pod the operators would create from our manifests, init containers included,
    and the namespace overlay enforces the standard. A job with a Master would not pass:
    the operator gives its Workers an init container of its own."""
    pods = [pod for objects in renderings.values() for pod in pytorchjob_pods(objects["PyTorchJob"])]
    pods += pytorchjob_pods(ELASTIC) + trainjob_pods(TRAINJOB, RUNTIME)
    for pod in pods:
        assert restricted_violations(pod.spec) == [], pod.name
        assert "initContainers" not in pod.spec, pod.name
    with_master = yaml.safe_load(json.dumps(k8s_objects()["PyTorchJob"]))
    del with_master["spec"]["elasticPolicy"]
    replicas = with_master["spec"]["pytorchReplicaSpecs"]
    replicas["Master"] = {**copy.deepcopy(replicas["Worker"]), "replicas": 1}
    master, worker, *_ = pytorchjob_pods(with_master)
    assert restricted_violations(master.spec) == []
    assert "init-pytorch: allowPrivilegeEscalation is not false" in restricted_violations(worker.spec)
    # ... and the checks see what a pod would break:
    assert restricted_violations({**master.spec, "hostNetwork": True}) == ["hostNetwork: true"]
    assert restricted_violations({**master.spec, "volumes": [{"name": "h", "hostPath": {"path": "/"}}]}) == \
        ["volume h: hostPath", "volume h: type ['hostPath'] not allowed"]
    assert restricted_violations({**master.spec, "securityContext": {"runAsUser": 1000}}) == \
        ["pytorch: runAsNonRoot is not true", "pytorch: seccompProfile is unset, not RuntimeDefault or Localhost"]

    namespace = renderings["restricted-namespace"]
    labels = namespace["Namespace"]["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "restricted"
    assert {o["metadata"].get("namespace") for kind, o in namespace.items() if kind != "Namespace"} == \
        {namespace["Namespace"]["metadata"]["name"]}


def test_components_queue_prioritise_and_place_the_job(renderings):
    """Kueue admits the job whole (its queue label, created suspended), its pods' priority,
    and GPU nodes only, each validated with the CRD above."""
    job = renderings["renamed-4x8-with-every-component"]["PyTorchJob"]
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"]
    assert job["spec"]["runPolicy"]["suspend"] is True
    (pod, *_) = pytorchjob_pods(job)
    assert pod.spec["priorityClassName"]
    assert pod.spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod.spec["tolerations"]
    assert "suspend" not in renderings["base"]["PyTorchJob"]["spec"]["runPolicy"]


def pinned_image() -> str:
    """The image every digest overlay names: components/image's registry and digest."""
    kustomization = yaml.safe_load((KUSTOMIZE / "components/image/kustomization.yaml").read_text())
    (override,) = kustomization["images"]
    assert override["name"] == IMAGE.split(":")[0] and "newTag" not in override
    return f"{override['newName']}@{override['digest']}"


def test_image_overlay_pins_a_digest(renderings):
    objects = renderings["image"]
    kustomization = yaml.safe_load((KUSTOMIZE / "components/image/kustomization.yaml").read_text())
    (override,) = kustomization["images"]
    assert override["name"] == IMAGE.split(":")[0] and "newTag" not in override
    wanted = f"{override['newName']}@{override['digest']}"
    assert re.fullmatch(r"[^@:]+@sha256:[0-9a-f]{64}", wanted)
    assert {pod.container["image"] for pod in pytorchjob_pods(objects["PyTorchJob"])} == {wanted}
    # Nothing else changed: the rendered objects are k8s/*.yaml with the image replaced.
    assert objects == yaml.safe_load(json.dumps(k8s_objects()).replace(f'"{IMAGE}"', f'"{wanted}"'))

    # The image the manifests name is the one the Dockerfile, compose and README build.
    version = re.search(r'^version = "(.+)"', (REPO / "pyproject.toml").read_text(), re.M).group(1)
    assert f"ddp-trainer:{version}" == IMAGE
    assert f'org.opencontainers.image.version="{version}"' in (REPO / "Dockerfile").read_text()
    assert f"docker build -t {IMAGE} ." in (REPO / "k8s/README.md").read_text()
    assert f"${{TRAINER_IMAGE:-{IMAGE}}}" in (REPO / "docker-compose.yml").read_text()
    assert TRAINJOB["spec"]["trainer"]["image"] == IMAGE


def images_in(value) -> list[str]:
    """Every `image` a manifest names, wherever it is (a pod's containers, a TrainJob's trainer)."""
    if isinstance(value, list):
        return [image for item in value for image in images_in(item)]
    if not isinstance(value, dict):
        return []
    return [image for key, item in value.items() for image in ([item] if key == "image" else images_in(item))]


def test_every_manifest_with_an_image_has_a_digest_overlay():
    """k8s/kustomize/overlays/image pins the job, and its folders stage-data, elastic, trainjob
    and score the other manifests: together they render every object of k8s/ that names an
    image, and no image of theirs is left without the digest."""
    wanted = pinned_image()
    rendered = {}
    for folder in [KUSTOMIZE / "overlays/image", *sorted(p for p in (KUSTOMIZE / "overlays/image").iterdir()
                                                          if p.is_dir())]:
        for o in kustomize(folder):
            assert set(images_in(o)) <= {wanted}, (folder.name, o["kind"], images_in(o))
            rendered[o["kind"], o["metadata"]["name"]] = o
    named = {(o["kind"], o["metadata"]["name"]) for path in (REPO / "k8s").rglob("*.yaml")
             if "kustomize" not in path.parts for o in load_all(path) if images_in(o)}
    assert named == {("PyTorchJob", "ddp-trainer"), ("PyTorchJob", "ddp-trainer-elastic"), ("TrainJob", "ddp-trainer"),
                     ("TrainingRuntime", "ddp-trainer"), ("Job", "ddp-trainer-stage-data"),
                     ("Job", "ddp-trainer-score")}
    assert named <= set(rendered), named - set(rendered)
    for key in named:
        assert images_in(rendered[key]), key
    # Each folder's kustomization holds exactly the folder's manifests, as `kubectl apply -f` applies them.
    for folder in ("stage-data", "elastic", "trainjob", "score"):
        files = sorted(path.name for path in (REPO / "k8s" / folder).iterdir() if path.suffix in (".yaml", ".yml"))
        assert sorted(yaml.safe_load((REPO / "k8s" / folder / "Kustomization").read_text())["resources"]) == files


def overlay(folder: Path, resources: list[Path], components: list[str], **more) -> dict[str, dict]:
    """The objects of a kustomization in `folder` of `resources` (folders of k8s/) and
    `components` (by name), reached by relative paths as `kubectl apply -k` requires."""
    folder.mkdir(parents=True)
    up = lambda path: str(Path(os.path.relpath(path, folder)))  # noqa: E731
    (folder / "kustomization.yaml").write_text(yaml.safe_dump({
        "resources": [up(path) for path in resources],
        "components": [up(KUSTOMIZE / "components" / name) for name in components], **more}))
    return by_kind(kustomize(folder))


def test_the_hub_token_is_only_where_it_is_needed(renderings, tmp_path):
    """HF_TOKEN is in the staging Job, which fills the HF cache with a gated model once, and in
    a training pod only with components/hf-token (a gated model not cached, hub.push_at_end):
    not in any other manifest or rendering, so code run in a training pod cannot read it."""
    token = {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token", "optional": True}}}
    assert token in job_pod(STAGE_JOB).container["env"]
    plain = [*k8s_objects().values(), ELASTIC, TRAINJOB, RUNTIME, SCORE_JOB]
    plain += [o for name, objects in renderings.items() if name != "renamed-4x8-with-every-component"
              for o in objects.values()]
    for o in plain:
        assert "HF_TOKEN" not in json.dumps(o), (o["kind"], o["metadata"]["name"])
    with_token = [
        *pytorchjob_pods(overlay(tmp_path / "job", [KUSTOMIZE / "overlays/2x8"], ["hf-token"])["PyTorchJob"]),
        *pytorchjob_pods(overlay(tmp_path / "elastic", [REPO / "k8s/elastic"], ["hf-token"])["PyTorchJob"]),
        *trainjob_pods(overlay(tmp_path / "trainjob", [REPO / "k8s/trainjob"], ["hf-token"])["TrainJob"], RUNTIME),
        *pytorchjob_pods(renderings["renamed-4x8-with-every-component"]["PyTorchJob"])]
    assert len(with_token) == 2 + 2 + 2 + 4
    for pod in with_token:
        assert [e for e in pod.container["env"] if e["name"] == "HF_TOKEN"] == [token], pod.name


def test_the_egress_component_fences_what_the_pods_reach(renderings, tmp_path):
    """components/egress: the job's pods reach their peers (every port), DNS, and https outside
    the private and link-local ranges (the cloud's metadata service, 169.254.169.254, not),
    for the PyTorchJob renamed, the elastic job and the TrainJob; each policy passes
    kubernetes-validate --strict. Without it, egress is not fenced."""
    assert "Egress" not in json.dumps([o["spec"]["policyTypes"] for o in
                                       (renderings["base"]["NetworkPolicy"], *load_all(POLICY_FILES["elastic"]),
                                        *load_all(POLICY_FILES["trainjob"]))])
    renamed = renderings["renamed-4x8-with-every-component"]
    cases = [(renamed["NetworkPolicy"], pytorchjob_pods(renamed["PyTorchJob"]),
              pytorchjob_pods(renderings["base"]["PyTorchJob"]))]
    elastic = overlay(tmp_path / "elastic", [REPO / "k8s/elastic"], ["egress"])
    cases.append((elastic["NetworkPolicy"], pytorchjob_pods(elastic["PyTorchJob"]), job_pods()["pytorchjob"]))
    trainjob = overlay(tmp_path / "trainjob", [REPO / "k8s/trainjob"], ["egress"])
    cases.append((trainjob["NetworkPolicy"], trainjob_pods(trainjob["TrainJob"], trainjob["TrainingRuntime"]),
                  job_pods()["pytorchjob"] + job_pods()["elastic"]))
    for policy, pods, others in cases:
        spec = policy["spec"]
        assert spec["policyTypes"] == ["Ingress", "Egress"]
        peers, dns, https = spec["egress"]
        (peer,) = peers["to"]
        assert set(peers) == {"to"} and set(peer) == {"podSelector"}, "every port of the job's own pods"
        assert all(selects(peer["podSelector"], pod.labels) for pod in pods), policy["metadata"]["name"]
        assert not any(selects(peer["podSelector"], pod.labels) for pod in others), policy["metadata"]["name"]
        assert dns == {"ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]}
        assert https["ports"] == [{"protocol": "TCP", "port": 443}]
        (block,) = https["to"]
        internet = ipaddress.ip_network(block["ipBlock"]["cidr"])
        excepted = [ipaddress.ip_network(cidr) for cidr in block["ipBlock"]["except"]]
        for address in ("169.254.169.254", "10.96.0.1", "172.17.0.2", "192.168.1.1", "100.64.0.10", "127.0.0.1"):
            assert any(ipaddress.ip_address(address) in net for net in excepted), address
        assert ipaddress.ip_address("18.164.174.23") in internet  # huggingface.co, say
        assert not any(ipaddress.ip_address("18.164.174.23") in net for net in excepted)
    file = tmp_path / "policies.yaml"
    file.write_text(yaml.safe_dump_all([policy for policy, _, _ in cases]))
    result = subprocess.run([BIN / "kubernetes-validate", "--strict", file], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("passed") == len(cases), result.stdout


# What each verdict must lead to: restart the job (counted or not against its budget), or fail it.
CONTRACT = {Exit.CRASH: "retry", Exit.PREEMPTED: "retry uncounted", Exit.NODE_FAULT: "retry",
            Exit.USAGE: "fail", Exit.NO_PROGRESS: "fail"}


def test_pytorchjob_restart_policy_follows_the_exit_codes():
    """restartPolicy ExitCode recreates a pod whose code is 128 or more and fails the job on
    any other: the pods' TRAINER_RETRYABLE_EXIT_CODE must map every retryable verdict there,
    and leave 2 and 77 below. (The v1.9 operator counts no ExitCode restart against
    backoffLimit, so "retry" and "retry uncounted" are the same here.) torchrun stopped by
    SIGTERM (143: an eviction) is retried too."""
    for job in (k8s_objects()["PyTorchJob"], ELASTIC):
        (kind,) = job["spec"]["pytorchReplicaSpecs"]
        (pod, *_) = pytorchjob_pods(job)
        for verdict, wanted in CONTRACT.items():
            code = for_launcher(verdict, env_of(pod.container))
            assert pytorchjob_retries(job, kind, code) == wanted.startswith("retry"), (verdict, code)
        assert pytorchjob_retries(job, kind, 128 + 15)
    # Without the variable, every verdict but a signal's would fail the job:
    assert not pytorchjob_retries(k8s_objects()["PyTorchJob"], "Worker", for_launcher(Exit.CRASH, {}))


def test_trainjob_failure_policy_follows_the_exit_codes():
    """The node Job's podFailurePolicy and the JobSet's failurePolicy rules, for each verdict:
    2 and 77 fail the TrainJob, 75 (and torchrun's 143 on SIGTERM) restart it without using
    maxRestarts, 1 and 76 restart it within maxRestarts."""
    (pod, *_) = trainjob_pods(TRAINJOB, RUNTIME)
    assert "TRAINER_RETRYABLE_EXIT_CODE" not in env_of(pod.container), "the rules read the verdicts themselves"
    actions = {"retry": "RestartJobSet", "retry uncounted": "RestartJobSetAndIgnoreMaxRestarts", "fail": "FailJobSet"}
    for verdict, wanted in CONTRACT.items():
        assert jobset_action(RUNTIME, for_launcher(verdict, env_of(pod.container))) == actions[wanted], verdict
    assert jobset_action(RUNTIME, 128 + 15) == "RestartJobSetAndIgnoreMaxRestarts"
    assert jobset_action(RUNTIME, 137) == "RestartJobSet"  # SIGKILL: the OOM killer, or a save past the grace
    spec = RUNTIME["spec"]["template"]["spec"]
    assert spec["failurePolicy"]["maxRestarts"] >= 1
    (node,) = spec["replicatedJobs"]
    assert node["template"]["spec"]["template"]["spec"]["restartPolicy"] == "Never", "podFailurePolicy requires it"


def test_trainjob_fits_the_runtime():
    """Our runtime keeps the cluster torch-distributed runtime's shape (the replicated job and
    container called `node`, the trainer ancestor label, the torch policy), and TrainJob
    refuses PET_* in trainer.env: the runtime owns them."""
    (pod, *_) = trainjob_pods(TRAINJOB, RUNTIME)
    assert pod.container["name"] == "node"
    assert not [e for e in TRAINJOB["spec"]["trainer"]["env"] if e["name"].startswith("PET_")]
    ref = TRAINJOB["spec"]["runtimeRef"]
    assert (ref["kind"], ref["name"]) == (RUNTIME["kind"], RUNTIME["metadata"]["name"])
    ours, theirs = RUNTIME["spec"], CLUSTER_RUNTIME["spec"]
    assert ours["mlPolicy"].keys() == theirs["mlPolicy"].keys()
    (node,), (their_node,) = ours["template"]["spec"]["replicatedJobs"], theirs["template"]["spec"]["replicatedJobs"]
    assert node["name"] == their_node["name"]
    assert node["template"]["metadata"]["labels"] == their_node["template"]["metadata"]["labels"]


def security_options(pod: Pod) -> list[str]:
    """The pod's and its container's securityContext as podman applies it. A field this does
    not know fails the test, rather than running the container with less than the manifest asks."""
    pod_context, context = pod.spec.get("securityContext", {}), pod.container.get("securityContext", {})
    # fsGroupChangePolicy: pod_container chowns the claim's root only, as OnRootMismatch does.
    assert set(pod_context) <= {"runAsNonRoot", "runAsUser", "runAsGroup", "fsGroup", "fsGroupChangePolicy",
                                "seccompProfile"}, pod_context
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


def pod_container(pod: Pod, root: Path, claims: dict[str, Path], configmap: dict | None = None) -> Container:
    """The pod's training container as the kubelet starts it: its command, its env plus what
    the operator injects, its security context, and every volume made real: a ConfigMap's
    files (`configmap`, default k8s/configmap.yaml's; read-only), one shared folder per PVC
    (`claims`: made on first use, group-owned by fsGroup, as the kubelet sets it), a
    memory-backed /dev/shm of the emptyDir's size, a private emptyDir."""
    configmap = configmap or k8s_objects()["ConfigMap"]
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
    # As the kubelet does: a `command:` replaces the image's ENTRYPOINT, `args:` its CMD.
    if "command" in pod.container:
        options.append(f"--entrypoint={json.dumps(pod.container['command'])}")
    return Container(pod.name, pod.container.get("args", []), {**env, **pod.injected_env}, mounts, options,
                     pod.dns_names[1:])


def run_pods(engine, app_image, pods: list[Pod], tmp: Path, configmap: dict | None = None,
             claims: dict[str, Path] | None = None) -> tuple[Ended, dict[str, Path]]:
    """Every pod's training container in our image, each on a host named as its Service;
    returns how they ended and the host folder of each PVC (`claims`: those that exist already)."""
    assert {pod.container["image"] for pod in pods} == {IMAGE}
    claims = {} if claims is None else claims
    containers = [pod_container(pod, tmp / pod.name, claims, configmap) for pod in pods]
    with Network({pod.name: pod.dns_names[1:] for pod in pods}) as network:
        return run_containers(engine, app_image.id, containers, timeout=400, network=network), claims


def assert_job_completed(run: tuple[Ended, dict[str, Path]], output_dir: str | None = None,
                         configmap: dict | None = None) -> dict:
    """Every pod exited 0, and the job's summary (in `output_dir`, default the ConfigMap's)
    says both pods trained every step; returns the summary."""
    ended, claims = run
    assert ended.codes == [0] * len(ended.codes), ended.tail()
    config = yaml.safe_load((configmap or k8s_objects()["ConfigMap"])["data"]["config.yaml"])
    workspace = claims[k8s_objects()["PersistentVolumeClaim"]["metadata"]["name"]]
    run_dir = workspace / Path(output_dir or config["output_dir"]).relative_to("/workspace")
    assert (run_dir / "summary.json").stat().st_uid == UID  # the pod's runAsUser wrote it
    summary = read_summary(run_dir)
    assert summary["world_size"] == 2 and len(summary["hosts"]) == 2, summary
    assert summary["steps"] == config["train"]["max_steps"]
    return summary


def test_pytorchjob_runs_as_the_operator_starts_it(engine, app_image, tmp_path):
    """Two Worker pods, a fixed-size c10d rendezvous on worker-0 from the operator's PET_*."""
    pods = pytorchjob_pods(k8s_objects()["PyTorchJob"])
    assert [pod.name for pod in pods] == ["ddp-trainer-worker-0", "ddp-trainer-worker-1"]
    env = pods[1].injected_env
    assert (env["PET_NNODES"], env["PET_RDZV_ENDPOINT"]) == ("2", "ddp-trainer-worker-0:23456")
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


STAGE_JOB = yaml.safe_load((REPO / "k8s/stage-data/job.yaml").read_text())
USERS_CONFIG = """\
model:
  name: acme/tiny-bert  # from the HF cache on the PVC, which the staging Job filled
  revision: v2
data:
  path: /workspace/data/sentiment  # staged by k8s/stage-data/job.yaml
  text_field: review
  label_field: sentiment
  max_length: 64
  max_eval_samples: 32
train:
  batch_size: 8
  max_steps: 4
  log_every: 2
wandb:
  mode: disabled
output_dir: /workspace/runs/my-job
"""


def docs_block(starting: str) -> str:
    """The fenced block of k8s/README.md whose first line is `starting`."""
    blocks = re.findall(r"```\w*\n(.*?)```", (REPO / "k8s/README.md").read_text(), re.S)
    (block,) = [b for b in blocks if b.startswith(starting)]
    return block


@pytest.fixture
def users_overlay(tmp_path) -> Path:
    """my-job/ as k8s/README.md shows it (its kustomization.yaml, word for word), beside a
    clone called ddp-finetune, with a config of the user's own."""
    lab = tmp_path / "lab"
    (lab / "my-job").mkdir(parents=True)
    (lab / "ddp-finetune").symlink_to(REPO)
    (lab / "my-job/kustomization.yaml").write_text(docs_block("# my-job/kustomization.yaml"))
    (lab / "my-job/config.yaml").write_text(USERS_CONFIG)
    return lab / "my-job"


def test_a_users_overlay_gives_the_pods_their_config_and_applying_it_again_changes_nothing(users_overlay):
    first, again = kustomize(users_overlay), kustomize(users_overlay)
    assert first == again
    objects = by_kind(first)
    assert set(objects) == {"ConfigMap", "PersistentVolumeClaim", "PyTorchJob", "NetworkPolicy"}
    configmap = objects["ConfigMap"]
    assert configmap["data"] == {"config.yaml": USERS_CONFIG}  # the demo's is gone, not merged
    (volume,) = [v for v in pytorchjob_pods(objects["PyTorchJob"])[0].spec["volumes"] if "configMap" in v]
    assert volume["configMap"]["name"] == configmap["metadata"]["name"] == "ddp-trainer-config"
    PYTORCHJOB_SCHEMA.validate(objects["PyTorchJob"])


def job_pod(job: dict) -> Pod:
    """The pod a batch/v1 Job creates for one try: its template, no variables injected."""
    template = job["spec"]["template"]
    (container,) = template["spec"]["containers"]
    name = f"{job['metadata']['name']}-try-0"
    return Pod(name, [name], template["metadata"].get("annotations", {}), template["metadata"]["labels"],
               template["spec"], container, {})


def test_the_staging_job_runs_as_the_trainer_does_and_fails_at_once_on_a_usage_error(tmp_path):
    """The same pod security (and so the same owner of what it writes), the same claim, and
    a podFailurePolicy that retries a network failure but not a source that can never work."""
    pod = job_pod(STAGE_JOB)
    trainer_pod = pytorchjob_pods(k8s_objects()["PyTorchJob"])[0]
    assert restricted_violations(pod.spec) == []
    assert pod.spec["securityContext"] == trainer_pod.spec["securityContext"]
    assert pod.container["securityContext"] == trainer_pod.container["securityContext"]
    assert pod.spec["automountServiceAccountToken"] is False and pod.spec["restartPolicy"] == "Never"
    claims = {v["persistentVolumeClaim"]["claimName"] for v in pod.spec["volumes"] if "persistentVolumeClaim" in v}
    assert claims == {k8s_objects()["PersistentVolumeClaim"]["metadata"]["name"]}
    assert pod.container["command"][:6] == ["tini", "--", "python", "-m", "trainer.cli.stage", "--to"]
    (rule,) = STAGE_JOB["spec"]["podFailurePolicy"]["rules"]
    assert rule == {"action": "FailJob", "onExitCodes": {"containerName": pod.container["name"], "operator": "In",
                                                         "values": [int(Exit.USAGE)]}}
    assert STAGE_JOB["spec"]["backoffLimit"] > 0  # Exit.CRASH (the network) is tried again
    # ... but not for ever: a try's downloads end by stage's deadline, and every try by the Job's.
    assert STAGE_JOB["spec"]["activeDeadlineSeconds"] > stage.DEADLINE_S
    file = tmp_path / "job.yaml"
    file.write_text(yaml.safe_dump(STAGE_JOB))
    result = subprocess.run([BIN / "kubernetes-validate", "--strict", file], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_users_overlay_trains_on_data_and_a_model_a_staging_job_put_on_the_pvc(engine, app_image, users_overlay,
                                                                                  tiny_model, tmp_path):
    """The README's path for a user's own job on nodes without internet: stage the data (a URL,
    and a file on a volume the user has) and the Hub model, then apply the overlay with the
    offline component. The staging Job's pod and the job's pods run as the kubelet starts
    them, on one PVC; the Hub (on the web host) is gone before training starts."""
    from support.fake_hub import commit

    from trainer.data import demo

    rows = demo.sentiment(tmp_path / "generated", rows=240).read_text().splitlines(keepends=True)
    served, volume = tmp_path / "served", tmp_path / "claims/my-existing-claim"
    served.mkdir()
    volume.mkdir(parents=True)
    (served / "train.csv").write_text("".join(rows[:201]))
    (volume / "test.csv").write_text("".join(rows[:1] + rows[201:]))
    # The Job with its sources named, and the volume mounted, as the README says to.
    job = copy.deepcopy(STAGE_JOB)
    pod = job_pod(job)
    pod.container["command"] = [*pod.container["command"][:6], "/workspace/data/sentiment", "--allow-http",
                                "http://web:8080/train.csv", "/source/test.csv", "--model", "acme/tiny-bert",
                                "--revision", "v2"]
    pod.container["env"].append({"name": "HF_ENDPOINT", "value": "http://web:8081"})  # the Hub, here
    pod.container["volumeMounts"].append({"name": "source", "mountPath": "/source", "readOnly": True})
    pod.spec["volumes"].append({"name": "source", "persistentVolumeClaim": {"claimName": "my-existing-claim",
                                                                            "readOnly": True}})
    claims = {"my-existing-claim": volume}
    staging = pod_container(pod, tmp_path / pod.name, claims)
    with Network({pod.name: [], "web": []}) as network:
        network.spawn("web", [sys.executable, "-m", "http.server", "8080", "--directory", str(served)],
                      os.environ, served)
        network.spawn("web", [sys.executable, str(REPO / "tests/support/fake_hub.py"), "--listen", "0.0.0.0:8081",
                              "--repo", f"acme/tiny-bert@v2={tiny_model}", "--report", str(tmp_path / "hub.json")],
                      os.environ, tmp_path)
        listening = lambda: subprocess.run(["ip", "netns", "exec", network.namespaces["web"], "ss", "-ltnH"],  # noqa: E731
                                           capture_output=True, text=True).stdout
        wait_for(lambda: ":8080" in listening() and ":8081" in listening(), 30, "the web server and the Hub")
        staged = run_containers(engine, app_image.id, [staging], timeout=120, network=network)
    assert staged.codes == [0], staged.tail()
    assert "staged 2 file(s)" in staged.logs[pod.name]
    assert f"cached acme/tiny-bert at commit {commit('v2')}" in staged.logs[pod.name]
    workspace = claims[k8s_objects()["PersistentVolumeClaim"]["metadata"]["name"]]
    data = workspace / "data/sentiment"
    assert (data / "train.csv").read_text() == (served / "train.csv").read_text()
    assert {path.stat().st_uid for path in data.iterdir()} == {UID}

    with (users_overlay / "kustomization.yaml").open("a") as f:  # as k8s/README.md says, for nodes without internet
        f.write("components: [../ddp-finetune/k8s/kustomize/components/offline]\n")
    objects = by_kind(kustomize(users_overlay))
    pods = pytorchjob_pods(objects["PyTorchJob"])
    assert_job_completed(run_pods(engine, app_image, pods, tmp_path / "job", objects["ConfigMap"], claims),
                         configmap=objects["ConfigMap"])
    # Trained on the URL's 200 rows, evaluated on the volume's test.csv (data.max_eval_samples of it).
    card = (workspace / "runs/my-job/final/README.md").read_text()
    assert "`/workspace/data/sentiment`: text from `review`, labels from `sentiment`; rows: train 200, validation 32." \
        in card


# --- Scoring a corpus: k8s/score, an Indexed Job ------------------------------------------------------

KUBELET_ENV = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}
"""What the kubelet gives every container, whatever the pod asks (the API server's Service)."""


def indexed_job_pods(job: dict) -> list[Pod]:
    """The pods of an Indexed Job (batch/v1), one per completion index, as the Job controller
    makes them: the hostname `JOB-INDEX` (Pod.name here: the pod's own name has a random
    suffix more, and a pod recreated for the index gets another), the index in its annotation,
    its label and JOB_COMPLETION_INDEX, the job-name labels; and the kubelet's variables."""
    name, spec = job["metadata"]["name"], job["spec"]
    assert spec["completionMode"] == "Indexed"
    pods = []
    for index in range(spec["completions"]):
        template = copy.deepcopy(spec["template"])
        (container,) = template["spec"]["containers"]
        hostname = f"{name}-{index}"
        labels = {**template["metadata"].get("labels", {}), "batch.kubernetes.io/job-name": name, "job-name": name,
                  "batch.kubernetes.io/job-completion-index": str(index)}
        annotations = {**template["metadata"].get("annotations", {}),
                       "batch.kubernetes.io/job-completion-index": str(index)}
        pods.append(Pod(hostname, [hostname], annotations, labels, template["spec"], container,
                        {"JOB_COMPLETION_INDEX": str(index), **KUBELET_ENV}))
    return pods


def job_pod_failure(job: dict, exit_code: int | None = None, condition: str | None = None) -> str:
    """What the Job controller does when a pod of `job` fails with its container's `exit_code`
    or with a pod `condition`: the first podFailurePolicy rule that matches decides (FailJob:
    "fail"; Ignore: "retry uncounted"; Count: "retry"); with none, the failure counts against
    backoffLimit ("retry")."""
    (container,) = job["spec"]["template"]["spec"]["containers"]
    actions = {"FailJob": "fail", "Ignore": "retry uncounted", "Count": "retry"}
    for rule in job["spec"].get("podFailurePolicy", {}).get("rules", []):
        if codes := rule.get("onExitCodes"):
            matches = (exit_code is not None and codes.get("containerName", container["name"]) == container["name"]
                       and (exit_code in codes["values"]) == (codes["operator"] == "In"))
        else:
            matches = any(c["type"] == condition and c.get("status", "True") == "True"
                          for c in rule["onPodConditions"])
        if matches:
            return actions[rule["action"]]
    return "retry" if job["spec"].get("backoffLimit", 6) > 0 else "fail"


def score_config(job: dict, configmap: dict, tmp: Path):
    """The scoring pod's command loaded as `python -m trainer score` loads it, with the
    ConfigMap's config (its data.path, the image's demo data, an empty folder here)."""
    from trainer.cli.main import command_args, parse_args

    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert container["command"][:6] == ["tini", "--", "python", "-m", "trainer", "score"], container["command"]
    file, data = tmp / "config.yaml", tmp / "data"
    data.mkdir()
    file.write_text(configmap["data"]["config.yaml"].replace("/app/data/reviews", str(data)))
    args = parse_args([str(file) if arg == "/etc/trainer/config.yaml" else arg for arg in container["command"][5:]])
    return run_config.load(args.config, command_args(args.command, args.overrides)[1])


def test_the_scoring_job_runs_as_the_trainer_does_and_follows_the_exit_codes(tmp_path):
    """An Indexed Job whose pods pass the "restricted" standard with the trainer's own security
    context, read the training job's ConfigMap and PVC, hold no secret, and spread by their index
    over as many tasks as the Job has completions; its failure policy follows the restart
    contract (a usage error fails the Job, a preemption or an eviction is retried uncounted);
    its command loads as the trainer loads it, reading final/ of the training's output_dir and
    writing on the PVC."""
    from trainer.runtime.environment import DistEnv
    from trainer.scoring.command import first_shard

    spec = SCORE_JOB["spec"]
    pods = indexed_job_pods(SCORE_JOB)
    trainer_pod = pytorchjob_pods(k8s_objects()["PyTorchJob"])[0]
    objects = k8s_objects()
    assert spec["parallelism"] == spec["completions"] == len(pods) >= 2
    for pod in pods:
        assert restricted_violations(pod.spec) == [], pod.name
        assert pod.spec["securityContext"] == trainer_pod.spec["securityContext"]
        assert pod.container["securityContext"] == trainer_pod.container["securityContext"]
        assert pod.spec["automountServiceAccountToken"] is False and pod.spec["restartPolicy"] == "Never"
        assert pod.annotations["sidecar.istio.io/inject"] == "false"
        assert pod.container["image"] == IMAGE
        volumes = {v["name"]: v for v in pod.spec["volumes"]}
        mounts = {m["mountPath"]: volumes[m["name"]] for m in pod.container["volumeMounts"]}
        assert mounts["/workspace"]["persistentVolumeClaim"]["claimName"] == \
            objects["PersistentVolumeClaim"]["metadata"]["name"]
        assert mounts["/etc/trainer"]["configMap"]["name"] == objects["ConfigMap"]["metadata"]["name"]
        assert "medium" not in mounts["/tmp"]["emptyDir"]
        assert not [e for e in pod.container["env"] if "valueFrom" in e], "no secret: the model is on the PVC"
        env = env_of(pod.container)
        assert env["HF_HUB_OFFLINE"] == "1" and int(env["TRAINER_SCORE_TASKS"]) == spec["completions"]
        assert pod.container["resources"]["limits"]["nvidia.com/gpu"] == 1  # one process per pod
    # Each index starts on its own shard, whatever the corpus's count.
    for shards in (2, 5, 64):
        firsts = [first_shard(DistEnv(), shards, {**pod.injected_env, **env_of(pod.container)}) for pod in pods]
        assert len(set(firsts)) == len(pods), (shards, firsts)

    assert spec["podReplacementPolicy"] == "Failed", "one live pod per index: the ledger's worker name"
    for verdict, wanted in CONTRACT.items():
        assert job_pod_failure(SCORE_JOB, for_launcher(verdict, env_of(pods[0].container))) == wanted, verdict
    assert job_pod_failure(SCORE_JOB, 128 + 15) == "retry uncounted"  # SIGTERM, through tini
    assert job_pod_failure(SCORE_JOB, 137) == "retry"  # SIGKILL: the OOM killer
    assert job_pod_failure(SCORE_JOB, condition="DisruptionTarget") == "retry uncounted"  # evicted, preempted
    assert spec["backoffLimit"] == 3 * len(pods)

    cfg = score_config(SCORE_JOB, objects["ConfigMap"], tmp_path)
    assert cfg.score.model == "final" and Path(cfg.output_dir).is_relative_to("/workspace")
    assert Path(cfg.score.input).is_relative_to("/workspace") and Path(cfg.score.output).is_relative_to("/workspace")
    assert not Path(cfg.score.input).is_relative_to(cfg.score.output)


def test_the_scoring_job_renders_and_validates_renamed_with_every_component(tmp_path):
    """k8s/score beside the base, in a user's overlay with every component and the objects
    renamed: the Job still names the renamed ConfigMap and PVC, Kueue queues it (suspended),
    it gets the priority and the GPU nodes, and the Job and its NetworkPolicy pass
    kubernetes-validate --strict. The policy admits no ingress to the scoring pods (they
    listen on nothing), renamed or not, and selects no pod of the other jobs."""
    folder = tmp_path / "my-scoring"
    folder.mkdir()
    up = lambda path: str(Path(os.path.relpath(path, folder)))  # noqa: E731
    (folder / "kustomization.yaml").write_text(yaml.safe_dump({
        "resources": [up(REPO / "k8s/score"), up(KUSTOMIZE / "base")],
        "components": [up(KUSTOMIZE / "components" / c) for c in COMPONENTS],
        "namePrefix": "team-a-", "nameSuffix": "-v2"}))
    objects = {(o["kind"], o["metadata"]["name"]): o for o in kustomize(folder)}
    job = objects["Job", "team-a-ddp-trainer-score-v2"]
    policy = objects["NetworkPolicy", "team-a-ddp-trainer-score-v2"]
    (pod, *_) = pods = indexed_job_pods(job)
    volumes = {v["name"]: v for v in pod.spec["volumes"]}
    assert volumes["config"]["configMap"]["name"] == "team-a-ddp-trainer-config-v2"
    assert ("ConfigMap", "team-a-ddp-trainer-config-v2") in objects
    assert volumes["workspace"]["persistentVolumeClaim"]["claimName"] == "team-a-ddp-trainer-workspace-v2"
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] and job["spec"]["suspend"] is True
    assert pod.spec["priorityClassName"]
    assert pod.spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert pinned_image() == pod.container["image"]
    assert [e for e in pod.container["env"] if e["name"] == "HF_TOKEN"] == []  # hf-token: the training pods only
    assert restricted_violations(pod.spec) == []
    file = tmp_path / "score.yaml"
    file.write_text(yaml.safe_dump_all([job, policy]))
    result = subprocess.run([BIN / "kubernetes-validate", "--strict", file], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("passed") == 2, result.stdout

    for each in (SCORE_POLICY, policy):
        assert each["spec"]["policyTypes"][0] == "Ingress" and "ingress" not in each["spec"], "no ingress at all"
        for scoring in (*indexed_job_pods(SCORE_JOB), *pods):
            assert selects(each["spec"]["podSelector"], scoring.labels), scoring.name
        others = [*pytorchjob_pods(k8s_objects()["PyTorchJob"]), *job_pods()["elastic"], *job_pods()["trainjob"],
                  job_pod(STAGE_JOB)]
        assert not [o.name for o in others if selects(each["spec"]["podSelector"], o.labels)]


def test_a_scoring_pod_recreated_for_its_index_takes_its_worker_lease_at_once(tmp_path, monkeypatch):
    """The pod the Job recreates for an index has the same host name (JOB-INDEX), and on the
    same node its pid namespace may get the dead one's number back, in which the dead worker's
    pid may be one of the new process's threads: the worker's lease is still taken over at once,
    as this worker's restart, not refused as held by a live process (exit 2: the Job failed)."""
    import threading

    from trainer.runtime import lease
    from trainer.scoring.ledger import Ledger, worker_name

    (pod, *_) = indexed_job_pods(SCORE_JOB)
    for key, value in {**pod.injected_env, "HOSTNAME": pod.name}.items():
        monkeypatch.setenv(key, value)
    name = worker_name(0)
    assert name == "kubernetes-indexed-job-ddp-trainer-score-index-0-rank0"
    stop, threads = threading.Event(), []
    helper = threading.Thread(target=lambda: (threads.append(threading.get_native_id()), stop.wait()))
    helper.start()
    try:
        while not threads:
            stop.wait(0.01)
        # The dead container's lease, just renewed: its host and pid namespace are this one's,
        # its pid a live thread's here.
        dead = Ledger(tmp_path, name, lease_s=900).me
        folder = tmp_path / ".score/workers" / name
        folder.mkdir(parents=True)
        (folder / lease.FILE).write_text(json.dumps(dataclasses.asdict(dataclasses.replace(dead, pid=threads[0]))))
        restarted = Ledger(tmp_path, name, lease_s=900)
        restarted.start_heartbeat()
        try:
            assert json.loads((folder / lease.FILE).read_text())["lease_id"] == restarted.me.lease_id
        finally:
            restarted.end()
    finally:
        stop.set()
        helper.join()


SCORED_SHARDS = {"a": 90, "b": 50}  # a.jsonl, b.csv: chunks of 16 rows, 6 and 4 of them


def test_the_scoring_job_runs_as_the_job_controller_starts_it(engine, app_image, tiny_model, tmp_path):
    """The Job's pods in our image as the Job controller and the kubelet start them (hostname
    JOB-INDEX, JOB_COMPLETION_INDEX, the kubelet's variables, the pod's security context, the
    ConfigMap, one folder as the PVC holding final/ and a corpus of two shards, with the
    README's `score.carry=[id]`). Pod 0 is killed (SIGKILL) holding a scored chunk it had not
    committed; the Job recreates it (137: counted, retried) beside pod 1. The recreated pod
    takes its lease and its claims back at once; the scores equal one process's in the same
    image, every row once, and each chunk is committed once."""
    import csv
    import random

    import pyarrow.parquet as pq

    from trainer.data.demo import review

    rng = random.Random(0)
    workspace = tmp_path / "claims" / k8s_objects()["PersistentVolumeClaim"]["metadata"]["name"]
    corpus = workspace / "data/corpus"
    corpus.mkdir(parents=True)
    rows = {name: [{"id": f"{name}:{i}", "text": " ".join(review(rng, i % 5) for _ in range(1 + i % 3))}
                   for i in range(count)] for name, count in SCORED_SHARDS.items()}
    (corpus / "a.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows["a"]))
    with (corpus / "b.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["id", "text"])
        writer.writeheader()
        writer.writerows(rows["b"])
    # What the training job left on the PVC, and the staging Job the corpus: as uid 1000.
    config = yaml.safe_load(k8s_objects()["ConfigMap"]["data"]["config.yaml"])
    final = workspace / Path(config["output_dir"]).relative_to("/workspace") / "final"
    shutil.copytree(tiny_model, final)
    for top in (workspace / "data", workspace / "runs"):
        for path in [top, *top.rglob("*")]:
            os.chown(path, UID, UID)
    claims = {workspace.name: workspace}

    pods = indexed_job_pods(SCORE_JOB)
    # The rows' ids kept, as k8s/score/job.yaml says; chunks of 16 rows, several per shard; and a
    # lease that outlasts the test: the recreated pod must take back its claims by its name, at
    # once, not after its previous container's heartbeat expires (pod 1 would wait as long).
    for pod in pods:
        pod.container["command"] += ["score.carry=[id]", "score.chunk_rows=16", "score.lease_s=900"]
    output = workspace / "scores/ddp-trainer"
    # One process: the same pod's command with another output, and no index.
    reference = dataclasses.replace(pods[0], name="reference", injected_env=KUBELET_ENV,
                                    container={**pods[0].container, "command": [
                                        *pods[0].container["command"], "score.output=/workspace/scores/reference"]})
    killed = dataclasses.replace(pods[0], injected_env={**pods[0].injected_env,
                                                        "TRAINER_FAULT_SCORE_SIGKILL": "a:2:scored"})
    first = run_containers(engine, app_image.id, [pod_container(reference, tmp_path / "reference", claims),
                                                  pod_container(killed, tmp_path / "pod-0-try-0", claims)],
                           timeout=300)
    assert first.codes == [0, 137], first.tail()
    assert job_pod_failure(SCORE_JOB, 137) == "retry"
    committed = sorted(p.relative_to(output / ".score/chunks").as_posix()
                       for p in (output / ".score/chunks").rglob("0*.parquet"))
    assert committed == ["a/00000000.parquet", "a/00000001.parquet"], committed

    again = run_containers(engine, app_image.id, [pod_container(pods[0], tmp_path / "pod-0-try-1", claims),
                                                  pod_container(pods[1], tmp_path / "pod-1-try-0", claims)],
                           timeout=300)
    assert again.codes == [0, 0], again.tail()
    # Its previous container's lease, taken over at once as its own: not after an expired heartbeat,
    # nor refused for a pid that its pid namespace, numbered as the dead one's, may hold again.
    (took_over,) = [line for line in again.logs[pods[0].name].splitlines() if "took over the lease" in line]
    assert took_over.endswith(": held by this same kubernetes indexed job ddp-trainer-score index 0, "
                              "restarted"), took_over

    for name, count in SCORED_SHARDS.items():
        table = pq.read_table(output / f"{name}.parquet")
        assert table.column("id").to_pylist() == [f"{name}:{i}" for i in range(count)]
        assert table.to_pylist() == pq.read_table(workspace / f"scores/reference/{name}.parquet").to_pylist()
        assert (output / f"{name}.parquet").stat().st_uid == UID
    chunks = sum(-(-count // 16) for count in SCORED_SHARDS.values())
    summaries = {path.stem: json.loads(path.read_text()) for path in (output / ".score/summaries").glob("*.json")}
    assert set(summaries) == {f"kubernetes-indexed-job-ddp-trainer-score-index-{index}-rank0" for index in (0, 1)}
    assert sum(s["chunks"] for s in summaries.values()) == chunks - len(committed)
    assert sum(s["scored_twice"] for s in summaries.values()) == 0


# --- The sweep on Katib: k8s/kustomize/katib --------------------------------------------------------

EXPERIMENT_SCHEMA = crd_validator("kubeflow.org_experiments.yaml")


def swagger_validator(file: str, definition: str) -> jsonschema.Validator:
    """A definition of an OpenAPI v2 document (tests/schemas), closed as the CRDs are. The
    Kubernetes types it names but does not hold (ObjectMeta, Container, the trial template's
    Unstructured) are left open: the trial template is held to its own CRD below."""
    document = json.loads((SCHEMAS / file).read_text())
    definitions = closed(document["definitions"])
    named = set(re.findall(r'"#/definitions/([^"]+)"', json.dumps(definitions)))
    definitions.update({name: {} for name in named - set(definitions)})
    return jsonschema.Draft4Validator({"$ref": f"#/definitions/{definition}", "definitions": definitions})


EXPERIMENT_TYPES = swagger_validator("katib_v1beta1_swagger.json", "v1beta1.Experiment")
TRIAL = "ddp-trainer-sweep-x7k2m9qz"  # a trial's name: the Experiment's and 8 random characters


@pytest.fixture(scope="module")
def katib() -> dict[str, dict]:
    return by_kind(kustomize(KUSTOMIZE / "katib"))


def sample_trial(experiment: dict, lr: str = "0.0001", seed: str = "2", name: str = TRIAL) -> dict:
    from support.katib import trial_job

    return trial_job(experiment, name, "team-a", {"lr": lr, "seed": seed})


def test_katib_experiment_renders_and_validates(katib, renderings, tmp_path):
    """`kubectl apply -k k8s/kustomize/katib`: the base's ConfigMap and PVC, the Experiment and
    its trials' NetworkPolicy, and not the base's job. The Experiment against Katib's CRD (which
    holds no schema: `x-kubernetes-preserve-unknown-fields`), against Katib's own API types
    (its OpenAPI document, closed) and Katib's validating webhook; a grid that repeats every
    learning rate with every seed, and exactly as many trials as the grid has points."""
    from support.katib import experiment_violations, grid

    from trainer.tasks.registry import METRICS

    assert set(katib) == {"ConfigMap", "PersistentVolumeClaim", "Experiment", "NetworkPolicy"}
    for kind in ("ConfigMap", "PersistentVolumeClaim"):
        assert katib[kind] == renderings["base"][kind]
    experiment = katib["Experiment"]
    assert experiment["apiVersion"] == "kubeflow.org/v1beta1"
    EXPERIMENT_SCHEMA.validate(experiment)
    EXPERIMENT_TYPES.validate(experiment)
    assert experiment_violations(experiment) == []
    spec = experiment["spec"]
    # ... and they do reject what Katib would drop or refuse:
    with pytest.raises(jsonschema.ValidationError, match="primaryContainer"):
        EXPERIMENT_TYPES.validate(mutate("spec.trialTemplate.primaryContainer", "pytorch")(experiment))
    broken = mutate("spec.trialTemplate.trialParameters.0.name", "lr")(experiment)
    assert any("lr not found in the trial template" in p for p in experiment_violations(broken))
    assert any("two top subexpressions" in p for p in experiment_violations(
        mutate("spec.metricsCollectorSpec.source.filter.metricsFormat", ["accuracy ([0-9.]+)"])(experiment)))

    config = yaml.safe_load(katib["ConfigMap"]["data"]["config.yaml"])
    problem = config["data"].get("problem_type", "single_label")
    objective = spec["objective"]
    direction = METRICS[problem][objective["objectiveMetricName"]]
    assert objective["type"] == {"max": "maximize", "min": "minimize"}[direction]
    points = grid(experiment)
    assert len(set(points["lr"])) == 4 and len(points["seed"]) == 3, points
    assert spec["algorithm"]["algorithmName"] == "grid"
    assert spec["maxTrialCount"] == len(points["lr"]) * len(points["seed"])
    assert 0 < spec["maxFailedTrialCount"] < spec["maxTrialCount"]
    file = tmp_path / "policy.yaml"
    file.write_text(yaml.safe_dump(katib["NetworkPolicy"]))
    result = subprocess.run([BIN / "kubernetes-validate", "--strict", file], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_katib_trials_are_the_base_job_but_for_katibs_parts(katib, renderings):
    """A trial's PyTorchJob, as Katib's controller makes it from the template with a trial's
    values, is the base rendering's PyTorchJob but for its name and namespace (the trial's)
    and the overrides at the end of its command: the two cannot drift. It passes the
    PyTorchJob CRD and the operator's webhook."""
    job = sample_trial(katib["Experiment"])
    expected = copy.deepcopy(renderings["base"]["PyTorchJob"])
    expected["metadata"].update(name=TRIAL, namespace="team-a")
    (container,) = expected["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"]
    container["command"] += ["train.lr=0.0001", "seed=2", f"output_dir=/workspace/runs/katib/{TRIAL}"]
    assert job == expected
    PYTORCHJOB_SCHEMA.validate(job)
    assert pytorchjob_webhook_violations(job) == []


def test_katib_trial_pods_pass_our_pod_rules_and_worker_0_reports(katib, tmp_path):
    """Every pod of a trial, as Katib's pod webhook leaves it, passes the "restricted" standard
    (the metrics sidecar only with katib-config's injectSecurityContext: off, it has no
    securityContext of its own), and the trials' NetworkPolicy selects each of them, renamed
    too, and no pod of the base job or of another Experiment. The sidecar goes to worker-0, the
    pod whose log holds rank 0's (torchrun ranks the nodes by host name), and Katib's default
    (`job-role: master`) would have selected no pod; Katib's `sh -c` wrapper gives the command
    back word for word."""
    import shlex

    from support.katib import DEFAULT_PRIMARY_POD_LABELS, METRICS_FILE, is_primary, trial_pods
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc

    experiment = katib["Experiment"]
    job = sample_trial(experiment)
    pods = trial_pods(experiment, job, inject_security_context=True)
    primary = [pod for pod in pods if len(pod.spec["containers"]) == 2]
    assert [pod.name for pod in primary] == [f"{TRIAL}-worker-0"], [pod.name for pod in pods]
    assert not [pod for pod in pytorchjob_pods(job) if is_primary(pod.labels, DEFAULT_PRIMARY_POD_LABELS)]
    nodes = [_NodeDesc(pod.name, pid, 0) for pod, pid in zip(reversed(pods), (7, 9), strict=True)]
    assert sorted(nodes)[0].addr == primary[0].name  # node rank 0: global rank 0's log
    for pod in pods:
        assert restricted_violations(pod.spec) == [], pod.name
        assert "initContainers" not in pod.spec
    (plain,) = [pod for pod in trial_pods(experiment, job) if len(pod.spec["containers"]) == 2]
    assert "metrics-logger-and-collector: allowPrivilegeEscalation is not false" in restricted_violations(plain.spec)
    (wrapped,) = primary[0].container["args"]
    assert shlex.split(wrapped)[:-7] == job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"][
        "containers"][0]["command"]
    assert shlex.split(wrapped)[-7:-4] == [f"1>{METRICS_FILE}", "2>&1", "&&"]

    spec = katib["NetworkPolicy"]["spec"]
    (rule,) = spec["ingress"]
    (peer,) = rule["from"]
    assert spec["policyTypes"] == ["Ingress"] and "ports" not in rule and set(peer) == {"podSelector"}
    for pod in pods:
        assert selects(spec["podSelector"], pod.labels) and selects(peer["podSelector"], pod.labels), pod.name
    other = {**experiment, "metadata": {**experiment["metadata"], "name": "another-sweep"}}
    others = [*pytorchjob_pods(k8s_objects()["PyTorchJob"]), *trial_pods(other, sample_trial(other, name="x-1"))]
    for pod in others:
        assert not selects(spec["podSelector"], pod.labels), pod.name
    # Renamed by an overlay, the trials still find their ConfigMap and PVC, and the fence its trials.
    renamed = overlay(tmp_path / "renamed", [KUSTOMIZE / "katib"], [], namePrefix="team-a-")
    experiment = renamed["Experiment"]
    pods = trial_pods(experiment, sample_trial(experiment, name="team-a-ddp-trainer-sweep-x7k2m9qz"))
    volumes = {v["name"]: v for v in pods[0].spec["volumes"]}
    assert volumes["config"]["configMap"]["name"] == renamed["ConfigMap"]["metadata"]["name"]
    assert volumes["workspace"]["persistentVolumeClaim"]["claimName"] == \
        renamed["PersistentVolumeClaim"]["metadata"]["name"]
    assert all(selects(renamed["NetworkPolicy"]["spec"]["podSelector"], pod.labels) for pod in pods)


def test_katib_trial_commands_pass_the_trainers_config_check(katib, reviews, tmp_path):
    """Every grid point's command line, loaded as `python -m trainer check` loads it
    (trainer.cli.torchrun's TRAINER_CHECK runs it on the same arguments), with the ConfigMap's
    config (its data.path, the image's demo data, here the test reviews): the trial's values
    are the config's; a value the schema refuses fails here as it would in the pod."""
    from support.katib import grid

    from trainer.cli.main import command_args, parse_args
    from trainer.cli.torchrun import training_args
    from trainer.errors import ConfigError

    file = tmp_path / "config.yaml"
    file.write_text(katib["ConfigMap"]["data"]["config.yaml"].replace("/app/data/reviews", str(reviews)))
    experiment = katib["Experiment"]
    points = grid(experiment)

    def load(job: dict):
        (container,) = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"]
        argv = [str(file) if arg == "/etc/trainer/config.yaml" else arg for arg in container["command"]]
        args = parse_args(["check", *training_args(argv)])
        return run_config.load(args.config, command_args(args.command, args.overrides)[1])

    dirs = set()
    for i, (lr, seed) in enumerate((lr, seed) for lr in points["lr"] for seed in points["seed"]):
        cfg = load(sample_trial(experiment, lr, seed, name=f"ddp-trainer-sweep-{i:08d}"))
        assert (cfg.train.lr, cfg.seed) == (float(lr), int(seed))
        dirs.add(cfg.output_dir)
    assert len(dirs) == len(points["lr"]) * len(points["seed"])  # a folder per trial
    with pytest.raises(ConfigError, match=r"train\.lr"):
        load(sample_trial(experiment, lr="-1"))


def test_katib_collector_reads_the_objective_the_run_reports(katib, tiny_model, reviews, tmp_path):
    """A real run's output (stdout and stderr together, as Katib redirects the container's into
    its metrics file), read by Katib's StdOut collector rule with the Experiment's filter: one
    value, the validation accuracy of the model in final/ as summary.json has it (to the done
    line's 4 decimals), which the sweep's leaderboard ranks. The done line of a run whose final/
    is not its last step gives final/'s score, not the last step's. Katib's File collector in
    JSON format would read nothing from metrics.jsonl: its values are numbers, not strings."""
    from support.katib import UNAVAILABLE, collect_json, collect_text
    from support.outputs import read_summary
    from support.runs import tiny_overrides, train

    from trainer.outputs.summary import done_line
    from trainer.tasks.base import Task
    from trainer.tasks.single_label import SingleLabel

    spec = katib["Experiment"]["spec"]
    metric = spec["objective"]["objectiveMetricName"]
    filters = spec["metricsCollectorSpec"]["source"]["filter"]["metricsFormat"]
    out = tmp_path / "run"
    result = train(tiny_overrides(tiny_model, reviews, out, **{"train.max_steps": 2}), nproc=None)
    summary = read_summary(out)
    assert collect_text(result.output, [metric], filters) == [(metric, f"{summary['final_eval'][metric]:.4f}")]

    scores = lambda metrics: Task.scores(SingleLabel.__new__(SingleLabel), metrics)  # noqa: E731
    best = {**summary, "final_model_step": 1, "best": {"metric": "loss"},
            "final_eval": {**summary["final_eval"], metric: 0.25}, "last_step_eval": {**summary["final_eval"],
                                                                                  metric: 0.75}}
    line = f"x INFO trainer.train.loop: {done_line(best, scores)}\n"
    assert collect_text(line, [metric], filters) == [(metric, "0.2500")]

    logged = (out / "metrics.jsonl").read_text()
    assert f'"eval/{metric}": ' in logged
    assert collect_json(logged, [f"eval/{metric}"]) == [(f"eval/{metric}", UNAVAILABLE)]
