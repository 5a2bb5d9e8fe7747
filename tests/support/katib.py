"""What Katib (v0.19.0, kubeflow/katib) does with our Experiment, from its sources, for
tests/system/test_k8s.py. No Katib runs here: each rule is ported from the file named.

- `experiment_violations`: the Experiment validating webhook's rules for a new Experiment
  (pkg/webhook/v1beta1/experiment/validator/validator.go), with katib-config's algorithms and
  collectors of manifests/v1beta1/installs/katib-standalone/katib-config.yaml.
- `grid`: the grid algorithm's points (pkg/suggestion/v1beta1/internal/search_space.py,
  convert_to_combinations: numpy.arange, a last point above max dropped).
- `trial_job`: the trial's job as the experiment controller makes it from the template
  (pkg/controller.v1beta1/experiment/manifest/generator.go: `${trialParameters.NAME}` replaced
  in the template's JSON text, then metadata.name and namespace set to the trial's).
- `trial_pods`: the PyTorchJob's pods (tests/support/kubeflow.py) as Katib's pod webhook mutates them
  (pkg/webhook/v1beta1/pod/inject_webhook.go, utils.go): every pod gets the trial's labels
  (the Experiment's labels, katib.kubeflow.org/experiment and /trial); the primary pod (its
  labels match primaryPodLabels) also gets the metrics collector sidecar, a shared process
  namespace, the metrics emptyDir, and its primary container's command wrapped in `sh -c`.
- `collect_text` and `collect_json`: what the file metrics collector reports from the metrics
  file (pkg/metricscollector/v1beta1/file-metricscollector/file-metricscollector.go): the
  StdOut collector reads the primary container's output, redirected into
  /var/log/katib/metrics.log, in text format.
"""

from __future__ import annotations

import copy
import json
import os
import re

import numpy as np

from support.kubeflow import Pod, pytorchjob_pods

UNAVAILABLE = "unavailable"  # consts.UnavailableMetricValue
DEFAULT_FILTER = r"([\w|-]+)\s*=\s*([+-]?\d*(\.\d+)?([Ee][+-]?\d+)?)"  # metricscollector common.DefaultFilter
METRICS_FILE = "/var/log/katib/metrics.log"  # common.DefaultFilePath, the StdOut collector's
COLLECTOR_CONTAINER = "metrics-logger-and-collector"  # StdOut and File
# experiment_defaults.go: what Katib fills in for a Kubeflow training job that leaves them out.
DEFAULT_PRIMARY_POD_LABELS = {"training.kubeflow.org/job-role": "master"}
DEFAULT_SUCCESS = 'status.conditions.#(type=="Succeeded")#|#(status=="True")#'
DEFAULT_FAILURE = 'status.conditions.#(type=="Failed")#|#(status=="True")#'
# katib-config.yaml (katib-standalone, v0.19.0): the algorithms and collectors it configures.
ALGORITHMS = {"random", "tpe", "grid", "hyperband", "bayesianoptimization", "cmaes", "sobol", "multivariate-tpe",
              "enas", "darts", "pbt"}
COLLECTORS = {"StdOut", "File", "TensorFlowEvent", "PrometheusMetric", "Custom", "Push"}
_PARAM = re.compile(r"\$\{trialParameters\..+?\}")  # consts.TrialTemplateParamReplaceFormatRegex
_META = re.compile(r"\$\{trialSpec\.(.+?)\}")  # consts.TrialTemplateMetaReplaceFormatRegex
_META_KEYS = {"Name", "Namespace", "Kind", "APIVersion", "Annotations", "Labels"}


def _is_meta(reference: str) -> bool:
    match = _META.search(reference)
    if not match:
        return False
    key = match.group(1)
    indexed = re.search(r"(.+)\[(.+)]", key)
    return key in _META_KEYS or bool(indexed and indexed.group(1) in _META_KEYS)


