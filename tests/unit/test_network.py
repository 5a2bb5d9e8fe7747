"""Which network doctor says the collectives use (trainer/preflight/network.py): NCCL's choice read
from its INFO log, the warning for RDMA devices left unused, and gloo's interface."""

from __future__ import annotations

import os
import socket

from trainer.preflight import network

IB_LOG = """\
gpu3:4021:4021 [0] NCCL INFO Bootstrap : Using bond0:10.8.0.3<0>
gpu3:4021:4088 [0] NCCL INFO NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_3:1/IB ; OOB bond0:10.8.0.3<0>
gpu3:4021:4088 [0] NCCL INFO Using network IB
"""
ROCE_LOG = """\
gpu3:4021:4088 [0] NCCL INFO NET/IB : Using [0]mlx5_4:1/RoCE [RO]; OOB eth2:10.9.0.3<0>
gpu3:4021:4088 [0] NCCL INFO Using network IB
"""
SOCKET_LOG = """\
gpu3:4021:4088 [0] NCCL INFO NET/IB : No device found.
gpu3:4021:4088 [0] NCCL INFO NET/Socket : Using [0]eth0:10.8.0.3<0> [1]eth1:10.9.0.3<0>
gpu3:4021:4088 [0] NCCL INFO Using network Socket
"""


def test_nccl_s_choice_is_read_from_its_log():
    assert network.nccl_transport(IB_LOG) == ("IB", ["mlx5_0:1/IB", "mlx5_3:1/IB"])
    assert network.nccl_transport(ROCE_LOG) == ("IB", ["mlx5_4:1/RoCE"])
    assert network.nccl_transport(SOCKET_LOG) == ("Socket", ["eth0:10.8.0.3<0>", "eth1:10.9.0.3<0>"])
    assert network.nccl_transport("gpu3:4021:4088 [0] NCCL INFO Channel 00/02 : 0 1\n") == (None, [])


def test_sockets_beside_rdma_devices_are_a_warning(tmp_path, monkeypatch):
    log = tmp_path / "nccl.log"
    log.write_text(SOCKET_LOG)
    monkeypatch.setattr(network, "INFINIBAND", tmp_path / "no-such-folder")
    assert network.describe_nccl(log) == ("NCCL over Socket (eth0:10.8.0.3<0>, eth1:10.9.0.3<0>)", None)
    (tmp_path / "infiniband" / "mlx5_0").mkdir(parents=True)
    monkeypatch.setattr(network, "INFINIBAND", tmp_path / "infiniband")
    _, warning = network.describe_nccl(log)
    assert warning is not None and "NCCL uses TCP sockets although" in warning and "(mlx5_0)" in warning
    log.write_text(IB_LOG)
    assert network.describe_nccl(log) == ("NCCL over IB (mlx5_0:1/IB, mlx5_3:1/IB)", None)


def test_doctor_asks_nccl_for_its_log_unless_the_user_did(tmp_path, monkeypatch):
    for name in ("NCCL_DEBUG", "NCCL_DEBUG_FILE", "NCCL_DEBUG_SUBSYS"):
        monkeypatch.setenv(name, "")  # recorded, so that what the product sets is undone after the test
        monkeypatch.delenv(name)
    path = network.capture_nccl_log(tmp_path)
    assert path is not None and path.parent == tmp_path
    assert (os.environ["NCCL_DEBUG"], os.environ["NCCL_DEBUG_SUBSYS"]) == ("INFO", "INIT,NET")
    assert os.environ["NCCL_DEBUG_FILE"] == str(path)
    monkeypatch.setenv("NCCL_DEBUG", "WARN")
    assert network.capture_nccl_log(tmp_path) is None
    assert "NCCL_DEBUG is set" in network.describe_nccl(None)[0]


def test_gloo_s_interface_is_named_with_its_address(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    assert network.gloo_interface() == "lo (127.0.0.1, GLOO_SOCKET_IFNAME)"
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    holder = network.gloo_interface()
    assert socket.gethostname() in holder
