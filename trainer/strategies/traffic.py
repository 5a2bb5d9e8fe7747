"""What one training step puts on the wire per rank, as doctor's forecast models it
(trainer/preflight/forecast.py): the gradient buckets, in the order backward fills them, each
with its bytes. A strategy that the forecast models says its own (`Strategy.traffic`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import nn

MIB = 1024**2


@dataclass(frozen=True)
class Bucket:
    nbytes: float
    """Bytes each rank puts in: all-reduced, or (sparse) all-gathered."""
    ready: float
    """The fraction of backward done when its last gradient is ready."""
    collectives: int = 1
    """All-reduces it takes one after another: PowerSGD's are three."""
    sparse: bool = False


@dataclass(frozen=True)
class Traffic:
    buckets: list[Bucket]
    overlapped: bool
    """Each all-reduce runs beside backward (DDP), or backward waits for it: PowerSGD on
    gloo runs its buckets one at a time (trainer/strategies/compression.py)."""

    @property
    def nbytes(self) -> float:
        return sum(b.nbytes for b in self.buckets)


@dataclass(frozen=True)
class Param:
    """What the traffic model needs of a parameter, in the model's definition order."""

    name: str
    shape: tuple[int, ...]
    element_size: int
    trained: bool
    lookup: bool
    """An embedding's table: a lookup does no matmul, and its gradient may go sparse."""
    input_embedding: bool = False

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @classmethod
    def all_of(cls, model: nn.Module) -> list[Param]:
        lookups = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
        get = getattr(model, "get_input_embeddings", None)
        embedding = get() if callable(get) else None
        source = embedding.weight if isinstance(embedding, nn.Embedding) else None
        return [cls(name, tuple(p.shape), p.element_size(), p.requires_grad, id(p) in lookups, p is source)
                for name, p in model.named_parameters()]


def ready_fractions(params: list[Param]) -> list[float]:
    """When backward has produced each parameter's gradient, as the fraction of backward's
    matmul work done by then. Backward visits the modules in reverse; a module's weight and
    bias are ready together, when its work, proportional to its weights, is done. Embedding
    lookups do no matmul: their rows are ready last."""
    def module(p: Param) -> str:
        return p.name.rsplit(".", 1)[0]

    work: dict[str, int] = {}
    for p in params:
        work[module(p)] = work.get(module(p), 0) + (0 if p.lookup else p.numel)
    total, done, finished = max(sum(work.values()), 1), 0, {}
    for name in reversed(work):
        done += work[name]
        finished[name] = done / total
    return [1.0 if p.lookup else finished[module(p)] for p in params]


def powersgd_elements(p: Param, rank: int) -> int:
    """Elements sent for one gradient: rank-`rank` factors P and Q where they are under half
    the matrix (torch's rule), else the gradient as it is; vectors as they are."""
    if len(p.shape) <= 1:
        return p.numel
    rows, cols = p.shape[0], p.numel // p.shape[0]
    return (rows + cols) * rank if (rows + cols) * rank * 2 < rows * cols else p.numel
