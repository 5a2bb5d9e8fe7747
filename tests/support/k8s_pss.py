"""The Pod Security Standards' "restricted" profile (baseline's rules included), as checks on a
pod spec: what the PodSecurity admission controller refuses in a namespace labelled
`pod-security.kubernetes.io/enforce: restricted`. Written from the standard
(kubernetes.io/docs/concepts/security/pod-security-standards), version "latest"; each rule
looks at the pod and at every container, init and ephemeral containers included.
"""

from __future__ import annotations

# baseline
_BASELINE_CAPABILITIES = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
                          "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"}
_SELINUX_TYPES = {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}
_SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
                 "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                 "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
                 "net.ipv4.tcp_keepalive_probes"}
# restricted
_VOLUME_TYPES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                 "projected", "secret"}


def _containers(spec: dict) -> list[dict]:
    return [*spec.get("initContainers", []), *spec.get("containers", []), *spec.get("ephemeralContainers", [])]


def restricted_violations(spec: dict) -> list[str]:
    """Every rule of "restricted" the pod spec breaks, one line each naming the container."""
    pod = spec.get("securityContext", {})
    problems = [f"{field}: true" for field in ("hostNetwork", "hostPID", "hostIPC") if spec.get(field)]
    for volume in spec.get("volumes", []):
        kinds = set(volume) - {"name"}
        if "hostPath" in kinds:
            problems.append(f"volume {volume['name']}: hostPath")
        if not kinds <= _VOLUME_TYPES:
            problems.append(f"volume {volume['name']}: type {sorted(kinds - _VOLUME_TYPES)} not allowed")
    problems += [f"sysctl {sysctl['name']} is not in the safe set"
                 for sysctl in pod.get("sysctls", []) if sysctl["name"] not in _SAFE_SYSCTLS]
    if pod.get("windowsOptions", {}).get("hostProcess"):
        problems.append("pod: windowsOptions.hostProcess")
    pod_seccomp = pod.get("seccompProfile", {}).get("type")
    if pod_seccomp == "Unconfined":
        problems.append("pod: seccompProfile Unconfined")
    for context in [pod, *[c.get("securityContext", {}) for c in _containers(spec)]]:
        options = context.get("seLinuxOptions", {})
        if options.get("type", "") not in _SELINUX_TYPES or options.get("user") or options.get("role"):
            problems.append(f"seLinuxOptions {options} not allowed")
        if context.get("appArmorProfile", {}).get("type", "RuntimeDefault") not in ("RuntimeDefault", "Localhost"):
            problems.append(f"appArmorProfile {context['appArmorProfile']} not allowed")
    if pod.get("runAsUser") == 0:
        problems.append("pod: runAsUser 0")

    for container in _containers(spec):
        name, context = container["name"], container.get("securityContext", {})
        if context.get("privileged"):
            problems.append(f"{name}: privileged")
        if context.get("windowsOptions", {}).get("hostProcess"):
            problems.append(f"{name}: windowsOptions.hostProcess")
        if context.get("procMount", "Default") != "Default":
            problems.append(f"{name}: procMount {context['procMount']}")
        if any(port.get("hostPort") for port in container.get("ports", [])):
            problems.append(f"{name}: hostPort")
        capabilities = context.get("capabilities", {})
        added = set(capabilities.get("add", []))
        if not added <= _BASELINE_CAPABILITIES or not added <= {"NET_BIND_SERVICE"}:
            problems.append(f"{name}: adds capabilities {sorted(added - {'NET_BIND_SERVICE'})}")
        if "ALL" not in capabilities.get("drop", []):
            problems.append(f"{name}: capabilities.drop does not include ALL")
        if context.get("allowPrivilegeEscalation") is not False:
            problems.append(f"{name}: allowPrivilegeEscalation is not false")
        if context.get("runAsNonRoot", pod.get("runAsNonRoot")) is not True:
            problems.append(f"{name}: runAsNonRoot is not true")
        if context.get("runAsUser") == 0:
            problems.append(f"{name}: runAsUser 0")
        seccomp = context.get("seccompProfile", {}).get("type", pod_seccomp)
        if seccomp not in ("RuntimeDefault", "Localhost"):
            problems.append(f"{name}: seccompProfile is {seccomp or 'unset'}, not RuntimeDefault or Localhost")
    return problems
