"""Every random stream of this process, as a checkpoint saves and restores it.

At the same world size every rank gets its own streams back (a bitwise resume). At another,
ranks can't inherit streams one to one (which of two old ranks' dropout streams would one new
rank continue?), so each rank's are seeded from (seed, step, rank) instead: deterministic,
distinct per rank and step, and never a replay of the run's first steps.
"""

from __future__ import annotations

import random
from typing import cast

import numpy as np
import torch


class ProcessRNG:
    """This process's RNG streams (torch, CUDA, Python, NumPy) as a Stateful: tensors and plain
    lists, safe to load with weights_only."""

    def state_dict(self) -> dict:
        # The global legacy generator is MT19937, whose state is this tuple (never the dict form).
        np_state = cast("tuple[str, np.ndarray, int, int, float]", np.random.get_state())
        return {
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            "python": random.getstate(),
            "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]],
        }

    def load_state_dict(self, state: dict) -> None:
        torch.set_rng_state(state["torch"])
        if state["cuda"]:
            torch.cuda.set_rng_state_all(state["cuda"])
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
        name, keys, *rest = state["numpy"]
        np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))

    @staticmethod
    def reseed(seed: int, step: int, rank: int) -> None:
        """Every stream from (seed, step, rank), for a resume at another world size."""
        state = np.random.SeedSequence([seed, step, rank]).generate_state(2)
        torch_seed = int(state[0]) << 32 | int(state[1])
        torch.manual_seed(torch_seed)  # also every CUDA device's generator
        random.seed(torch_seed)
        np.random.seed(state)
