"""`python -m trainer doctor`: a preflight check, run under the same launcher as training.

Minutes on the cluster instead of hours: it forms the job's real process group and checks
what makes multi-node jobs hang or crawl, before any model is loaded (the forecast's timed
steps come last).
- who is where: each rank's host, local rank and device, and no GPU used twice on a node;
- the NCCL_* / GLOO_* / TORCH_* settings, with known-bad values flagged;
- that every rank reaches the job's store and forms the process group, and how fast;
- a timed all-reduce at several sizes: algorithm and bus bandwidth, and the slowest rank;
- the network the collectives really use: NCCL's transport (InfiniBand, RoCE or sockets, from
  its own log), gloo's interface (trainer/preflight/network.py);
- that output_dir is writable by every rank and is one shared filesystem across hosts;
- the wandb settings;
- that the memory plan (trainer/preflight/memory.py) fits each rank's device;
- a scaling forecast (trainer/preflight/forecast.py): a few timed steps of the real model on every
  rank, and the all-reduce timings, predict the step time at more nodes.

Every rank checks itself; rank 0 gathers the answers and prints one report. Exit 0 when
nothing is wrong (warnings allowed), 1 when something is.
"""

from __future__ import annotations

import os
import shutil
import socket
import statistics
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from trainer import errors
from trainer.config.schema import Config
from trainer.data import labels as labels_module
from trainer.data import reading
from trainer.data.batch_plan import BatchPlan
from trainer.errors import TrainerError, describe
from trainer.preflight import forecast, grace, memory, network
from trainer.runtime import devices, distributed
from trainer.runtime.environment import DistEnv
from trainer.strategies import registry

ENV_PREFIXES = ("NCCL_", "GLOO_", "TORCH_NCCL_", "TORCH_DISTRIBUTED_", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE",
                "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES")


@dataclass
class Findings:
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


@dataclass
class Section(Findings):
    """A part of the report: its lines, and what it found. The report prints the lines of one
    section after another, and every section's warnings and problems at its end."""

    lines: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Gathered:
    """What the report judges: every rank's answers, gathered on rank 0, in rank order, and the
    job's backend, output_dir and memory plan."""

    ranks: list[dict]  # each rank's facts: host, local rank, device, settings, store round trip, memory, driver
    findings: list[Findings]  # each rank's check_env
    sizes: list[int]  # the all-reduce's element counts
    all_reduce: list[list[tuple[float, bool]]]  # per size, each rank's (median seconds, sum correct)
    links: list[tuple[str, str | None]]  # each rank's (network, warning or None)
    shared: list[tuple[str, list[int]]]  # each rank's ('' or why output_dir is not writable, ranks it sees)
    backend: str
    output_dir: Path
    plan: memory.MemoryPlan | str  # or why there is none

    @property
    def hosts(self) -> list[str]:
        return sorted({f["host"] for f in self.ranks})


# --- this rank's own checks -------------------------------------------------------------


def relevant_env() -> dict[str, str]:
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES) and k != "NCCL_COMM_ID"}


def _interfaces() -> list[str]:
    return sorted(name for _, name in socket.if_nameindex())


def _nccl_ifname_matches(spec: str, interfaces: list[str]) -> bool:
    """NCCL_SOCKET_IFNAME: comma-separated prefixes; `=` for exact names, `^` to exclude."""
    if spec.startswith("^"):
        return True  # an exclusion list leaves something unless it excludes everything
    exact = spec.startswith("=")
    names = [n for n in spec.lstrip("=").split(",") if n]
    return any(i == n if exact else i.startswith(n) for n in names for i in interfaces)


