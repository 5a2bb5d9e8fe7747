"""doctor's scaling forecast against the measured step time: the demo's model (MiniLM) and
data on 2, 3 and 4 network-namespace nodes, one rank each, with every node's egress shaped
to each link rate, with and without compression. At each point doctor runs first, exactly
as training will (same nodes, config and launcher), and its "this job" step time is
compared with what the training run then measured (global batch / samples/s of
summary.json: after the first step, evaluation and saves excluded).

    python -m benchmarks.forecast [--steps 50] [--nodes 2 3 4] [--rates 200 1000 5000]
                                  [--hooks none bf16 powersgd] [--buckets 25] [--data data/reviews]
                                  [--smoke] [key=value ...]

Root (network namespaces). Every node gets its share of the machine's cores, as
tests/support/netns.py gives it. Writes results/cpu-minilm-forecast.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import smoke
from benchmarks.interleaved import REPO, cpu_name
from trainer.runtime.launch import torchrun_argv, trainer_program

sys.path.insert(0, str(REPO / "tests"))
from support.netns import Network

THIS_JOB = re.compile(r"this job, (\d+) nodes x (\d+): (\d+) ms a step")


def run_on(net: Network, nodes: int, command: str, settings: list[str], logs: Path) -> str:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "GLOO_SOCKET_IFNAME": "eth0"}
    procs, run_id = [], f"{command}-{time.time_ns()}"
    for i in range(nodes):
        argv = torchrun_argv(1, trainer_program(command, config="configs/demo.yaml", overrides=settings),
                             nnodes=nodes, rdzv_endpoint="node0:29400", rdzv_id=run_id)
        procs.append(net.spawn(f"node{i}", argv, env, REPO, log=logs / f"{command}-node{i}.log"))
    codes = net.wait(procs, timeout=1800)
    text = (logs / f"{command}-node0.log").read_text()
    if command == "train" and codes != [0] * nodes:
        raise SystemExit(f"{command} failed {codes}:\n{text[-3000:]}")
    return text


def one_point(data: str, steps: int, nodes: int, rate: float, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as out, \
            Network({f"node{i}": [] for i in range(nodes)}, rate_mbit=rate) as net:
        settings = [f"data.path={data}", f"output_dir={out}/run", f"train.max_steps={steps}", "wandb.mode=disabled",
                    "checkpoint.every=0", "train.eval_every=0", "train.log_every=5", *extra]
        report = run_on(net, nodes, "doctor", settings, Path(out))
        found = THIS_JOB.search(report)
        if not found:
            raise SystemExit(f"no forecast in doctor's report:\n{report[-4000:]}")
        forecast_s = int(found.group(3)) / 1e3
        run_on(net, nodes, "train", settings, Path(out))
        summary = json.loads((Path(out) / "run" / "summary.json").read_text())
        windows = [json.loads(line) for line in (Path(out) / "run" / "metrics.jsonl").read_text().splitlines()]
    # Where the measured step's time went, from the training log's windows after the first.
    names = sorted({k for w in windows[1:] for k in w if k.startswith("time/")})
    phases = {k: statistics.fmean(w[k] for w in windows[1:] if k in w) for k in names}
    measured_s = summary["global_batch"] / summary["samples_per_s"]
    # The same after the first logging window, whose steps also pay the first step's one-off
    # work (DDP's re-bucketing, PowerSGD's first factors): the steady state the forecast is of.
    steady_s = statistics.fmean(summary["global_batch"] / w["samples_per_s"] for w in windows[1:]
                                if "samples_per_s" in w)
    return {"nodes": nodes, "rate_mbit": rate, "overrides": extra, "forecast_s": forecast_s,
            "measured_s": measured_s, "error": forecast_s / measured_s - 1, "steady_s": steady_s,
            "steady_error": forecast_s / steady_s - 1, "measured_phases": phases,
            "doctor": report[report.index("all-reduce, fp32"):].splitlines()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--nodes", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--rates", type=float, nargs="+", default=[200, 1000, 5000])
    parser.add_argument("--hooks", nargs="+", default=["none", "bf16", "powersgd"])
    parser.add_argument("--buckets", type=float, nargs="+", default=[25])
    parser.add_argument("--data", default=str(REPO / "data/reviews"))
    parser.add_argument("--out", default=str(Path(__file__).with_name("results") / "cpu-minilm-forecast.json"))
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="for doctor and training alike")
    smoke.add_flag(parser)
    args = parser.parse_args()
    out = Path(args.out)
    if args.smoke:  # one point of the grid, the smallest: 2 nodes, one rate, no hook, 4 steps in 2 windows
        args.nodes, args.rates, args.hooks, args.buckets, args.steps = [2], [5000], ["none"], [25], 4
        args.overrides = [*smoke.demo_overrides(smoke.folder()), "train.log_every=2", *args.overrides]
        out = smoke.results_path(out.name, smoke=True)
    points = []
    for rate in args.rates:
        for nodes in args.nodes:
            for hook in args.hooks:
                for bucket in args.buckets:
                    # PowerSGD from the second step: its exact first steps would time another hook.
                    start = ["ddp.powersgd_start_step=2"] if hook == "powersgd" else []
                    point = one_point(args.data, args.steps, nodes, rate,
                                      [f"ddp.comm_hook={hook}", f"ddp.bucket_cap_mb={bucket:g}", *start,
                                       *args.overrides])
                    points.append(point)
                    print(json.dumps({k: v for k, v in point.items() if k != "doctor"}), flush=True)
    result = {"date": time.strftime("%Y-%m-%d"), "cpu": cpu_name(), "steps": args.steps, "points": points,
              "worst_error": max(abs(p["error"]) for p in points)}
    out.write_text(json.dumps(result, indent=1) + "\n")
    chart(points, out.with_suffix(".png"))
    print(f"worst |forecast / measured - 1|: {result['worst_error']:.1%}")


def chart(points: list[dict], path: Path) -> None:
    """Forecast against measured step time, log-log, with the +-15% band around equality."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 5))
    low = min(min(p["forecast_s"], p["measured_s"]) for p in points) / 1.3
    high = max(max(p["forecast_s"], p["measured_s"]) for p in points) * 1.3
    ax.plot([low, high], [low, high], color="black", linewidth=0.8)
    ax.fill_between([low, high], [low * 0.85, high * 0.85], [low * 1.15, high * 1.15], color="0.9", label="+-15%")
    for hook, marker in (("none", "o"), ("bf16", "s"), ("powersgd", "^")):
        mine = [p for p in points if f"ddp.comm_hook={hook}" in p["overrides"]]
        for rate, color in zip(sorted({p["rate_mbit"] for p in points}), ("tab:red", "tab:blue", "tab:green"),
                               strict=False):
            at = [p for p in mine if p["rate_mbit"] == rate]
            if at:
                ax.scatter([p["measured_s"] for p in at], [p["forecast_s"] for p in at], marker=marker, color=color,
                           label=f"{hook}, {rate:g} Mb/s")
    ax.set(xscale="log", yscale="log", xlim=(low, high), ylim=(low, high), xlabel="measured step (s)",
           ylabel="doctor's forecast (s)", title="Scaling forecast against measured steps\n(MiniLM, 2-4 nodes)")
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        axis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
