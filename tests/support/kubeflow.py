"""What the Kubeflow operators do to our manifests, from their sources (see k8s/README.md).

- `pytorchjob_pods`: the pods of a PyTorchJob (kubeflow.org/v1, training-operator v1.9), the
  variables the operator appends to their container's env (controller.v1/pytorch:
  envvar.go, master.go, elastic.go) and the labels it adds to the template's (common's
  GenLabels and the replica labels: training.kubeflow.org/job-name, operator-name,
  replica-type, replica-index, and job-role on the master).
- `trainjob_pods`: the pods of a TrainJob (trainer.kubeflow.org/v1alpha1, Trainer v2.3) on the
  torch-distributed runtime, the PET_* variables it injects, and the labels of the pods of
  the JobSet it runs as (named as the TrainJob; jobset.sigs.k8s.io/jobset-name and
  replicatedjob-name).
- `pytorchjob_webhook_violations`: the PyTorchJob validating webhook's rules
  (webhooks/pytorch/pytorchjob_webhook.go).
- Each Pod's `spec` is the pod the operator creates: the template with the init container it
  gives the Workers of a job that has a Master (controller.v1/pytorch/initcontainer.go, its
  default template and image: the operator's --pytorch-init-container-* flags change them,
  nothing in the job does) and the pod restartPolicy it derives (core/pod.go: ExitCode runs
  as Never).
- `pytorchjob_retries` and `jobset_action`: what the operator, or the Job and JobSet
  controllers, do when a pod's container exits with a code (common/pod.go and
  util/train/train_util.go; the Job controller's podFailurePolicy and JobSet's failurePolicy).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

DEFAULT_PYTORCHJOB_PORT = 23456  # pytorch_defaults.go
INIT_CONTAINER_IMAGE = "alpine:3.10"  # config.PyTorchInitContainerImageDefault
INIT_CONTAINER_MAX_TRIES = 100
TRAINJOB_MASTER_PORT = 29500
_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


@dataclass
class Pod:
    name: str  # also its hostname and the name of its headless Service
    dns_names: list[str]
    annotations: dict[str, str]
    labels: dict[str, str]
    spec: dict  # the pod spec
    container: dict  # the training container
    injected_env: dict[str, str]


def _port(job: dict, kind: str) -> int:
    """The containerPort named pytorchjob-port of the `kind` spec's pytorch container."""
    spec = job["spec"]["pytorchReplicaSpecs"][kind]["template"]["spec"]
    for container in spec["containers"]:
        if container["name"] == "pytorch":
            for port in container.get("ports", []):
                if port.get("name") == "pytorchjob-port":
                    return port["containerPort"]
    return DEFAULT_PYTORCHJOB_PORT


def _elastic_env(job: dict) -> dict[str, str]:
    """What elastic.go derives from spec.elasticPolicy: the rendezvous (endpoint: worker-0's
    pytorchjob-port unless rdzvHost/rdzvPort), PET_NNODES as min:max, and the optional fields."""
    name, job_spec = job["metadata"]["name"], job["spec"]
    policy = job_spec["elasticPolicy"]
    host = policy.get("rdzvHost", f"{name}-worker-0")
    port = policy.get("rdzvPort", _port(job, "Worker"))
    env = {"PET_RDZV_ENDPOINT": f"{host}:{port}", "PET_RDZV_BACKEND": policy.get("rdzvBackend", "c10d")}
    if "minReplicas" in policy or "maxReplicas" in policy:
        env["PET_NNODES"] = f"{policy['minReplicas']}:{policy['maxReplicas']}"
    else:
        env["PET_NNODES"] = str(job_spec["pytorchReplicaSpecs"]["Worker"].get("replicas", 1))
    optional = {"maxRestarts": "PET_MAX_RESTARTS", "rdzvId": "PET_RDZV_ID"}
    env.update({var: str(policy[key]) for key, var in optional.items() if key in policy})
    if policy.get("rdzvConf"):
        env["PET_RDZV_CONF"] = ",".join(f"{c['key']}={c['value']}" for c in policy["rdzvConf"])
    if policy.get("standalone"):
        env["PET_STANDALONE"] = ""
    return env