def check_env(env: dict[str, str], dist_env: DistEnv, multi_host: bool) -> Findings:
    """Known-bad settings: the ones that hang a job, or quietly make it slow."""
    found, interfaces, host = Findings(), _interfaces(), socket.gethostname()
    gloo_ifname = env.get("GLOO_SOCKET_IFNAME")
    if gloo_ifname:
        missing = [n for n in gloo_ifname.split(",") if n not in interfaces]
        if missing:
            found.problems.append(f"GLOO_SOCKET_IFNAME={gloo_ifname}: no interface {', '.join(missing)} on "
                                  f"{host} (it has {', '.join(interfaces)})")
    nccl_ifname = env.get("NCCL_SOCKET_IFNAME")
    if nccl_ifname and not _nccl_ifname_matches(nccl_ifname, interfaces):
        found.problems.append(f"NCCL_SOCKET_IFNAME={nccl_ifname}: matches no interface on {host} "
                              f"(it has {', '.join(interfaces)})")
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        if multi_host and env.get(name, "").lstrip("=") in ("lo", "lo0"):
            found.problems.append(f"{name}={env[name]}: the loopback interface cannot reach other hosts")
    flags = {
        "NCCL_IB_DISABLE": "InfiniBand is off: inter-node traffic falls back to TCP sockets",
        "NCCL_P2P_DISABLE": "GPU peer-to-peer is off: intra-node traffic goes through host memory",
        "NCCL_SHM_DISABLE": "shared-memory transport is off",
    }
    for name, why in flags.items():
        if env.get(name) == "1":
            found.warnings.append(f"{name}=1: {why}")
    for name in ("NCCL_ALGO", "NCCL_PROTO"):
        if name in env:
            found.warnings.append(f"{name}={env[name]}: forces NCCL's choice, which is usually slower")
    if env.get("NCCL_DEBUG", "").upper() == "TRACE":
        found.warnings.append("NCCL_DEBUG=TRACE: very verbose and slow; INFO is enough to debug a hang")
    if env.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL":
        found.warnings.append("TORCH_DISTRIBUTED_DEBUG=DETAIL: checks every collective, slowing training")
    for old in ("NCCL_BLOCKING_WAIT", "NCCL_ASYNC_ERROR_HANDLING"):
        if old in env:
            found.warnings.append(f"{old}: deprecated and ignored; use TORCH_{old}")
    if env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING") == "0":
        found.warnings.append("TORCH_NCCL_ASYNC_ERROR_HANDLING=0: a timed-out NCCL collective hangs "
                              "the job instead of failing it")
    restarts = os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")
    if restarts.isdigit() and int(restarts) > 0 and env.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") != "1":
        found.warnings.append("torchrun --max-restarts without TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: "
                              "restarted workers can read stale peer addresses and fail again")
    threads = env.get("OMP_NUM_THREADS")
    cpus = len(os.sched_getaffinity(0))
    if threads and threads.isdigit() and int(threads) * dist_env.local_world_size > cpus:
        found.warnings.append(f"OMP_NUM_THREADS={threads} x {dist_env.local_world_size} local ranks "
                              f"exceeds the {cpus} CPU(s) of {host}: ranks will fight for cores")
    return found


def store_round_trip(dist_env: DistEnv) -> float:
    """Seconds for one set+get on the job's store (its host is rank 0's node)."""
    store = dist.distributed_c10d._get_default_store()
    key = f"trainer/doctor/{dist_env.rank}"
    started = time.perf_counter()
    store.set(key, socket.gethostname())
    store.get(key)
    return time.perf_counter() - started


def describe_device(device: torch.device) -> tuple[str, str]:
    """(what the device is, an id that is unique per physical device on a host)."""
    if device.type != "cuda":
        return "cpu", ""
    props = torch.cuda.get_device_properties(device)
    return f"cuda:{device.index} {props.name}", str(getattr(props, "uuid", device.index))


# --- collective checks ------------------------------------------------------------------


def time_all_reduce(numel: int, device: torch.device, iterations: int) -> tuple[float, bool]:
    """(median seconds per all-reduce on this rank, result correct)."""
    world = dist.get_world_size()
    tensor = torch.empty(numel, dtype=torch.float32, device=device)
    times = []
    for i in range(iterations + 2):  # two warm-up rounds: connection setup, allocations
        tensor.fill_(dist.get_rank() + 1)
        dist.barrier()
        started = time.perf_counter()
        dist.all_reduce(tensor)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= 2:
            times.append(time.perf_counter() - started)
    correct = bool((tensor == world * (world + 1) / 2).all())
    return statistics.median(times), correct


