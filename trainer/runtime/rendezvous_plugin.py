"""The torchrun plugin `--rdzv-backend=trainer-c10d`: torchrun's c10d rendezvous, explained.

Loaded into torchrun (not into the workers) through the `torchrun.handlers` entry point in
pyproject.toml. It behaves like c10d, with two differences:
- when a node never arrives, the timeout says where the others waited and how many came,
  instead of a bare `RendezvousTimeoutError` after ten silent minutes;
- each rendezvous round gets a fresh worker store (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1).
  With torchrun's shared one, workers it restarts can read their dead predecessors'
  addresses and fail again until --max-restarts runs out (docs/faults.md, "Elastic restarts").
  Every multi-node launcher (Slurm, compose, the tests) goes through this plugin, so this is
  the one place the switch is set.
"""

from __future__ import annotations

import os

from torch.distributed.elastic.rendezvous.api import RendezvousHandler, RendezvousTimeoutError


def c10d_handler_factory():
    """The `torchrun.handlers` entry point: returns the handler constructor."""
    return _create_explained_c10d_handler


def _create_explained_c10d_handler(params):
    # Read by the handler at each round (and inherited by the workers, whose doctor checks
    # it), so setting it here, before the first round, covers every restart.
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    backend, store = create_backend(params)
    return _ExplainedTimeouts(create_handler(store, backend, params), store, params)


class _ExplainedTimeouts(RendezvousHandler):
    """Delegates to torchrun's c10d handler; counts the nodes waiting in the store so that a
    timeout can say how many arrived (c10d's own state forgets them as they time out)."""

    def __init__(self, handler, store, params):
        self._handler, self._store, self._params = handler, store, params
        self._waiting_key = f"trainer-rdzv/{params.run_id}/waiting"

    def next_rendezvous(self):
        self._store.add(self._waiting_key, 1)
        try:
            return self._handler.next_rendezvous()
        except RendezvousTimeoutError as e:
            arrived = self._store.add(self._waiting_key, 0)
            join_timeout = self._params.get_as_int("join_timeout", 600)
            raise RendezvousTimeoutError(
                # Not the run id: slurm/ddp.sh's is a secret (slurm/README.md), and this goes to the log.
                f"rendezvous at {self._params.endpoint} timed out after "
                f"{join_timeout}s: {arrived} of {self._params.min_nodes} nodes arrived; check that every node "
                "was started, can reach this endpoint, and uses the same --rdzv-id"
            ) from e
        finally:
            self._store.add(self._waiting_key, -1)

    def get_backend(self) -> str:
        return "trainer-c10d"

    def is_closed(self) -> bool:
        return self._handler.is_closed()

    def set_closed(self) -> None:
        self._handler.set_closed()

    def num_nodes_waiting(self) -> int:
        return self._handler.num_nodes_waiting()

    def get_run_id(self) -> str:
        return self._handler.get_run_id()

    def shutdown(self) -> bool:
        return self._handler.shutdown()

    @property
    def use_agent_store(self) -> bool:
        return self._handler.use_agent_store