def experiment_violations(experiment: dict) -> list[str]:
    """validator.go's ValidateExperiment for a new Experiment (no old one): each problem a line."""
    problems = []
    name, spec = experiment["metadata"].get("name", ""), experiment["spec"]
    if not re.match(r"^[a-z]([-a-z0-9]*[a-z0-9])?", name) or len(name) > 40:
        problems.append("metadata.name: lower case alphanumeric or '-', at most 40 characters")
    most, parallel, failed = spec.get("maxTrialCount"), spec.get("parallelTrialCount"), spec.get("maxFailedTrialCount")
    if failed is not None and failed < 0:
        problems.append("spec.maxFailedTrialCount: should not be less than 0")
    if most is not None and most <= 0:
        problems.append("spec.maxTrialCount: must be greater than 0")
    if parallel is not None and parallel <= 0:
        problems.append("spec.parallelTrialCount: must be greater than 0")
    if failed is not None and most is not None and failed > most:
        problems.append("spec.maxFailedTrialCount: should be less than or equal to spec.maxTrialCount")
    if parallel is not None and most is not None and parallel > most:
        problems.append("spec.parallelTrialCount: should be less than or equal to spec.maxTrialCount")
    objective = spec.get("objective")
    if objective is None:
        return [*problems, "spec.objective: must be specified"]
    if objective.get("type") not in ("minimize", "maximize"):
        problems.append("spec.objective.type: must be minimize or maximize")
    if not objective.get("objectiveMetricName"):
        problems.append("spec.objective.objectiveMetricName: must be specified")
    if objective.get("objectiveMetricName") in objective.get("additionalMetricNames", []):
        problems.append("spec.objective.additionalMetricNames: should not contain spec.objective.objectiveMetricName")
    if problems:  # the webhook stops at a bad objective; the count checks come first
        return problems
    if spec.get("algorithm", {}).get("algorithmName") not in ALGORITHMS:
        problems.append("spec.algorithm.algorithmName: no Suggestion config for it in katib-config")
    if spec.get("resumePolicy", "") not in ("", "Never", "LongRunning", "FromVolume"):
        problems.append("spec.resumePolicy: invalid ResumePolicyType")
    problems += _trial_template_violations(spec)
    if not spec.get("parameters") and "nasConfig" not in spec:
        problems.append("spec: spec.parameters or spec.nasConfig must be specified")
    for i, parameter in enumerate(spec.get("parameters", [])):
        kind, space = parameter.get("parameterType", ""), parameter.get("feasibleSpace", {})
        if kind not in ("int", "double", "categorical", "discrete", "unknown"):
            problems.append(f"spec.parameters[{i}].parameterType: {kind} is not supported")
        if space.get("distribution", "") not in ("", "uniform", "logUniform", "normal", "logNormal", "unknown"):
            problems.append(f"spec.parameters[{i}].feasibleSpace.distribution: not supported")
        if not space:
            problems.append(f"spec.parameters[{i}].feasibleSpace: must be specified")
        elif kind in ("double", "int"):
            if space.get("list"):
                problems.append(f"spec.parameters[{i}].feasibleSpace.list: not supported for {kind}")
            if not space.get("max") or not space.get("min"):
                problems.append(f"spec.parameters[{i}].feasibleSpace.max: max and min must be specified for {kind}")
        elif kind in ("categorical", "discrete") and (space.get("max") or space.get("min") or space.get("step")):
            problems.append(f"spec.parameters[{i}].feasibleSpace: max, min and step not supported for {kind}")
    return problems + _metrics_collector_violations(spec)


def _trial_template_violations(spec: dict) -> list[str]:
    template = spec.get("trialTemplate")
    if template is None:
        return ["spec.trialTemplate: must be specified"]
    problems = []
    if not template.get("primaryContainerName"):
        problems.append("spec.trialTemplate.primaryContainerName: must be specified")
    if not template.get("successCondition") or not template.get("failureCondition"):
        problems.append("spec.trialTemplate: successCondition and failureCondition must be specified")
    if template.get("trialParameters") is None:
        return [*problems, "spec.trialTemplate.trialParameters: must be specified"]
    if "trialSpec" not in template:
        return [*problems, "spec.trialTemplate.trialSpec or spec.trialTemplate.configMap must be specified"]
    text = json.dumps(template["trialSpec"])  # GetTrialTemplate: the unstructured object as JSON
    names = {p["name"] for p in spec.get("parameters", [])}
    seen_names, seen_refs = set(), set()
    for i, parameter in enumerate(template["trialParameters"]):
        name, reference = parameter.get("name", ""), parameter.get("reference", "")
        if not name or not reference or "{" in name or "}" in name:
            problems.append(f"spec.trialTemplate.trialParameters[{i}]: name and reference must be specified")
            continue
        if name in seen_names or reference in seen_refs:
            problems.append(f"spec.trialTemplate.trialParameters[{i}]: {name} or {reference} duplicated")
            continue
        seen_names.add(name)
        seen_refs.add(reference)
        if names and not _is_meta(reference) and reference not in names:
            problems.append(f"spec.trialTemplate.trialParameters[{i}].reference: {reference} not in spec.parameters")
        placeholder = f"${{trialParameters.{name}}}"
        if placeholder not in text:
            return [*problems, f"spec.trialTemplate.trialParameters[{i}].name: {name} not found in the trial template"]
        text = text.replace(placeholder, "test-value")
    left = _PARAM.findall(text)
    if left:
        problems.append(f"spec.trialTemplate: parameters {left} in the template not in spec.trialParameters")
    job = json.loads(text)
    if job.get("metadata", {}).get("name") or job.get("metadata", {}).get("namespace"):
        problems.append("spec.trialTemplate: metadata.name and metadata.namespace must be omitted")
    if not job.get("apiVersion") or not job.get("kind"):
        problems.append("spec.trialTemplate: APIVersion and Kind must be specified")
    return problems