def shared_output_dir(output_dir: Path, dist_env: DistEnv) -> tuple[str, list[int]]:
    """('' or why not writable, the ranks whose probe files this rank can see)."""
    token = distributed.broadcast_from_rank_zero(dist_env, uuid.uuid4().hex if dist_env.is_rank_zero else None)
    probe_dir = Path(os.path.realpath(output_dir)) / ".doctor" / token  # through a dangling runs/ link too
    error = ""
    try:
        probe_dir.mkdir(parents=True, exist_ok=True)
        (probe_dir / f"rank-{dist_env.rank}").write_text(socket.gethostname())
    except OSError as e:
        error = describe(e)
    dist.barrier()  # every rank has written its probe before any rank looks
    seen = sorted(int(p.name[5:]) for p in probe_dir.glob("rank-*")) if probe_dir.is_dir() else []
    dist.barrier()  # every rank has looked before rank 0 removes the probes
    if dist_env.is_rank_zero:
        shutil.rmtree(output_dir / ".doctor", ignore_errors=True)
    return error, seen


def check_wandb(cfg: Config, output_dir: Path) -> tuple[str, Findings]:
    found = Findings()
    mode = cfg.wandb.mode
    where = os.environ.get("WANDB_DIR") or str(output_dir)
    line = f"mode {mode}, project {cfg.wandb.project}" + (f", entity {cfg.wandb.entity}" if cfg.wandb.entity else "")
    if mode == "offline":
        line += f"; runs under {where}/wandb, upload later with `wandb sync`"
    elif mode == "online":
        has_key = bool(os.environ.get("WANDB_API_KEY"))
        line += "; API key from " + ("WANDB_API_KEY" if has_key else "~/.netrc")
        if os.environ.get("WANDB_MODE") in ("offline", "disabled"):
            found.warnings.append(f"WANDB_MODE={os.environ['WANDB_MODE']} overrides wandb.mode=online")
    if mode != "disabled" and not os.access(Path(where) if Path(where).exists() else Path(where).parent, os.W_OK):
        found.problems.append(f"wandb: {where} is not writable")
    return line, found


# --- the report -------------------------------------------------------------------------


def _sizes(device: torch.device) -> list[int]:
    """Element counts (fp32): latency-bound to bandwidth-bound, smaller on CPU."""
    if device.type == "cuda":
        return [2**8, 2**18, 2**22, 2**26]  # 1 KiB, 1 MiB, 16 MiB, 256 MiB
    return [2**8, 2**16, 2**20, 2**22]  # 1 KiB, 256 KiB, 4 MiB, 16 MiB


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:g} {unit}"
        n //= 1024
    return f"{n} TiB"


def run(cfg: Config, dist_env: DistEnv, device: torch.device, backend: str) -> int:
    """Every rank runs this; rank 0 prints the report. Returns the exit code (same on all)."""
    timeout_s = cfg.dist.timeout_s
    host = socket.gethostname()
    env = relevant_env()
    if not dist_env.is_distributed:
        print("doctor: not launched by torchrun (no RANK/MASTER_ADDR): run it exactly as you run "
              "training, e.g. `torchrun ... -m trainer doctor -c CONFIG`")
        return 1
    # Checks that need no peers come first: a bad interface would otherwise surface as an
    # obscure failure, or a wait, inside the process group.
    own = check_env(env, dist_env, multi_host=dist_env.world_size > dist_env.local_world_size)
    if own.problems:
        for problem in own.problems:
            print(f"error: rank {dist_env.rank} on {host}: {problem}", flush=True)
        return 1
    with tempfile.TemporaryDirectory(prefix="trainer-doctor-", ignore_cleanup_errors=True) as scratch:
        nccl_log = network.capture_nccl_log(Path(scratch)) if backend == "nccl" else None
        try:
            distributed.init(dist_env, device, backend, timeout_s, Path(cfg.output_dir))
        except Exception as e:  # whatever init raised, the rank reports it and exits 1  # noqa: BLE001
            print(f"error: rank {dist_env.rank} on {host}: could not form the process group through the store at "
                  f"{dist_env.master_addr}:{dist_env.master_port} within {timeout_s:g}s ({type(e).__name__}); "
                  "a rank failed its own checks, never started, or cannot reach that address", flush=True)
            return 1
        try:
            return _collective_checks(cfg, dist_env, device, backend, host, env, own, nccl_log)
        except TrainerError as e:  # raised alike on every rank by the collective helpers: one line each
            errors.report(e)
            return 1
        except Exception as e:  # a check that broke: one line on this rank; its peers' next collective  # noqa: BLE001
            # fails once the group closes, and they report that in one line too.
            errors.report(f"doctor: rank {dist_env.rank} on {host}: {describe(e)}")
            return 1
        finally:
            distributed.close()


