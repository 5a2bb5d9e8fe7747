"""What a training step costs a GPU, counted on the CPU: its launch budget.

On a GPU each aten op the host dispatches is roughly one kernel launch, and each host read of
a device tensor's value (`.item()`, `.tolist()`, `bool(t)`, an op whose output shape depends
on the data, a blocking copy to the host) stalls the host until the GPU's queue has drained:
the GPU then idles while the host launches the next kernels. Neither needs a GPU to be seen.
`StepCounts` counts them for whatever runs inside it, on any device, and the counts are
deterministic (the same code and shapes dispatch the same ops), so tests may assert them.

Nothing in training imports this module: it lives with the tests, and benchmarks/launch_budget.py
loads it by path.
It imports nothing of trainer/ either, so that the benchmark can count older commits' steps.

A read of the host's own data (the loader's batch, before the step moves it to the device)
is no sync on a GPU: it is counted apart, in `host_reads`. A tensor is the host's when the
caller says so (`host`) or when every tensor an op read to make it was; a `.to(device)` of
one makes it a device tensor, also on the CPU, where that `.to` returns the same tensor.
"""

from __future__ import annotations

import traceback
from collections import Counter
from collections.abc import Mapping
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

SYNC_OPS = {
    "_local_scalar_dense",  # .item(), bool(t), int(t), float(t); tolist() is seen apart
    "nonzero", "nonzero_static", "masked_select", "unique", "_unique2", "unique_consecutive", "unique_dim",
    "repeat_interleave",  # with a tensor of repeats: its output size is read on the host
    "_assert_async",  # torch._assert_async: a host check on CUDA
}
"""Ops that read a value on the host: on a GPU, the host waits for the queue to drain."""

COPY_OPS = {"_to_copy", "copy_", "copy", "_copy_from", "_copy_from_and_resize"}
"""Copies and casts: autocast's casts, dtype changes, host-device copies."""

_TO_HOST = {"cpu", "numpy", "tolist"}
"""Reads of a device tensor by the host. (A device tensor's `.to("cpu")` is not told apart
from a `.to(device)` on the CPU, where the two are the same call: it is not counted.)"""


def _where() -> str:
    """The innermost frame of the caller's code (not torch's): what asked for a sync."""
    for frame in reversed(traceback.extract_stack()[:-1]):
        name = frame.filename.replace("\\", "/")
        if ("/torch/" in name and "/site-packages/" in name) or name.endswith("perf_counts.py"):
            continue
        parts = name.split("/")
        short = "/".join(parts[-2:])
        return f"{short}:{frame.lineno} {frame.name}"
    return "?"


class _Host:
    """Which tensors hold the host's own data (see the module's docstring)."""

    def __init__(self) -> None:
        self.tensors: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def mark(self, tensors: Any) -> None:
        if isinstance(tensors, torch.Tensor):
            self.tensors[tensors] = True
        elif isinstance(tensors, Mapping):  # also a loader's BatchEncoding, a leaf to pytree
            for value in tensors.values():
                self.mark(value)
        elif isinstance(tensors, (list, tuple)):
            for value in tensors:
                self.mark(value)

    def unmark(self, t: Any) -> None:
        if isinstance(t, torch.Tensor) and t in self.tensors:
            del self.tensors[t]

    def all_host(self, args: Any) -> bool:
        tensors = [t for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor)]
        return bool(tensors) and all(t in self.tensors for t in tensors)


class _Dispatch(TorchDispatchMode):
    def __init__(self, counts: StepCounts):
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        counts, host = self.counts, self.counts._host
        name = func._schema.name  # "aten::add_", "c10d::allreduce_"
        namespace, _, op = name.partition("::")
        from_host = host.all_host((args, kwargs))
        out = func(*args, **kwargs)
        counts.ops[name] += 1
        if namespace == "c10d":
            counts.collectives[name] += 1
        if op in COPY_OPS:
            counts.copies[name] += 1
        if op in SYNC_OPS:
            if from_host:
                counts.host_reads[name] += 1
            else:
                counts.syncs[f"{name} at {_where()}"] += 1
        if from_host:
            host.mark(out)
        return out