def _metrics_collector_violations(spec: dict) -> list[str]:
    collector = spec.get("metricsCollectorSpec", {})
    kind = collector.get("collector", {}).get("kind", "StdOut")  # experiment_defaults.go
    source = collector.get("source") or {}
    problems = []
    if kind not in COLLECTORS:
        problems.append(f"spec.metricsCollectorSpec.collector.kind: invalid metrics collector kind: {kind}")
    if kind == "File":
        path = source.get("fileSystemPath") or {}
        if path.get("kind", "File") != "File" or not os.path.isabs(path.get("path", "")):
            problems.append("spec.metricsCollectorSpec.source.fileSystemPath.path: required")
        if path.get("format", "TEXT") not in ("TEXT", "JSON"):
            problems.append("spec.metricsCollectorSpec.source.fileSystemPath.format: required")
        if path.get("format") == "JSON" and source.get("filter") is not None:
            problems.append("spec.metricsCollectorSpec.source.filter: must be nil for JSON")
    for pattern in (source.get("filter") or {}).get("metricsFormat", []):
        try:
            re.compile(pattern)
        except re.error as e:
            problems.append(f"spec.metricsCollectorSpec.source.filter.metricsFormat: invalid filter: {e}")
            continue
        if not re.search(r".*\(.*\).*\(.*\).*", pattern):
            problems.append("spec.metricsCollectorSpec.source.filter.metricsFormat: "
                            "two top subexpressions are required")
    return problems


def grid(experiment: dict) -> dict[str, list[str]]:
    """Each parameter's grid points, as Katib's grid algorithm makes them (as strings)."""
    points = {}
    for parameter in experiment["spec"]["parameters"]:
        kind, space = parameter["parameterType"], parameter["feasibleSpace"]
        if kind == "int":
            points[parameter["name"]] = [str(v) for v in range(int(space["min"]), int(space["max"]) + 1,
                                                                int(space.get("step") or 1))]
        elif kind == "double":
            low, high, step = float(space["min"]), float(space["max"]), float(space["step"])
            values = np.arange(low, high + step, step)
            if values[-1] > high:
                values = values[:-1]
            points[parameter["name"]] = [str(float(v)) for v in values]
        else:
            points[parameter["name"]] = list(space["list"])
    return points


def trial_job(experiment: dict, trial: str, namespace: str, assignments: dict[str, str]) -> dict:
    """The trial's job: the template with the trial's parameter values and metadata."""
    template = experiment["spec"]["trialTemplate"]
    text = json.dumps(template["trialSpec"])
    values = {}
    for parameter in template["trialParameters"]:
        reference = parameter["reference"]
        if _is_meta(reference):
            key = _META.search(reference).group(1)
            assert key in ("Name", "Namespace"), f"{key}: not ported"
            values[parameter["name"]] = trial if key == "Name" else namespace
        else:
            values[parameter["name"]] = assignments[reference]  # a KeyError: Katib's errParamNotFound...
    assert len(assignments) == len([p for p in template["trialParameters"] if not _is_meta(p["reference"])])
    for name, value in values.items():
        text = text.replace(f"${{trialParameters.{name}}}", value)
    job = json.loads(text)
    job.setdefault("metadata", {}).update(name=trial, namespace=namespace)
    return job