def _collective_checks(cfg: Config, dist_env, device, backend, host, env, own: Findings, nccl_log: Path | None) -> int:
    device_name, device_id = describe_device(device)
    facts = {"rank": dist_env.rank, "host": host, "local_rank": dist_env.local_rank, "device": device_name,
             "device_id": device_id, "env": env, "rtt": store_round_trip(dist_env),
             "memory": memory.device_bytes(device, dist_env.local_world_size),
             "driver": devices.driver_check(devices.nvidia_driver()) if device.type == "cuda" else None}
    ranks: list[dict] = distributed.all_gather(dist_env, facts)
    findings: list[Findings] = distributed.all_gather(dist_env, own)

    sizes, results = _sizes(device), []
    for numel in sizes:
        seconds, correct = time_all_reduce(numel, device, iterations=5 if numel >= 2**20 else 20)
        per_rank: list[tuple[float, bool]] = distributed.all_gather(dist_env, (seconds, correct))
        results.append(per_rank)
    # After the first collective: NCCL connects its communicator then, and logs its choice.
    transport = network.describe_nccl(nccl_log) if backend == "nccl" else (f"gloo over {network.gloo_interface()}",
                                                                            None)
    links: list[tuple[str, str | None]] = distributed.all_gather(dist_env, transport)

    output_dir = Path(cfg.output_dir)
    write_error, seen = shared_output_dir(output_dir, dist_env)
    shared: list[tuple[str, list[int]]] = distributed.all_gather(dist_env, (write_error, seen))

    plan = plan_or_reason(cfg, dist_env, device)
    # forecast.measure is collective (its subgroups, the data's local-rank-zero-first): every
    # rank measures or none does, or those that did would wait for the others until the timeout.
    unmeasured = [reason for reason in distributed.all_gather(dist_env, _unmeasured(cfg, dist_env, device, plan))
                  if reason]
    measured = unmeasured[0] if unmeasured else _measure(cfg, dist_env, device)
    computes: list = distributed.all_gather(dist_env, measured if isinstance(measured, str) else measured[:2])
    save_s: float | str | None = None
    if not any(isinstance(m, str) for m in computes) and not any(e for e, _ in shared):
        assert isinstance(measured, forecast.Measured), "every rank measured"
        try:
            save_s = grace.time_save(cfg, dist_env, measured.built, measured.data, save_folder(output_dir, dist_env))
        except TrainerError as e:  # the Checkpointer raises a failed save alike on every rank
            save_s = str(e)

    code = 0
    if dist_env.is_rank_zero:  # the others wait in the broadcast below, for seconds
        gathered = Gathered(ranks=ranks, findings=findings, sizes=sizes, all_reduce=results, links=links,
                            shared=shared, backend=backend, output_dir=output_dir, plan=plan)
        code = _report(cfg, dist_env, gathered, _grace(cfg, dist_env, computes, save_s),
                       _forecast(cfg, dist_env, gathered, computes, measured))
    return distributed.broadcast_from_rank_zero(dist_env, code)


def save_folder(output_dir: Path, dist_env: DistEnv) -> Path:
    """Collective: where the save check writes, the same folder on every rank (rank 0's
    name): each rank writes its own files into the checkpoint rank 0 creates there (PowerSGD's
    per-rank state, FSDP's shards)."""
    token = distributed.broadcast_from_rank_zero(dist_env, uuid.uuid4().hex if dist_env.is_rank_zero else None)
    return Path(os.path.realpath(output_dir)) / f".doctor-save-{token}"  # through a dangling runs/ link too


def _grace(cfg: Config, dist_env: DistEnv, computes: list, save_s: float | str | None) -> Section:
    """The preemption grace section: the slowest rank's step, then the save; `save_s` is why
    the save failed where it did."""
    if isinstance(save_s, str):  # a run's checkpoints would fail alike
        return Section(problems=[f"the save check: {save_s}"])
    if save_s is None:
        reason = next((m for m in computes if isinstance(m, str)), "output_dir is not writable")
        return Section(warnings=[f"preemption grace not checked: no save timed ({reason})"])
    batch = BatchPlan.of(cfg.train, dist_env.world_size)
    steps = [c.at(batch.micro_batch) for c, _ in computes]
    step_s = max((c.forward_s + c.backward_s) * batch.grad_accum + c.optimizer_s for c in steps)
    lines, warnings = grace.check(step_s, save_s)
    return Section(lines=lines, warnings=warnings)


