"""Links with a rate, as nodes on 10 Gb/s Ethernet see them: each host's egress through a
token bucket (tests/support/netns.py, `rate_mbit`). A shaped link never carries more than its rate,
and a DDP job across two nodes over one ends with the same weights as on one host: a slow
link changes when the gradients arrive, never what they are.

Sweeps over link rates live in benchmarks/, not here.
"""

from __future__ import annotations

from support import multinode
from support.netns import Network
from support.runs import tiny_overrides, train
from support.weights import compare_weights

TWO_NODES = {"node0": [], "node1": []}

RECEIVER = """
import socket
server = socket.create_server(("0.0.0.0", 5201))
connection, _ = server.accept()
received = 0
while chunk := connection.recv(1 << 16):
    received += len(chunk)
print("received", received, flush=True)
"""

SENDER = """
import socket, sys, time
for attempt in range(100):  # until the receiver listens
    try:
        connection = socket.create_connection(("node1", 5201))
        break
    except ConnectionRefusedError:
        time.sleep(0.1)
started = time.monotonic()
connection.sendall(bytes(int(sys.argv[1])))
connection.shutdown(socket.SHUT_WR)
connection.recv(1)  # the receiver closes once it has read everything
print("seconds", time.monotonic() - started, flush=True)
"""


def test_a_shaped_link_never_carries_more_than_its_rate(tmp_path):
    """8 MB over a 50 Mb/s link take at least 1.28 s (less 10% for the bucket's first burst).
    Only the lower bound is asserted: a busy machine can only make it slower."""
    rate_mbit, size = 50, 8_000_000
    with Network(TWO_NODES, rate_mbit=rate_mbit) as net:
        receiver = net.spawn("node1", ["python3", "-c", RECEIVER], {}, tmp_path, log=tmp_path / "receiver.log")
        sender = net.spawn("node0", ["python3", "-c", SENDER, str(size)], {}, tmp_path, log=tmp_path / "sender.log")
        assert net.wait([sender, receiver], timeout=60) == [0, 0], (tmp_path / "sender.log").read_text()
    seconds = float((tmp_path / "sender.log").read_text().split()[-1])
    assert f"received {size}" in (tmp_path / "receiver.log").read_text()
    assert seconds >= 0.9 * size * 8 / (rate_mbit * 1e6), seconds


def test_ddp_across_two_nodes_over_a_slow_link_ends_as_on_one_host(tiny_model, reviews, tmp_path):
    """100 Mb/s: each step's ~4 MB of gradients take about a third of a second on the wire,
    longer than this model's compute. The weights are bitwise those of 2 ranks on one host,
    and the gradients did cross the shaped links."""
    options = {"train.batch_size": 8, "train.max_steps": 6, "checkpoint.every": 3}
    train(tiny_overrides(tiny_model, reviews, tmp_path / "one-host", **options))
    out = tmp_path / "two-nodes"
    with Network(TWO_NODES, rate_mbit=100) as net:
        procs = multinode.launch(net, tmp_path / "logs", tiny_overrides(tiny_model, reviews, out, **options))
        codes = net.wait(list(procs.values()), timeout=300)
        shaped = [net.shaped_bytes(host) for host in TWO_NODES]
    logs = "\n".join(p.read_text()[-3000:] for p in sorted((tmp_path / "logs").glob("*.log")))
    assert codes == [0, 0], logs
    assert not compare_weights(tmp_path / "one-host", out, 6).differing
    # Both nodes' links carried gradients: together, half a megabyte a step at the least.
    assert min(shaped) > 0 and sum(shaped) > 6 * 500_000, shaped
