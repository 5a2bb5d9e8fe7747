"""One job per output_dir (trainer/runtime/lease.py), with real runs: a second job on a folder that a
live job holds is refused on every rank before it reads or writes anything there, and a lease
whose holder died is taken over. The first job is held still deterministically, frozen by
TRAINER_FAULT_SIGSTOP as its step-4 save begins (step 2's checkpoint is written): the
checkpoint a second job would otherwise resume from."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import time

import psutil
from support.outputs import complete_steps, read_metrics, read_summary
from support.processes import kill_tree, wait_for
from support.runs import BASE_ENV, launch, snapshot, tiny_overrides, trainer_command

from trainer.exit_codes import Exit
from trainer.runtime.lease import FILE, Holder


def test_a_second_job_is_refused_while_the_first_holds_the_folder(tiny_model, reviews, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    # A dead holder first: its lease was last renewed an hour ago, on another host.
    dead = Holder(lease_id="dead0000", host="gone-node", pid=1, pid_ns=None, job="slurm job 1",
                  started=time.time() - 7200, renewed=time.time() - 3600)
    (out / FILE).write_text(json.dumps(dataclasses.asdict(dead)))
    overrides = tiny_overrides(tiny_model, reviews, out, **{
        "train.max_steps": 6, "checkpoint.every": 2,
        # Far above this test's length: A, frozen, renews nothing, and must still hold the folder.
        "fault.lease_timeout_s": 3600})
    log = tmp_path / "a.log"
    with log.open("w") as a_log:
        a = subprocess.Popen(trainer_command(overrides, nproc=None), stdout=a_log, stderr=subprocess.STDOUT,
                             start_new_session=True, env={**BASE_ENV, "TRAINER_FAULT_SIGSTOP": "0:save:4"})
    try:
        # A stops itself (SIGSTOP) as the save begins: a wait on that state, whose bound only a
        # hang reaches (a 6-step tiny run gets there in seconds, a minute on a loaded machine).
        wait_for(lambda: psutil.Process(a.pid).status() == psutil.STATUS_STOPPED, 300,
                 lambda: f"job A frozen at step 4's save; its log:\n{log.read_text()[-3000:]}", {"A": a})
        assert complete_steps(out) == [2]
        before = snapshot(out)

        b = launch(trainer_command(overrides, nproc=2), timeout=180)

        assert b.returncode == Exit.USAGE, b.output[-4000:]
        errors = [line for line in b.output.splitlines() if line.startswith("error:")]
        # Each rank raises rank 0's refusal; torchrun may end the other rank before it prints.
        assert len(errors) in (1, 2) and len(set(errors)) == 1, b.output[-4000:]
        assert re.fullmatch(
            rf"error: output_dir {out} is in use by another job \(host {re.escape(socket.gethostname())}, "
            rf"pid {a.pid}, started [-\d: ]+ UTC, renewed \d+s ago \(lease [0-9a-f]{{16}}\)\): wait for it to end, "
            rf"give this job another output_dir, or, if that job is surely dead, delete {out / FILE} \(a lease not "
            r"renewed for fault.lease_timeout_s=3600s is taken over\)", errors[0]), errors[0]
        assert "Traceback" not in b.output
        assert snapshot(out) == before  # B neither resumed from step 2 nor wrote anything

        os.kill(a.pid, signal.SIGCONT)
        assert a.wait(timeout=180) == 0, log.read_text()[-4000:]
    finally:
        kill_tree(a)
    a_output = log.read_text()
    took_over = re.search(r"WARNING trainer: output_dir .*: took over the lease of host gone-node, pid 1, slurm job 1, "
                          r"started .* \(lease dead0000\): not renewed for (\d+)s", a_output)
    assert took_over, a_output[-4000:]
    # Its age when A read it: past the timeout, and no older than it is now, however long A
    # took to start (not "36\d\d", which held only if A took the folder within 100 s).
    assert 3600 <= int(took_over[1]) <= time.time() - dead.renewed + 1, took_over[0]
    assert complete_steps(out) == [2, 4, 6]
    assert read_summary(out)["resumed_from_step"] == 0  # A's own run, from its start
    steps = [record["step"] for record in read_metrics(out) if "loss" in record]
    assert steps == sorted(set(steps)) and steps[-1] == 6, steps  # one writer: no step logged twice
    assert not (out / FILE).exists()  # released at the end