def _unmeasured(cfg: Config, dist_env: DistEnv, device: torch.device, plan) -> str | None:
    """Why this rank can't time training steps, or None. Not when the memory plan fails it:
    doctor reports that instead of running out of memory."""
    if isinstance(plan, str):
        return f"no memory plan on rank {dist_env.rank}"
    if not plan.fits(memory.device_bytes(device, dist_env.local_world_size)):
        return f"the memory plan does not fit rank {dist_env.rank}"
    return None


def _measure(cfg: Config, dist_env: DistEnv, device: torch.device) -> tuple | str:
    """This rank's timed training steps for the forecast (a collective), or why there are none.
    A strategy the forecast does not model (FSDP) is timed over every rank, its own collectives
    included: its steps and its save (each rank's shards) still give the grace check."""
    try:
        return forecast.measure(cfg, dist_env, device, alone=not registry.of(cfg).forecast_unsupported)
    except TrainerError as e:
        return f"rank {dist_env.rank}: {e}"
    except Exception as e:  # a forecast that can't be made is a warning, not a failed check  # noqa: BLE001
        return f"rank {dist_env.rank}: {describe(e)}"
    finally:
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the timed model is gone: give its memory back


def _forecast(cfg: Config, dist_env: DistEnv, gathered: Gathered, computes, own) -> Section:
    """The "Scaling forecast" section."""
    unsupported = registry.of(cfg).forecast_unsupported
    if unsupported:
        return Section(warnings=[f"no scaling forecast: {unsupported}"])
    reasons = [m for m in computes if isinstance(m, str)]
    if reasons:
        return Section(warnings=[f"no scaling forecast: {reasons[0]}"])
    if dist_env.world_size == 1:
        return Section(warnings=["no scaling forecast: one rank has no link to measure"])
    timings = [(numel * 4, statistics.median(t for t, _ in per_rank))
               for numel, per_rank in zip(gathered.sizes, gathered.all_reduce, strict=True)]
    link = forecast.Link.fit(timings, dist_env.world_size)
    batches, params = own.batches, own.params
    slowest = max((c for c, _ in computes), key=lambda c: c.forward_s + c.backward_s + c.optimizer_s)
    section = Section(lines=forecast.section(cfg, gathered.backend, link, slowest, batches, params, dist_env.world_size,
                                             dist_env.local_world_size))
    if len(gathered.hosts) == 1:
        section.warnings.append("the scaling forecast's link was measured within one host: its rows for more "
                                "nodes assume the same link between nodes; run doctor across two nodes to measure "
                                "the network")
    return section


def plan_or_reason(cfg: Config, dist_env: DistEnv, device: torch.device) -> memory.MemoryPlan | str:
    """Collective: the run's memory plan on this kind of device, or why there is none (a hub
    model this node can't reach: training may still reach it). Its labels are the config's,
    or the data's where only the data can tell."""
    try:
        labels = labels_module.from_config(cfg.data) or reading.load(cfg, dist_env).labels
        return memory.make(cfg, labels, device, dist_env.world_size)
    except TrainerError as e:
        return str(e)


def _report(cfg: Config, dist_env: DistEnv, gathered: Gathered, stopping: Section, outlook: Section) -> int:
    """Prints the report, one section after another, then every section's warnings (each once)
    and problems. Returns the exit code: 1 when there is a problem."""
    sections = [_title(gathered), _own_checks(gathered), _ranks(gathered), _settings(gathered),
                _store(dist_env, gathered), _all_reduce(gathered), _network(gathered), _output_dir(cfg, gathered),
                stopping, _wandb(cfg, gathered.output_dir), _memory(gathered), outlook]
    warnings = list(dict.fromkeys(w for section in sections for w in section.warnings))
    problems = [p for section in sections for p in section.problems]
    blocks = [section.lines for section in sections if section.lines] + [_verdict(warnings, problems)]
    print("\n\n".join("\n".join(lines) for lines in blocks), flush=True)
    return 1 if problems else 0