def is_primary(labels: dict[str, str], primary: dict[str, str]) -> bool:
    """utils.go isPrimaryPod: every primary label, with its value."""
    return all(labels.get(key) == value for key, value in primary.items())


def trial_pods(experiment: dict, job: dict, inject_security_context: bool = False) -> list[Pod]:
    """The trial's PyTorchJob pods as Katib's pod webhook leaves them (StdOut collector).
    `inject_security_context`: katib-config's runtime.injectSecurityContext, which gives the
    sidecar the first container's securityContext (off by default)."""
    template = experiment["spec"]["trialTemplate"]
    primary = template.get("primaryPodLabels", DEFAULT_PRIMARY_POD_LABELS)
    trial = job["metadata"]["name"]
    labels = {**experiment["metadata"].get("labels", {}), "katib.kubeflow.org/experiment":
              experiment["metadata"]["name"], "katib.kubeflow.org/trial": trial}
    pods = []
    for pod in pytorchjob_pods(job):
        spec = copy.deepcopy(pod.spec)
        (container,) = [c for c in spec["containers"] if c["name"] == template["primaryContainerName"]]
        container.setdefault("env", []).append({"name": "KATIB_TRIAL_NAME", "valueFrom": {"fieldRef": {
            "fieldPath": "metadata.labels['katib.kubeflow.org/trial']"}}})
        if is_primary(pod.labels, primary):
            assert experiment["spec"]["metricsCollectorSpec"]["collector"]["kind"] == "StdOut", "only StdOut ported"
            sidecar = {"name": COLLECTOR_CONTAINER, "image": "ghcr.io/kubeflow/katib/file-metrics-collector:v0.19.0",
                       "args": ["-t", trial, "-m", experiment["spec"]["objective"]["objectiveMetricName"],
                                "-path", METRICS_FILE, "-format", "TEXT"]}
            if inject_security_context and spec["containers"][0].get("securityContext"):
                sidecar["securityContext"] = copy.deepcopy(spec["containers"][0]["securityContext"])
            spec["containers"].append(sidecar)
            spec["shareProcessNamespace"] = True
            spec["volumes"].append({"name": "metrics-volume", "emptyDir": {}})
            for each in (container, sidecar):
                each.setdefault("volumeMounts", []).append({"name": "metrics-volume",
                                                            "mountPath": os.path.dirname(METRICS_FILE)})
            args = [*container["command"], *container.get("args", [])]  # a command is set: no image lookup
            command = ["sh", "-c"]
            if args[0] in ("sh", "bash") and args[1] == "-c":
                command, args = args[:2], args[2:]
            args += [f"1>{METRICS_FILE} 2>&1", "&&",
                     f"echo completed > {os.path.join(os.path.dirname(METRICS_FILE), '$$$$.pid')}"]
            container["command"], container["args"] = command, [" ".join(args)]
        pods.append(Pod(pod.name, pod.dns_names, pod.annotations, {**pod.labels, **labels}, spec, container,
                        pod.injected_env))
    return pods


def collect_text(log: str, metrics: list[str], filters: list[str]) -> list[tuple[str, str]]:
    """parseLogsInTextFormat and newObservationLog: (name, value) of each metric found, or the
    objective (metrics[0]) as "unavailable" when none is. The filters are RE2 expressions;
    those here use nothing that Python's re reads otherwise."""
    found = []
    for line in log.split("\n"):
        if not any(m in line for m in metrics):
            continue
        for pattern in filters or [DEFAULT_FILTER]:
            for groups in re.compile(pattern).finditer(line):
                if len(groups.groups()) < 2:
                    continue
                name, value = groups.group(1).strip(), (groups.group(2) or "").strip()
                if name in metrics:
                    found.append((name, value))
    if not any(name == metrics[0] for name, _ in found):
        return [(metrics[0], UNAVAILABLE)]
    return found


def collect_json(log: str, metrics: list[str]) -> list[tuple[str, str]]:
    """parseLogsInJsonFormat: each line a JSON object; a metric is taken where its value is a
    JSON string (Go's `jsonObj[m].(string)`), and a number is skipped."""
    found = []
    for line in log.split("\n"):
        if not line:
            continue
        record = json.loads(line)  # Katib fails the whole collection on a line that is not JSON
        found += [(m, record[m]) for m in metrics if isinstance(record.get(m), str)]
    if not any(name == metrics[0] for name, _ in found):
        return [(metrics[0], UNAVAILABLE)]
    return found
