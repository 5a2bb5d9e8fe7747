"""`python -m trainer doctor` on two nodes (network namespaces), under torchrun like training."""

from __future__ import annotations

import re

from support import multinode
from support.netns import Network
from support.runs import run, tiny_overrides, trainer_command

TWO_NODES = {"node0": [], "node1": []}


def report_of(logs) -> str:
    """Rank 0 prints the report; rendezvous decides which node rank 0 is on."""
    texts = [p.read_text() for p in sorted(logs.glob("*.log"))]
    (report,) = [t[t.index("trainer doctor:"):] for t in texts if "trainer doctor:" in t]
    return report


def test_doctor_reports_a_healthy_two_node_job(tiny_model, reviews, tmp_path):
    out = tmp_path / "run"
    # The grace the compose file and the Kubernetes manifests give (docs/restarts.md).
    env = {"GLOO_SOCKET_IFNAME": "eth0", "NCCL_IB_DISABLE": "1", "TRAINER_GRACE_S": "120",
           "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "110"}
    with Network(TWO_NODES) as net:
        procs = multinode.launch(net, tmp_path / "logs", tiny_overrides(tiny_model, reviews, out), nproc=2,
                                 env=env, command="doctor")
        codes = net.wait(list(procs.values()), timeout=180)
    report = report_of(tmp_path / "logs")
    assert codes == [0, 0], report

    assert "trainer doctor: 4 ranks on 2 hosts (node0, node1), backend gloo" in report
    rows = re.findall(r"^\s+(\d)\s+(node\d)\s+(\d)\s+cpu$", report, re.M)
    assert sorted((host, local) for _, host, local in rows) == [
        ("node0", "0"), ("node0", "1"), ("node1", "0"), ("node1", "1")]
    assert sorted(rank for rank, _, _ in rows) == ["0", "1", "2", "3"]
    assert "GLOO_SOCKET_IFNAME=eth0" in report
    assert re.search(r"rendezvous store node0:\d+: reached by all 4 ranks", report)
    sizes = re.findall(r"^\s+([\d.]+ [KM]iB)\s+([\d.]+) ms\s+([\d.]+) GB/s\s+([\d.]+) GB/s\s+rank \d \(node\d",
                       report, re.M)
    assert [size for size, *_ in sizes] == ["1 KiB", "256 KiB", "4 MiB", "16 MiB"]
    assert float(sizes[-1][3]) > 0  # the largest size moves real bandwidth
    for i, host in enumerate(("node0", "node1")):
        assert f"  {host} (2 ranks): gloo over eth0 (10.99.0.{11 + i}, GLOO_SOCKET_IFNAME)" in report
    assert "writable by all 4 ranks, one shared filesystem across 2 hosts" in report
    # The save, timed on output_dir's storage, against the grace a stopped job has.
    assert ("preemption grace: 110s from the stop signal to SIGKILL: the shorter of TRAINER_GRACE_S=120s and "
            "torchrun's TORCH_ELASTIC_SHUTDOWN_TIMEOUT=110s") in report
    assert re.search(r"a stop needs ~[\d.]+s: the step under way \(~[\d.]+s of compute\), then a save of the model "
                     r"and optimizer \([\d.]+s measured on output_dir's storage\)", report), report
    assert "wandb: mode disabled" in report
    assert "memory plan per rank on cpu: micro-batch 16 x 64 tokens, compute in fp32" in report
    assert re.search(r"the smallest device \(rank \d on node\d, cpu\): fits in ", report)
    # The forecast: the real model timed on every rank, on this job's link and buckets.
    assert "Scaling forecast (docs/forecast.md)" in report
    assert re.search(r"compute, the slowest rank, a micro-batch of 16 x \d+ tokens: forward \d+ ms", report)
    assert re.search(r"gradients: [\d.]+ MB a step per rank in \d+ buckets \(ddp, ddp.comm_hook=none", report)
    this_job = re.search(r"this job, 2 nodes x 2: (\d+) ms a step", report)
    forecast_rows = re.findall(r"^\s+(\d+)\s+(\d+)\s+16\s+(\d+) ms\s+[\d.]+\s+(\d+)%$", report, re.M)
    assert [(nodes, ranks) for nodes, ranks, _, _ in forecast_rows] == [
        ("1", "2"), ("2", "4"), ("4", "8"), ("8", "16"), ("16", "32"), ("32", "64")]
    assert this_job and forecast_rows[1][2] == this_job.group(1)
    efficiency = [int(e) for *_, e in forecast_rows]  # each rank keeps its batch: more ranks, more waiting
    assert efficiency == sorted(efficiency, reverse=True) and efficiency[0] <= 100
    assert "warning: NCCL_IB_DISABLE=1: InfiniBand is off" in report
    for host in ("node0", "node1"):  # each "node" has one core (taskset) for its two ranks
        assert f"warning: OMP_NUM_THREADS=1 x 2 local ranks exceeds the 1 CPU(s) of {host}" in report
    assert report.rstrip().endswith("doctor: OK, 3 warnings")
    assert not (out / ".doctor").exists() and not list(out.glob(".doctor-save-*"))


def test_doctor_fails_when_output_dir_is_not_shared(tiny_model, reviews, tmp_path):
    """node1 sees another folder at the same path, as a node-local disk would be."""
    out, local_disk = tmp_path / "run", tmp_path / "node1-local"
    out.mkdir()
    local_disk.mkdir()
    with Network(TWO_NODES) as net:
        procs = multinode.launch(net, tmp_path / "logs", tiny_overrides(tiny_model, reviews, out),
                                 command="doctor", binds={"node1": {str(out): local_disk}})
        codes = net.wait(list(procs.values()), timeout=180)
    report = report_of(tmp_path / "logs")
    assert codes == [1, 1], report
    assert "writable, NOT shared between hosts" in report
    assert re.search(r"problem: output_dir \S+ is not one shared filesystem: ranks on node0, node1 cannot see "
                     r"files written on other hosts; resuming needs every rank", report)
    assert "doctor: FAILED, 1 problem" in report


def test_doctor_names_a_missing_network_interface(tiny_model, reviews, tmp_path):
    """node1's GLOO_SOCKET_IFNAME names no interface it has: node1 says so before the process
    group forms, and node0 gives up on the group within dist.timeout_s."""
    overrides = tiny_overrides(tiny_model, reviews, tmp_path / "run", **{"dist.timeout_s": 6})
    with Network(TWO_NODES) as net:
        procs = {
            **multinode.launch(net, tmp_path / "logs", overrides, command="doctor", hosts=["node0"],
                               env={"GLOO_SOCKET_IFNAME": "eth0"}),
            **multinode.launch(net, tmp_path / "logs", overrides, command="doctor", hosts=["node1"],
                               env={"GLOO_SOCKET_IFNAME": "eth9"}),
        }
        codes = net.wait([procs["node0"], procs["node1"]], timeout=120)
    node0, node1 = ((tmp_path / "logs" / f"{h}.log").read_text() for h in ("node0", "node1"))
    assert codes[0] not in (0, None) and codes[1] not in (0, None), (node0[-2000:], node1[-2000:])
    assert re.search(r"error: rank \d on node1: GLOO_SOCKET_IFNAME=eth9: no interface eth9 on node1 "
                     r"\(it has eth0, lo\)", node1), node1[-2000:]
    assert re.search(r"error: rank \d on node0: could not form the process group through the store at \S+ "
                     r"within 6s", node0), node0[-2000:]


def test_doctor_fails_a_run_whose_memory_plan_exceeds_a_rank_s_memory(tiny_model, reviews, tmp_path):
    """2 ranks on this host, each with half its memory (tens of GiB at most): a micro-batch of
    a million samples can't fit, and doctor says so before any weights load, naming the fix."""
    overrides = tiny_overrides(tiny_model, reviews, tmp_path / "run", **{"train.batch_size": 1_000_000})
    result = run(trainer_command(overrides, nproc=2, command="doctor"), timeout=180)
    assert result.returncode == 1, result.output[-3000:]
    assert re.search(r"problem: memory: the run needs ~[\d.]+ [GT]iB per rank, more than 2 of 2 ranks can hold "
                     r"\(rank \d on \S+, cpu: [\d.]+ GiB usable\); lower train.batch_size", result.output), \
        result.output[-3000:]
    assert re.search(r"the largest micro-batch that fits: \d+ \(train.batch_size 1000000\)", result.output)
    assert "doctor: FAILED, 1 problem" in result.output