def _title(gathered: Gathered) -> Section:
    hosts = gathered.hosts
    title = (f"trainer doctor: {_count(len(gathered.ranks), 'rank')} on {_count(len(hosts), 'host')} "
             f"({', '.join(hosts)}), backend {gathered.backend}")
    return Section(lines=[title])


def _own_checks(gathered: Gathered) -> Section:
    """What each rank found of its own settings (check_env): no lines, the settings section
    shows the values. The same warning from every rank is sorted beside its copies, to be said once."""
    return Section(problems=[p for f in gathered.findings for p in f.problems],
                   warnings=sorted(w for f in gathered.findings for w in f.warnings))


def _ranks(gathered: Gathered) -> Section:
    """Who is where: a host's local ranks are 0..n-1, each on its own GPU, under a driver new enough."""
    section = Section(lines=["ranks", f"  {'rank':>4}  {'host':<24} {'local':>5}  device"])
    section.lines += [f"  {f['rank']:>4}  {f['host']:<24} {f['local_rank']:>5}  {f['device']}" for f in gathered.ranks]
    for host in gathered.hosts:
        on_host = [f for f in gathered.ranks if f["host"] == host]
        local = sorted(f["local_rank"] for f in on_host)
        if local != list(range(len(on_host))):
            section.problems.append(f"{host}: local ranks {local}, expected 0..{len(on_host) - 1}")
        ids = [f["device_id"] for f in on_host if f["device_id"]]
        if len(ids) != len(set(ids)):
            section.problems.append(f"{host}: two ranks share one GPU ({', '.join(f['device'] for f in on_host)}); "
                                    "--nproc-per-node must not exceed the GPUs per node")
        driver = on_host[0]["driver"]
        if driver is not None:
            line, too_old = driver
            section.lines.append(f"  {host}: {line}")
            if too_old:
                section.problems.append(f"{host}: {too_old}")
    return section


def _settings(gathered: Gathered) -> Section:
    """Each setting once, with every value it has across ranks: only CUDA_VISIBLE_DEVICES may differ."""
    section = Section(lines=["settings (NCCL_*, GLOO_*, TORCH_*, OMP_NUM_THREADS, CUDA_VISIBLE_DEVICES)"])
    names = sorted({k for f in gathered.ranks for k in f["env"]})
    for name in names:
        values = {f["env"].get(name, "(unset)") for f in gathered.ranks}
        if len(values) == 1 or name == "CUDA_VISIBLE_DEVICES":
            section.lines.append(f"  {name}={' / '.join(sorted(values))}")
        else:
            section.lines.append(f"  {name}: differs between ranks: {' / '.join(sorted(values))}")
            section.warnings.append(f"{name} differs between ranks")
    if not names:
        section.lines.append("  (none set)")
    return section


def _store(dist_env: DistEnv, gathered: Gathered) -> Section:
    slowest = max(gathered.ranks, key=lambda f: f["rtt"])
    line = (f"rendezvous store {dist_env.master_addr}:{dist_env.master_port}: reached by all {len(gathered.ranks)} "
            f"ranks, round trip up to {slowest['rtt'] * 1e3:.1f} ms (rank {slowest['rank']} on {slowest['host']})")
    return Section(lines=[line])


def _all_reduce(gathered: Gathered) -> Section:
    """Each size's median time and bandwidth, and its slowest rank; a wrong sum is a problem."""
    world, backend = len(gathered.ranks), gathered.backend
    algorithm = "ring, gloo's default" if backend == "gloo" else os.environ.get("NCCL_ALGO", "chosen by NCCL per size")
    section = Section(lines=[f"all-reduce, fp32 ({backend}, algorithm: {algorithm})",
                             f"  {'size':>9}  {'time':>10}  {'algbw':>12}  {'busbw':>12}  slowest rank"])
    for numel, per_rank in zip(gathered.sizes, gathered.all_reduce, strict=True):
        nbytes = numel * 4
        times = [t for t, _ in per_rank]
        slowest = max(range(world), key=lambda r: times[r])
        seconds = statistics.median(times)
        algbw = nbytes / seconds / 1e9
        busbw = algbw * 2 * (world - 1) / world  # what each link carries in a ring: nccl-tests' convention
        section.lines.append(f"  {_human_bytes(nbytes):>9}  {seconds * 1e3:>7.2f} ms  {algbw:>7.3f} GB/s  "
                             f"{busbw:>7.3f} GB/s  rank {slowest} ({gathered.ranks[slowest]['host']}, "
                             f"{times[slowest] * 1e3:.2f} ms)")
        wrong = [r for r, (_, ok) in enumerate(per_rank) if not ok]
        if wrong:
            section.problems.append(f"all-reduce of {_human_bytes(nbytes)} gave wrong sums on ranks {wrong}")
    return section


