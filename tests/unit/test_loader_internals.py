"""The DataLoader internals that trainer.data.loaders.stop_workers relies on, held against the
installed torch: if torch renames one, this fails naming it, instead of a run's workers
quietly outliving it (see Data.close)."""

from __future__ import annotations

import multiprocessing

import pytest
from torch.utils.data import DataLoader

from trainer.data.loaders import stop_workers


@pytest.fixture
def no_leftover_children():
    """Whatever this test forks ends with it, even when stop_workers fails to end it."""
    before = {child.pid for child in multiprocessing.active_children()}
    yield before
    for child in multiprocessing.active_children():
        if child.pid not in before:
            child.kill()
            child.join()


def test_stop_workers_finds_and_ends_a_persistent_worker(no_leftover_children):
    loader = DataLoader(list(range(8)), batch_size=2, num_workers=1, persistent_workers=True)
    assert next(iter(loader)).tolist() == [0, 1]
    forked = [c for c in multiprocessing.active_children() if c.pid not in no_leftover_children]
    assert len(forked) == 1, forked

    iterator = getattr(loader, "_iterator", None)
    assert iterator is not None, (
        "torch renamed DataLoader._iterator (where a persistent-workers loader keeps its iterator): "
        "trainer.data.loaders.stop_workers would find no workers to stop")
    assert hasattr(iterator, "_workers"), (
        f"torch renamed {type(iterator).__name__}._workers (the worker processes): "
        "trainer.data.loaders.stop_workers would find no workers to stop")
    assert callable(getattr(iterator, "_shutdown_workers", None)), (
        f"torch renamed {type(iterator).__name__}._shutdown_workers: trainer.data.loaders.stop_workers cannot end "
        "the workers")

    workers = stop_workers(loader)
    assert [w.pid for w in workers] == [forked[0].pid], "stop_workers did not find the loader's worker"
    assert not forked[0].is_alive(), "stop_workers left the worker running"
    assert forked[0].exitcode == 0, (
        f"the worker ended with {forked[0].exitcode}, not by _shutdown_workers' request")
    assert loader._iterator is None, "stop_workers left the loader holding its stopped iterator"


def test_stop_workers_without_workers_to_stop():
    assert stop_workers(None) == []
    never_iterated = DataLoader(list(range(8)), batch_size=2, num_workers=1, persistent_workers=True)
    assert stop_workers(never_iterated) == []
    in_process = DataLoader(list(range(8)), batch_size=2)
    next(iter(in_process))
    assert stop_workers(in_process) == []