def pytorchjob_pods(job: dict) -> list[Pod]:
    name, spec = job["metadata"]["name"], job["spec"]
    replica_specs = spec["pytorchReplicaSpecs"]
    nproc = spec.get("nprocPerNode", "auto")
    total = sum(replica_specs[kind].get("replicas", 1) for kind in replica_specs)
    master = f"{name}-master-0"
    pods = []
    for kind in ("Master", "Worker"):
        if kind not in replica_specs:
            continue
        for index in range(replica_specs[kind].get("replicas", 1)):
            env = {"PYTHONUNBUFFERED": "1"}
            if "Master" in replica_specs:  # master.go: the static rendezvous at master-0
                node_rank = index if kind == "Master" else index + 1
                port = str(_port(job, "Master"))
                env.update({
                    "MASTER_ADDR": master, "PET_MASTER_ADDR": master,
                    "MASTER_PORT": port, "PET_MASTER_PORT": port,
                    # nprocPerNode "auto", "cpu" and "gpu" count as 1 in the operator's WORLD_SIZE
                    "WORLD_SIZE": str(total * (int(nproc) if nproc.isdigit() else 1)),
                    "RANK": str(node_rank), "PET_NODE_RANK": str(node_rank),
                })
            env["PET_NPROC_PER_NODE"] = nproc  # defaulted to auto
            env.update(_elastic_env(job) if "elasticPolicy" in spec else {"PET_NNODES": str(total)})
            template = replica_specs[kind]["template"]
            (container,) = [c for c in template["spec"]["containers"] if c["name"] == "pytorch"]
            pod_name = f"{name}-{kind.lower()}-{index}"
            pod_spec = dict(template["spec"])
            restart = replica_specs[kind].get("restartPolicy", "OnFailure")  # PyTorchJob's default
            pod_spec["restartPolicy"] = "Never" if restart == "ExitCode" else restart
            if kind == "Worker" and "Master" in replica_specs:
                pod_spec["initContainers"] = [*pod_spec.get("initContainers", []), _init_container(master)]
            annotations = template.get("metadata", {}).get("annotations", {})
            labels = {**template.get("metadata", {}).get("labels", {}),
                      "training.kubeflow.org/job-name": name,
                      "training.kubeflow.org/operator-name": "pytorchjob-controller",
                      "training.kubeflow.org/replica-type": kind.lower(),
                      "training.kubeflow.org/replica-index": str(index)}
            if kind == "Master":
                labels["training.kubeflow.org/job-role"] = "master"
            pods.append(Pod(pod_name, [pod_name], annotations, labels, pod_spec, container, env))
    return pods


def _init_container(master: str) -> dict:
    """initcontainer.go's default template: no securityContext, an image from Docker Hub."""
    return {"name": "init-pytorch", "image": INIT_CONTAINER_IMAGE, "imagePullPolicy": "IfNotPresent",
            "resources": {"limits": {"cpu": "100m", "memory": "20Mi"}, "requests": {"cpu": "50m", "memory": "10Mi"}},
            "command": ["sh", "-c", (f"err=1;for i in $(seq {INIT_CONTAINER_MAX_TRIES}); do if nslookup {master}; "
                                     "then err=0 && break; fi;echo waiting for master; sleep 2; done; exit $err")]}


def pytorchjob_retries(job: dict, kind: str, exit_code: int) -> bool:
    """Whether the operator recreates (or the kubelet restarts) a pod of `kind` whose pytorch
    container exited with `exit_code`, rather than failing the job (common/pod.go)."""
    policy = job["spec"]["pytorchReplicaSpecs"][kind].get("restartPolicy", "OnFailure")
    if policy == "ExitCode":
        return exit_code >= 128  # IsRetryableExitCode
    return policy in ("OnFailure", "Always")


def trainjob_pods(job: dict, runtime: dict) -> list[Pod]:
    """The runtime's `node` pod template with the TrainJob's trainer fields and runtimePatches
    applied (the patch fields our manifest uses: volumes, mounts, security, annotations, labels)."""
    name, trainer = job["metadata"]["name"], job["spec"]["trainer"]
    (replicated,) = [r for r in runtime["spec"]["template"]["spec"]["replicatedJobs"] if r["name"] == "node"]
    template = replicated["template"]["spec"]["template"]
    pod_spec = dict(template["spec"])
    annotations = dict(template.get("metadata", {}).get("annotations", {}))
    labels = {**template.get("metadata", {}).get("labels", {}),
              "jobset.sigs.k8s.io/jobset-name": name, "jobset.sigs.k8s.io/replicatedjob-name": replicated["name"]}
    (container,) = [dict(c) for c in pod_spec["containers"] if c["name"] == "node"]
    env = {e["name"]: e for e in container.get("env", [])}
    env.update({e["name"]: e for e in trainer.get("env", [])})
    container.update(image=trainer["image"], command=trainer["command"], env=list(env.values()))
    if "resourcesPerNode" in trainer:
        container["resources"] = trainer["resourcesPerNode"]
    if "args" in trainer:
        container["args"] = trainer["args"]
    for patch in job["spec"].get("runtimePatches", []):
        for job_patch in patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]:
            assert job_patch["name"] == "node", "the runtime has one replicated job, `node`"
            template_patch = job_patch["template"]["spec"]["template"]
            annotations.update(template_patch.get("metadata", {}).get("annotations", {}))
            labels.update(template_patch.get("metadata", {}).get("labels", {}))
            spec_patch = template_patch["spec"]
            pod_spec["volumes"] = pod_spec.get("volumes", []) + spec_patch.get("volumes", [])
            if "securityContext" in spec_patch:
                pod_spec["securityContext"] = spec_patch["securityContext"]
            for container_patch in spec_patch.get("containers", []):
                assert container_patch["name"] == container["name"]
                container["volumeMounts"] = container.get("volumeMounts", []) + container_patch.get("volumeMounts", [])
                if "securityContext" in container_patch:
                    container["securityContext"] = container_patch["securityContext"]
    pod_spec["containers"] = [container]

    num_nodes, nproc = trainer.get("numNodes", 1), trainer.get("numProcPerNode", "auto")
    master = f"{name}-node-0-0.{name}"  # JobSet pod hostname + subdomain
    pods = []
    for index in range(num_nodes):
        env = {"PET_NNODES": str(num_nodes), "PET_NPROC_PER_NODE": str(nproc),
               "PET_NODE_RANK": str(index), "PET_MASTER_ADDR": master,
               "PET_MASTER_PORT": str(TRAINJOB_MASTER_PORT)}
        pod_name = f"{name}-node-0-{index}"
        pods.append(Pod(pod_name, [pod_name, f"{pod_name}.{name}"], annotations, labels, pod_spec, container, env))
    return pods