class _Function(TorchFunctionMode):
    """Sees the calls that dispatch nothing on the CPU: a `.to(device)` that returns its own
    tensor, a `.cpu()` of a CPU tensor, which on a GPU are a copy to the device and a sync."""

    def __init__(self, counts: StepCounts):
        super().__init__()
        self.counts = counts

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if args and isinstance(args[0], torch.Tensor):
            host, source = self.counts._host, args[0]
            if source in host.tensors:
                if name == "to" and _names_device(args[1:], kwargs):
                    host.unmark(out)  # now the device's, whatever the CPU returned
            elif name == "to" and kwargs.get("non_blocking") and _names_cpu(args[1:], kwargs):
                self.counts.copies["to(cpu, non_blocking=True)"] += 1  # read later, once arrived: no sync
                host.mark(out)
            elif name in _TO_HOST:  # a device tensor read by the host
                if kwargs.get("non_blocking"):
                    self.counts.copies["cpu(non_blocking=True)"] += 1
                else:  # tolist() reads the values without dispatching any op
                    self.counts.syncs[f"{name}() at {_where()}"] += 1
                host.mark(out)
        return out


def _names_cpu(args: tuple, kwargs: dict) -> bool:
    device = kwargs.get("device", next((a for a in args if isinstance(a, (torch.device, str))), None))
    return device is not None and torch.device(device).type == "cpu"


def _names_device(args: tuple, kwargs: dict) -> bool:
    return "device" in kwargs or any(isinstance(a, (torch.device, str, torch.Tensor)) for a in args)


class StepCounts:
    """`with StepCounts() as counts: step(...)`: every aten op dispatched inside, by name;
    the host syncs, by op and by the line that asked; copies and casts; collectives.

    `counts.host(batch)` first marks the loader's tensors as the host's (module docstring).
    """

    def __init__(self) -> None:
        self.ops: Counter[str] = Counter()
        self.syncs: Counter[str] = Counter()
        self.host_reads: Counter[str] = Counter()
        self.copies: Counter[str] = Counter()
        self.collectives: Counter[str] = Counter()
        self._host = _Host()
        self._modes: tuple[_Function, _Dispatch] | None = None

    def host(self, tensors: Any) -> None:
        self._host.mark(tensors)

    def __enter__(self) -> StepCounts:
        self._modes = (_Function(self), _Dispatch(self))
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._modes is not None
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        self._modes = None

    def take(self) -> dict[str, Any]:
        """`as_dict()` of what was counted since the last take, and a fresh count: a run counted
        step by step, in which what one step hands the next (a copy on its way to the host)
        is known for what it is."""
        taken = self.as_dict()
        for counter in (self.ops, self.syncs, self.host_reads, self.copies, self.collectives):
            counter.clear()
        return taken

    def totals(self) -> dict[str, int]:
        return {"ops": sum(self.ops.values()), "syncs": sum(self.syncs.values()),
                "copies": sum(self.copies.values()), "collectives": sum(self.collectives.values()),
                "host_reads": sum(self.host_reads.values())}

    def as_dict(self) -> dict[str, Any]:
        return {**self.totals(), "by_op": dict(self.ops.most_common()), "sync_sites": dict(self.syncs),
                "copy_ops": dict(self.copies), "collective_ops": dict(self.collectives)}


class CompileCounts:
    """`with CompileCounts() as compiled: ...`: the graphs torch.compile made inside (each a
    compile, the first ones included: a recompile is any graph after a code's first) and the
    graph breaks it met, from torch._dynamo's own counters. Deterministic for the same code
    and shapes, as the op counts are."""

    def __init__(self) -> None:
        self.graphs = self.graph_breaks = 0

    @staticmethod
    def _now() -> tuple[int, int]:
        from torch._dynamo.utils import counters

        return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())

    def __enter__(self) -> CompileCounts:
        self._start = self._now()
        return self

    def __exit__(self, *exc: object) -> None:
        graphs, breaks = self._now()
        self.graphs, self.graph_breaks = graphs - self._start[0], breaks - self._start[1]