def _network(gathered: Gathered) -> Section:
    """The network each host's ranks use, one line per host and network."""
    by_host: dict[tuple[str, str], list[int]] = {}
    for f, (line, _) in zip(gathered.ranks, gathered.links, strict=True):
        by_host.setdefault((f["host"], line), []).append(f["rank"])
    return Section(lines=["network"] + [f"  {host} ({_count(len(ranks), 'rank')}): {line}"
                                        for (host, line), ranks in sorted(by_host.items())],
                   warnings=[warning for _, warning in gathered.links if warning])


def _output_dir(cfg: Config, gathered: Gathered) -> Section:
    """Writable by every rank, and one filesystem across hosts: a problem when a resume would
    read rank 0's checkpoints on every rank, a warning otherwise."""
    world, output_dir = len(gathered.ranks), gathered.output_dir
    section = Section(lines=[f"output_dir {output_dir}"])
    unwritable = [(r, e) for r, (e, _) in enumerate(gathered.shared) if e]
    for rank, error in unwritable:
        section.problems.append(f"output_dir {output_dir}: not writable by rank {rank} on "
                                f"{gathered.ranks[rank]['host']}: {error}")
    blind = [r for r, (_, visible) in enumerate(gathered.shared) if visible != list(range(world))]
    if unwritable:
        section.lines.append("  not writable by every rank")
    elif blind:
        hosts_blind = sorted({gathered.ranks[r]["host"] for r in blind})
        message = (f"output_dir {output_dir} is not one shared filesystem: ranks on {', '.join(hosts_blind)} "
                   "cannot see files written on other hosts")
        if cfg.checkpoint.resume != "never":
            section.problems.append(message + "; resuming needs every rank to read rank 0's checkpoints")
        else:
            section.warnings.append(message)
        section.lines.append("  writable, NOT shared between hosts")
    else:
        section.lines.append(f"  writable by all {_count(world, 'rank')}, "
                             f"one shared filesystem across {_count(len(gathered.hosts), 'host')}")
    return section


def _wandb(cfg: Config, output_dir: Path) -> Section:
    line, found = check_wandb(cfg, output_dir)
    return Section(lines=[f"wandb: {line}"], warnings=found.warnings, problems=found.problems)


def _memory(gathered: Gathered) -> Section:
    """The memory plan against the smallest device: a problem for every rank it does not fit."""
    plan = gathered.plan
    if isinstance(plan, str):
        return Section(warnings=[f"no memory plan: {plan}"])
    # On CPU a rank's device is its share of the host's memory.
    smallest = min(gathered.ranks, key=lambda f: f["memory"])
    where = f"rank {smallest['rank']} on {smallest['host']}, {smallest['device']}"
    section = Section(lines=[*plan.lines(smallest["device"]),
                             f"  the smallest device ({where}): {plan.verdict(smallest['memory'])}"])
    short = [f for f in gathered.ranks if not plan.fits(f["memory"])]
    if short:
        least = memory.human(memory.usable(smallest["memory"]))
        section.problems.append(f"memory: the run needs ~{memory.human(plan.total)} per rank, more than {len(short)} "
                                f"of {len(gathered.ranks)} ranks can hold ({where}: {least} usable); lower "
                                "train.batch_size (train.global_batch stays), or set model.gradient_checkpointing=true "
                                "or model.lora.r")
    return section


def _verdict(warnings: list[str], problems: list[str]) -> list[str]:
    if problems:
        summary = f"doctor: FAILED, {_count(len(problems), 'problem')}, {_count(len(warnings), 'warning')}"
    else:
        summary = f"doctor: OK, {_count(len(warnings), 'warning')}"
    return [f"warning: {w}" for w in warnings] + [f"problem: {p}" for p in problems] + [summary]