def jobset_action(runtime: dict, exit_code: int, container: str = "node") -> str:
    """What happens to a TrainJob on `runtime` when a pod's `container` exits with
    `exit_code`: the node Job's podFailurePolicy (the first rule that matches; FailJob fails
    the Job with reason PodFailurePolicy and the Job controller's message), else the pod
    counts against the Job's backoffLimit; a failed Job then meets JobSet's failurePolicy
    rules (first match; none: RestartJobSet). Returns the action, or "RetryPod" when the
    Job replaces the pod itself."""
    jobset = runtime["spec"]["template"]["spec"]
    (node,) = [r for r in jobset["replicatedJobs"] if r["name"] == "node"]
    job = node["template"]["spec"]
    reason = message = None
    for index, rule in enumerate(job.get("podFailurePolicy", {}).get("rules", [])):
        codes = rule.get("onExitCodes")
        if not codes or codes.get("containerName", container) != container:
            continue
        if (exit_code in codes["values"]) == (codes["operator"] == "In"):
            if rule["action"] == "FailJob":
                reason = "PodFailurePolicy"
                message = (f"Container {container} for pod default/job-node-0-0-x failed with exit code "
                           f"{exit_code} matching FailJob rule at index {index}")
            elif rule["action"] == "Ignore":
                return "RetryPod"
            break
    if reason is None:
        if job.get("backoffLimit", 6) > 0:
            return "RetryPod"
        reason, message = "BackoffLimitExceeded", "Job has reached the specified backoff limit"
    for rule in jobset.get("failurePolicy", {}).get("rules", []):
        if rule.get("onJobFailureReasons") and reason not in rule["onJobFailureReasons"]:
            continue
        patterns = rule.get("onJobFailureMessagePatterns")
        if patterns and not any(re.search(pattern, message) for pattern in patterns):
            continue
        return rule["action"]
    return "RestartJobSet"


def pytorchjob_webhook_violations(job: dict) -> list[str]:
    problems = []
    name = job["metadata"].get("name", "")
    if not _DNS1035.match(name) or len(name) > 63:
        problems.append(f"metadata.name {name!r} is not a DNS-1035 label")
    spec = job["spec"]
    replica_specs = spec.get("pytorchReplicaSpecs", {})
    for kind, replica in replica_specs.items():
        if kind not in ("Master", "Worker"):
            problems.append(f"replica type {kind!r} is not Master or Worker")
        names = [c.get("name") for c in replica.get("template", {}).get("spec", {}).get("containers", [])]
        if "pytorch" not in names:
            problems.append(f"{kind}: no container named pytorch")
    if "Master" in replica_specs and replica_specs["Master"].get("replicas") != 1:
        problems.append("Master.replicas must be set to 1")
    if "Worker" in replica_specs and replica_specs["Worker"].get("replicas", 1) < 1:
        problems.append("Worker.replicas must be at least 1")
    elastic = spec.get("elasticPolicy")
    if elastic is not None and "Worker" not in replica_specs:
        problems.append("an elastic job needs a Worker spec")
    if elastic is not None and "nProcPerNode" in elastic and "nprocPerNode" in spec:
        problems.append("elasticPolicy.nProcPerNode and nprocPerNode are both set")
    return problems
