"""A checkpoint's write on rank 0, in the caller's thread or in the background.

With checkpoint.async_save, training pauses only while the state is copied to host memory
(`host_copy`); a thread on rank 0 writes it, and every rank learns the write's outcome at the
next save or at the end (the Checkpointer's `finish`). A process that exits for any reason
finishes its write first: the thread is not a daemon.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch

from trainer.errors import describe


def host_copy(obj):
    """`obj` (a state dict, nested) with every tensor copied to host memory: the snapshot a
    background write reads while training changes the originals.

    Device tensors go through pinned memory without a sync each (one sync at the end);
    tensors that share storage (tied weights) stay shared, so safetensors still saves them
    once. CPU tensors are cloned: `.to("cpu")` would return the live tensor itself.
    """
    copies: dict[tuple, torch.Tensor] = {}

    def copy(value):
        if isinstance(value, torch.Tensor):
            key = (value.device, value.data_ptr(), value.dtype, tuple(value.shape), value.stride())
            if key not in copies:
                detached = value.detach()
                copies[key] = detached.clone() if detached.device.type == "cpu" else \
                    detached.to("cpu", non_blocking=True)
            return copies[key]
        if isinstance(value, dict):
            return {k: copy(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(copy(v) for v in value)
        return value

    copied = copy(obj)
    if any(device.type == "cuda" for device, *_ in copies):
        torch.cuda.synchronize()  # the non-blocking copies have landed
    return copied


class Write:
    """One checkpoint write on rank 0: `error` is "" until it fails, `seconds` its length."""

    def __init__(self, step: int):
        self.step, self.error, self.seconds = step, "", 0.0
        self._thread: threading.Thread | None = None

    def start(self, write: Callable[[], None], in_background: bool) -> Write:
        if in_background:
            # Not a daemon: an exiting interpreter finishes the write rather than tear it.
            self._thread = threading.Thread(target=self._run, args=(write,), name=f"checkpoint-step-{self.step}")
            self._thread.start()
        else:
            self._run(write)
        return self

    def failed(self, error: BaseException) -> Write:
        """A write that failed before it started (a host copy out of memory, say)."""
        self.error = describe(error)
        return self

    def _run(self, write: Callable[[], None]) -> None:
        started = time.perf_counter()
        try:
            write()
        except Exception as e:  # any failure must reach the other ranks, or they wait for it  # noqa: BLE001
            self.error = describe(e)
        self.seconds = time.perf_counter() - started

    def wait(self) -> str:
        """The error, or "" once the write is complete."""
        if self._thread is not None:
            self._thread.join()
        return self.error
