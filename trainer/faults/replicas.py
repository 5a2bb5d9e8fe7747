"""Replicas that drift apart: silent data corruption, found by comparing the ranks' state.

DDP keeps its replicas equal only by construction: every rank applies the same all-reduced
gradients to the same weights and optimizer state. What the all-reduce spreads (a gradient
computed wrong) reaches every replica alike, and this cannot see it; but a GPU that computes
one rank's optimizer step wrong, or a bit flipped in one rank's memory between steps, makes
that replica drift, and nothing fails: the job trains on, and saves (from rank 0, whose
replica may be the bad one) a model that is quietly worse, which every rank then resumes from.
So every `fault.fingerprint_every` steps, and before every checkpoint is written, each rank
takes a digest of its parameters and their optimizer state, and the ranks compare them. Exact
DDP keeps these bitwise equal, so any difference is a fault. The odd rank is the one outside
the majority (with 3 ranks or more), or both ranks (with 2); the job ends with the node-fault
exit (76), naming their hosts to the launcher, which requeues without them
(slurm/requeue.py). Ranks that differ before the first step loaded different files: that
is the setup's fault, not a node's, and the start says so.

Under FSDP each rank holds other shards by design: nothing there is replicated to compare,
and this check is off (docs/faults.md).
"""

from __future__ import annotations

import socket
from collections import Counter
from dataclasses import dataclass

import torch
from torch import nn

from trainer.errors import LaunchError
from trainer.runtime import distributed
from trainer.runtime.environment import DistEnv

_INTS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
"""The integer type a tensor's bits are read as, by element size."""


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's elements, flattened, their bits read as integers of their size."""
    return tensor.view(-1).view(_INTS[tensor.element_size()])


def replicated_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[tuple[str, torch.Tensor]]:
    """What DDP keeps equal on every rank, by name: each parameter, then its optimizer state
    (AdamW's step and moments, once a step has made them)."""
    named: list[tuple[str, torch.Tensor]] = []
    for name, parameter in model.named_parameters():
        named.append((name, parameter))
        named += [(f"{name} ({key})", value) for key, value in optimizer.state.get(parameter, {}).items()
                  if isinstance(value, torch.Tensor)]
    return named


def digest(tensors: list[torch.Tensor]) -> list[int]:
    """Per tensor: the sum of its elements' bits read as integers.

    Exact and cheap: one read of each tensor, on its device, and one copy to the host per
    device (AdamW keeps its step counts on the host). Any change to one element (a flipped
    bit among them) changes its tensor's sum; it is not a cryptographic hash, and a
    permutation of the elements goes unseen, which no hardware fault makes.
    """
    with torch.no_grad():
        sums = [bits(t.detach().contiguous()).sum(dtype=torch.int64) for t in tensors]
    by_device: dict[torch.device, list[int]] = {}
    for index, total in enumerate(sums):
        by_device.setdefault(total.device, []).append(index)
    values = [0] * len(sums)
    for indices in by_device.values():
        for index, value in zip(indices, torch.stack([sums[i] for i in indices]).tolist(), strict=True):
            values[index] = value
    return values


def odd_ranks(digests: list[list[int]]) -> list[int]:
    """The ranks whose digest is not the majority's: none when all agree; with 2 ranks, or
    no strict majority, every rank, since none can be told apart."""
    counts = Counter(tuple(d) for d in digests)
    if len(counts) == 1:
        return []
    common, count = counts.most_common(1)[0]
    if 2 * count <= len(digests):
        return list(range(len(digests)))
    return [rank for rank, d in enumerate(digests) if tuple(d) != common]


class ReplicasDiverged(RuntimeError):
    """The ranks' state differs after training began: exit 76, with `hosts` named to the
    launcher."""

    def __init__(self, message: str, hosts: list[str]):
        super().__init__(message)
        self.hosts = hosts


@dataclass
class Replicas:
    """Compares the ranks' replicas of `model` and `optimizer` (see the module's docstring)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    dist_env: DistEnv
    every: int
    """fault.fingerprint_every: 0, never."""
    replicated: bool
    """The ranks hold the same weights: not under FSDP, and more than one rank."""

    @property
    def on(self) -> bool:
        return self.replicated and self.every > 0

    def due(self, step: int, saving: bool) -> bool:
        """Every `every` steps, and before each checkpoint is written."""
        return self.on and (saving or step % self.every == 0)

    def check_start(self) -> None:
        """Before the first step: ranks that differ now loaded different files (a node with
        another revision of model.name, say). One line on every rank, exit 2."""
        if self.on and (found := self._compare()) is not None:
            which, _ = found
            raise LaunchError(f"the ranks start from different weights: {which}. Every node must load the same "
                              "model.name (the same files, the same revision) and the same checkpoint")

    def check(self, step: int) -> None:
        """Raise ReplicasDiverged on every rank, naming the odd ranks, if their state differs."""
        if (found := self._compare()) is not None:
            which, suspects = found
            raise ReplicasDiverged(
                f"the replicas diverged by step {step}: {which}. Exact DDP keeps them bitwise equal: most likely "
                f"silent data corruption (an optimizer step computed wrong, a flipped bit in memory) on "
                f"{', '.join(suspects)}", suspects)

    def _compare(self) -> tuple[str, list[str]] | None:
        """None if every rank holds the same state; else what differs, where, and the hosts
        of the odd ranks. The same answer on every rank: it is taken from what all gathered."""
        named = replicated_state(self.model, self.optimizer)
        everyone = distributed.all_gather(self.dist_env, (digest([t for _, t in named]), socket.gethostname()))
        digests, hosts = [d for d, _ in everyone], [host for _, host in everyone]
        odd = odd_ranks(digests)
        if not odd:
            return None
        names = [name for name, _ in named]
        majority = [rank for rank in range(len(digests)) if rank not in odd]
        if majority:
            reference = digests[majority[0]]
            which = "; ".join(f"rank {rank} on {hosts[rank]} ({_differences(digests[rank], reference, names)})"
                              for rank in odd)
            others = f"ranks {_listed(majority)}" if len(majority) <= 4 else f"the other {len(majority)} ranks"
            which += f" {'holds' if len(odd) == 1 else 'hold'} another state than {others}"
        else:
            other = next(rank for rank in odd if digests[rank] != digests[0])
            which = (f"ranks {_listed(odd)} on {', '.join(sorted(set(hosts)))} hold {len(set(map(tuple, digests)))} "
                     f"different states, none held by a majority (rank 0 and rank {other}: "
                     f"{_differences(digests[0], digests[other], names)})")
        return which, sorted({hosts[rank] for rank in odd})


def _differences(mine: list[int], reference: list[int], names: list[str]) -> str:
    differing = [name for name, a, b in zip(names, mine, reference, strict=True) if a != b]
    return f"{len(differing)} of {len(names)} tensors differ, the first {differing[0]}"


def _listed(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))
