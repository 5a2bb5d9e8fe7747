"""Preemption in one process (no process group): a signal only sets the flag, and close()
gives the signal back to the handler it found."""

from __future__ import annotations

import signal

from trainer.faults.preemption import Preemption, received_signals
from trainer.runtime.environment import DistEnv


def test_a_signal_sets_the_flag_and_close_restores_the_previous_handler():
    calls = []

    def previous(signum, frame):
        calls.append(signum)

    before = signal.signal(signal.SIGUSR1, previous)
    try:
        preemption = Preemption(["SIGUSR1"], DistEnv())
        assert signal.getsignal(signal.SIGUSR1) == preemption._on_signal
        assert preemption.agreed() is None
        signal.raise_signal(signal.SIGUSR1)  # the handler runs before this call returns
        assert preemption.agreed() == "SIGUSR1"
        assert "SIGUSR1" in received_signals()
        assert calls == []  # only the flag: the previous handler waits for close()
        preemption.close(clean_exit=True)
        assert signal.getsignal(signal.SIGUSR1) is previous
        signal.raise_signal(signal.SIGUSR1)
        assert calls == [signal.SIGUSR1]
    finally:
        signal.signal(signal.SIGUSR1, before)
