"""Which network the job's collectives really use, for doctor's report: the transport NCCL
chose, from its own log, and the interface gloo sends on.

NCCL falls back to TCP sockets without a word when it can't use InfiniBand or RoCE: the
image lacks the RDMA userspace libraries (rdma-core, libibverbs and its providers), no port
is active, or NCCL_IB_DISABLE=1. The job then runs, at a fraction of its speed. NCCL says
what it chose only in its INFO log ("Using network IB"), which doctor asks it to write.
"""

from __future__ import annotations

import fcntl
import os
import re
import socket
import struct
from pathlib import Path

INFINIBAND = Path("/sys/class/infiniband")
_SIOCGIFADDR = 0x8915


def capture_nccl_log(folder: Path) -> Path | None:
    """Ask NCCL, before its first communicator, to log its INIT and NET choices to a file of
    this process's; None where the user set NCCL_DEBUG or NCCL_DEBUG_FILE: that log is
    theirs, and doctor leaves it alone."""
    if "NCCL_DEBUG" in os.environ or "NCCL_DEBUG_FILE" in os.environ:
        return None
    path = folder / f"nccl-{socket.gethostname()}-{os.getpid()}.log"
    os.environ.update(NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="INIT,NET", NCCL_DEBUG_FILE=str(path))
    return path


def nccl_transport(log: str) -> tuple[str | None, list[str]]:
    """(the network NCCL chose: IB, Socket, or a plugin's name; None if the log doesn't say,
    the devices it uses on it) from NCCL's INFO log."""
    chosen = re.findall(r"NCCL INFO Using network (\S+)", log)
    if not chosen:
        return None, []
    network = chosen[-1]
    kind = "IB" if network.startswith("IB") else network
    uses = re.findall(rf"NCCL INFO NET/{re.escape(kind)} : Using (.*?)(?:;|\s*$)", log, re.M)
    devices = re.findall(r"\[\d+\](\S+)", uses[-1]) if uses else []
    return network, devices


def infiniband_devices() -> list[str]:
    """The host's RDMA devices (InfiniBand or RoCE), as the kernel lists them."""
    return sorted(p.name for p in INFINIBAND.iterdir()) if INFINIBAND.is_dir() else []


def describe_nccl(log_path: Path | None) -> tuple[str, str | None]:
    """(what NCCL uses, a warning or None) on this rank."""
    if log_path is None:
        return "NCCL (NCCL_DEBUG is set: its log says which network, at 'Using network')", None
    text = log_path.read_text(errors="replace") if log_path.is_file() else ""
    network, devices = nccl_transport(text)
    if network is None:
        return "NCCL, within this node only (no network in its log)", None
    line = f"NCCL over {network}" + (f" ({', '.join(devices)})" if devices else "")
    rdma = infiniband_devices()
    if network == "Socket" and rdma:
        return line, (f"NCCL uses TCP sockets although {socket.gethostname()} has RDMA devices "
                      f"({', '.join(rdma)}): the image may lack rdma-core and libibverbs, NCCL_IB_DISABLE may "
                      "be set, or no port is active (`ibv_devinfo`); inter-node traffic runs at a fraction "
                      "of the link's speed")
    return line, None


def ipv4_address(interface: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            packed = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, struct.pack("256s", interface[:15].encode()))
        except OSError:
            return None  # no IPv4 address on it
    return socket.inet_ntoa(packed[20:24])


def gloo_interface() -> str:
    """The interface gloo sends on: GLOO_SOCKET_IFNAME's, else the one that holds the address
    this host's name resolves to, which is how gloo picks its device."""
    named = os.environ.get("GLOO_SOCKET_IFNAME")
    if named:
        first = named.split(",")[0]
        return f"{first} ({ipv4_address(first) or 'no IPv4 address'}, GLOO_SOCKET_IFNAME)"
    try:
        address = socket.gethostbyname(socket.gethostname())
    except OSError:
        return "unknown: this host's name does not resolve"
    for _, name in socket.if_nameindex():
        if ipv4_address(name) == address:
            return f"{name} ({address}, the address of {socket.gethostname()})"
    return f"the one that holds {address}, the address of {socket.gethostname()}"
