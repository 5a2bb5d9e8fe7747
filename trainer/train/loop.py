"""The Trainer: build everything from the config, then train() reads top to bottom."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch

from trainer.checkpoint import resume
from trainer.checkpoint.checkpointer import Checkpointer
from trainer.checkpoint.store import read_state
from trainer.config import loading
from trainer.config.schema import Config
from trainer.data import loaders, reading
from trainer.errors import describe
from trainer.exit_codes import Exit
from trainer.faults import inject, numerics, preemption, replicas, timeline, watchdog
from trainer.faults.attempts import Attempt
from trainer.model import lora, optim, packing, pretrained
from trainer.outputs import card, summary
from trainer.outputs.ending import Ending, write_outputs
from trainer.runtime import distributed
from trainer.runtime.environment import DistEnv
from trainer.runtime.startup import Prefetch, StartupClock
from trainer.strategies import registry
from trainer.tasks.registry import task_class
from trainer.train import build, evaluation, flops, metrics, tracking
from trainer.train.policy import Policy, Selection
from trainer.train.state import TrainState
from trainer.train.step import Tried

log = logging.getLogger(__name__)


@dataclass
class _Try:
    """A try of a step, as the host times it."""

    step: int
    epoch: int
    batches: list[dict]
    started: float
    ended: float


class _Tries:
    """The batches each try takes (those of an aborted try again), and the one try whose
    verdict is still on its way to the host."""

    def __init__(self, batches: Iterator[tuple[int, list[dict]]]):
        self._batches = batches
        self._again: _Try | None = None
        self._unread: _Try | None = None

    def next_batches(self) -> tuple[int, list[dict]]:
        again, self._again = self._again, None
        return (again.epoch, again.batches) if again is not None else next(self._batches)

    def again(self, aborted: _Try) -> None:
        self._again = aborted

    def defer(self, attempt: _Try) -> None:
        self._unread = attempt

    def take_unread(self) -> _Try | None:
        unread, self._unread = self._unread, None
        return unread


class Trainer:
    def __init__(self, cfg: Config, dist_env: DistEnv, device: torch.device, startup: StartupClock):
        self.cfg, self.dist_env, self.device, self.startup = cfg, dist_env, device, startup
        self.output_dir = Path(cfg.output_dir)
        self.strategy = registry.of(cfg)
        async_save = cfg.checkpoint.async_save
        self.checkpointer = Checkpointer(cfg.output_dir, cfg.checkpoint.keep, dist_env,
                                         async_save=device.type == "cuda" if async_save is None else async_save,
                                         checkpoint_format=self.strategy.checkpoint_format)
        # Decided first: a resume the config can't make is refused in seconds.
        self.resume_plan = resume.decide(cfg, dist_env, self.checkpointer)
        self.attempt = Attempt(self.output_dir, dist_env, cfg.fault.max_stalled_restarts,
                               fresh=cfg.checkpoint.resume == "never")
        # A job that keeps failing from this checkpoint stops here (exit 77), before any weights load.
        self.attempt.check(self.resume_plan.step)
        self.batch = self.resume_plan.batch
        """The global batch, split over this run's ranks."""

        # Checked first: a data mistake costs no model download. The ranks that wait for local
        # rank 0's data meanwhile import what the model needs.
        # A task of pairs reads its data with the tokenizer (pairs that truncation makes the same).
        tokenizer = build.tokenizer(cfg, dist_env) if task_class(cfg.data.problem_type).pairs else None
        with distributed.meanwhile(Prefetch(build.PREFETCHED)):
            splits = reading.load(cfg, dist_env, tokenizer=tokenizer)
        for warning in splits.warnings:
            log.warning("%s", warning)
        self.dropped_rows = splits.dropped
        """The rows data.drop_invalid_rows dropped, by split and kind: summary.json and the card say so."""
        self.labels = resume.labels_on_resume(self.resume_plan, splits.labels)
        """The label space (trainer/data/labels.py), resolved from the train split (on resume: the
        checkpoint's, which must agree)."""
        self.policy = Policy.from_config(cfg, splits.steps_per_epoch(self.batch, cfg.train))
        startup.mark("data")
        self.built = build.build(cfg, dist_env, device, self.labels, max_steps=self.policy.max_steps,
                                 strategy=self.strategy, tokenizer=tokenizer)
        """The model, the strategy that runs it on this rank, and the step."""
        self.model = self.built.model
        """The model that trains, unwrapped: checkpoints, evaluation and the export read it."""
        self.model_commit = pretrained.hub_commit(cfg.model)
        """The Hub commit model.name was loaded from (None: a local folder), for summary.json and the card."""
        self.train_step = self.built.step
        """One optimizer step (trainer/train/step.py), with the optimizer, LR schedule and loss scaler it steps."""
        self.parameter_counts = lora.parameter_counts(self.model)
        self.precisions = lora.precisions(self.model, self.built.amp_dtype)
        startup.mark("model")
        self.data = loaders.build(cfg, dist_env, splits, self.built.tokenizer, device, self.batch,
                                  packing.of_run(cfg.data, self.built.config))
        startup.mark("tokenize")
        self.selection = Selection.from_config(cfg)
        """The best checkpoint so far, and early stopping."""
        self.state = TrainState(self.batch, self.data, self.selection, dist_env, tracking.new_run_id(), self.labels,
                                numerics.BadSteps(cfg.fault.max_bad_steps))
        """Where the run is: step, data position, run id, selection, ..."""
        self.meter = metrics.Meter(dist_env, device, self.batch.global_batch, flops.FlopModel.of(self.model),
                                   self.policy.max_steps)
        self.tracker = tracking.Tracker(cfg, dist_env)
        self.first_step_end_unix: float | None = None
        inject.configure(dist_env)
        inject.into_step(self.train_step)
        self.preemption = preemption.Preemption(cfg.fault.preempt_signals, dist_env)
        self.watchdog = watchdog.Watchdog(cfg, dist_env, self.output_dir)
        self.timeline = timeline.Timeline(self.output_dir, dist_env)
        self.replicas = replicas.Replicas(self.model, self.train_step.optimizer, dist_env, cfg.fault.fingerprint_every,
                                          replicated=dist_env.world_size > 1 and not self.built.strategy.sharded)
        startup.mark("setup")

    # --- the run ----------------------------------------------------------------------

    def train(self) -> dict:
        start_step = self.restore()
        self.replicas.check_start()
        self.tracker.start(self.state.run_id, start_step)
        self._log_plan()
        self.meter.begin(start_step)
        self.watchdog.start()
        tries = _Tries(loaders.micro_batches(self.data, self.batch.grad_accum, self.state.batches_read))
        step = start_step
        while step < self.policy.max_steps and not self.selection.stop:
            attempt, tried = self._try(step + 1, tries)
            unread = tries.take_unread()
            if unread is not None:  # its verdict was read during this try (trainer/train/step.py)
                assert tried.previous is not None, "the step read the verdict it held"
                step = self._account(unread, tried.previous)
                if tried.aborted:  # the try before was bad: this one's batches go again
                    tries.again(attempt)
                    continue
            preempted_by = self._preemption(attempt.step)
            if preempted_by is None and self._may_defer(attempt.step):  # nothing between steps needs its verdict
                step = attempt.step
                tries.defer(attempt)
                continue
            outcome = tried.outcome if tried.outcome is not None else self.train_step.settle()
            assert outcome is not None, "the step's verdict is read"
            step = self._account(attempt, outcome)
            if outcome.taken:
                saved = self._between_steps(step, attempt.epoch)
                if preempted_by is not None and self.policy.stop_for_preemption(step, preempted_by):
                    self._stop(step, saved, preempted_by)
        assert tries.take_unread() is None, "the last step's verdict is read"
        return self._end_of_run(start_step, step)

    def _try(self, step: int, tries: _Tries) -> tuple[_Try, Tried]:
        """A try of `step`, on the next batches or those of an aborted try; its verdict is
        read now, or with the next try's."""
        started = time.time()
        self.watchdog.step_started(step)
        inject.point("step", step)
        self.meter.phase("data")
        epoch, batches = tries.next_batches()
        tried = self.train_step(batches, step, self.meter)
        self.watchdog.step_done()
        return _Try(step, epoch, batches, started, time.time()), tried

    def _may_defer(self, step: int) -> bool:
        """Whether the verdict of `step`'s try may wait for the next try: the step defers it
        (a fused AdamW decides on the device), and nothing between the steps needs it (no log,
        eval, save, replica check, fault, first or last step). The same answer on every
        rank, which must all run the same tries."""
        policy = self.policy
        between = policy.log(step) or policy.evaluate(step) or policy.save(step) or \
            self.replicas.due(step, saving=False) or inject.between_steps()
        return (self.train_step.pending is not None and self.first_step_end_unix is not None
                and step < policy.max_steps and not between)

    def _account(self, attempt: _Try, outcome: numerics.Outcome) -> int:
        """The host's account of a try once its verdict is read. Returns the step the run has
        done: the try's, or for a bad try the one before it or a rollback's checkpoint."""
        self.timeline.step(attempt.step, attempt.started, outcome.taken, attempt.ended)
        if outcome.bad or outcome.spike:
            done = self._bad_step(attempt.step, outcome)
            if not outcome.taken:
                return done
        inject.point("weights", attempt.step, model=self.model)
        self.state.step, self.state.epoch = attempt.step, attempt.epoch
        if self.first_step_end_unix is None:
            with self._phase("first-step", attempt.step):
                self._first_step_done()
        return attempt.step

    def _preemption(self, step: int) -> str | None:
        """The one place the ranks agree on a preemption signal: at every step boundary, the
        signal's name once any rank has one (trainer/faults/preemption.py)."""
        with self._phase("preemption", step):
            return self.preemption.agreed()

    def _stop(self, step: int, saved: bool, preempted_by: str) -> None:
        """Save `step` (unless it just was) and stop for a preemption: exit 75."""
        with self._phase("save", step):
            if not saved:
                self._compare_replicas(step, saving=True)
                self.save()
            self.checkpointer.finish()  # on disk, or every rank fails with why
        raise preemption.Preempted(step, preempted_by)

    def _bad_step(self, step: int, outcome: numerics.Outcome) -> int:
        """A try of `step` that was not finite (skipped on every rank alike) or a spike:
        logged with its batch's position. Returns the step the run has done: `step` for a
        spike it trained on, the one before for a skipped try, or a rollback's checkpoint."""
        batch = self.state.batches_read  # the batch just read (the count before it)
        where = loaders.batch_position(self.data, batch)
        self.tracker.record_bad_batch({"step": step, "why": outcome.bad or "loss spike", "loss": outcome.loss,
                                       "grad_norm": outcome.grad_norm, "batch": batch, **where})
        described = (f"batch {batch} (epoch {where['epoch']}, samples {where['samples_in_epoch'][0]}-"
                     f"{where['samples_in_epoch'][1] - 1} of its order)")
        roll_back = self.state.bad_steps.observe(step, outcome, described)
        if outcome.taken:
            return step
        self.state.skipped_batches += 1
        return self._roll_back(step) if roll_back else step - 1

    def _roll_back(self, failing: int) -> int:
        """Load the newest checkpoint, and go on from it with the batches after the ones read
        so far. Returns its step. The live count of bad steps stays: it decides the stop."""
        with self._phase("rollback", failing):
            self.checkpointer.finish()  # a write in flight may be the newest checkpoint
            path = resume.choose("auto", self.checkpointer.store, self.dist_env)
            if path is None:
                raise numerics.NonFiniteTraining(
                    f"step {failing} failed {self.cfg.fault.max_bad_steps} tries in a row, and there is no checkpoint "
                    "to roll back to: see bad-batches.jsonl in output_dir; lower train.lr or raise warmup, or save "
                    "earlier (checkpoint.every)")
            read, bad_steps = self.state.batches_read, self.state.bad_steps.state_dict()
            self.checkpointer.load(path, self.states, read_state(path), self.cfg.seed)
        self.state.bad_steps.load_state_dict(bad_steps)
        self.state.skipped_batches = read - self.state.step
        log.warning("rolled back from step %d to %s: going on with the batches after the bad ones (from batch %d)",
                    failing, path, read)
        self.tracker.forget_after(self.state.step)
        self.timeline.rollback(failing, self.state.step)
        self.tracker.log({"fault/rollbacks": self.state.bad_steps.rollbacks,
                          "fault/rolled_back_from": failing}, self.state.step)
        return self.state.step

    @contextmanager
    def _phase(self, name: str, step: int) -> Iterator[None]:
        """A phase between steps (a key of watchdog.PHASES): watched, since each enters
        collectives and a rank stuck in one is reported like a stuck step; and timed on the
        timeline (trainer/faults/timeline.py)."""
        with self.watchdog.phase(name, step), self.timeline.phase(name, step):
            yield

    def _between_steps(self, step: int, epoch: int) -> bool:
        """Log, evaluate and save as the policy says, each in a phase (`_phase`). Returns
        whether it saved."""
        watch = self._phase
        if self.policy.log(step):
            with watch("log", step):
                self._log(step, epoch)
        with self.meter.paused():  # eval and checkpoints count in no rate
            if self.policy.evaluate(step):
                with watch("eval", step):
                    self._validate(step)
            saved = self.policy.save(step)
            self._compare_replicas(step, saving=saved)
            if saved:
                with watch("save", step):
                    self.save()
        return saved

    def _compare_replicas(self, step: int, saving: bool) -> None:
        """Every fault.fingerprint_every steps, and before a checkpoint is written from them:
        a replica that drifted must not become the checkpoint every rank resumes from."""
        if self.replicas.due(step, saving):
            with self._phase("replicas", step):
                self.replicas.check(step)

    def _end_of_run(self, start_step: int, last: int) -> dict:
        """The last step (max_steps, or where early stopping stopped) is saved already;
        evaluate it, select the best, report the test split, export final/."""
        watch = self._phase
        totals = self.meter.run_totals()
        with watch("save", last):
            self.checkpointer.finish()  # the last checkpoint is on disk before anything reports done
        with watch("final-eval", last):
            evaluated = self.state.last_eval
            last_eval = evaluated[1] if evaluated and evaluated[0] == last else self._validate(last)
        final_step, final_eval = last, last_eval
        if self.cfg.checkpoint.load_best_at_end and self.selection.step not in (None, last):
            with watch("load-best", last):
                self.checkpointer.load_weights(self.selection.step, self.model)
            assert self.selection.eval is not None, "a selected step was evaluated"
            # Exact: the same weights, evaluated by the same exact evaluation, at that step.
            final_step, final_eval = self.selection.step, self.selection.eval
        test_eval = None
        if self.data.test_loader is not None:
            with watch("test-eval", last):
                test_eval = self.evaluate(self.data.test_loader, self.data.num_test)
            self.tracker.log(_prefixed("test", test_eval), last)
        facts = card.Facts(self.cfg, self.labels, final_step, final_eval, test_eval,
                           {"train": self.data.num_train, "validation": self.data.num_eval, "test": self.data.num_test},
                           self.dist_env.world_size, card.hardware(self.device.type), totals["train_seconds"] or 0.0,
                           self.model_commit, self.dropped_rows)
        made = self._summary(start_step, last, (final_step, final_eval), last_eval, test_eval, totals)
        ending = Ending(facts, self.model, self.built.tokenizer, self.built.strategy, made, self.built.task.scores)
        return write_outputs(self.cfg, self.dist_env, ending, lambda name: watch(name, last), self.tracker.summary)

    def evaluate(self, loader, num_samples: int) -> dict[str, float]:
        """Exact global metrics of the model as it is now, the same on every rank."""
        strategy = self.built.strategy
        return evaluation.evaluate(self.built.logits, loader, num_samples, self.built.task, self.device,
                                   self.dist_env, sharded=strategy.sharded,
                                   sdpa_backend=self.built.step.sdpa_backend).metrics

    def _validate(self, step: int) -> dict[str, float]:
        """Evaluate the validation split, log it, and let the selection see it."""
        results = self.evaluate(self.data.eval_loader, self.data.num_eval)
        self.tracker.log(_prefixed("eval", results), step)
        self.selection.observe(step, results)
        self.state.last_eval = (step, results)  # a resume at an evaluated step doesn't evaluate it twice
        if self.selection.stop and step < self.policy.max_steps:  # every rank says so: all stop here
            log.warning("early stopping at step %d: %d evaluations without an improvement of %s by more "
                        "than %g; best step %d", step, self.selection.patience, self.selection.metric,
                        self.selection.threshold, self.selection.step)
        return results

    # --- checkpoints ------------------------------------------------------------------

    def restore(self) -> int:
        """The step to continue after: the resume plan's checkpoint loaded into every
        stateful object, or 0 for a fresh run, which starts output_dir."""
        plan = self.resume_plan
        if plan.path is None:
            distributed.rank_zero_does(self.dist_env, f"output_dir: {self.output_dir}",
                                       lambda: tracking.start_output_dir(self.output_dir, loading.to_yaml(self.cfg)))
        else:
            assert plan.saved is not None, "a plan with a checkpoint has its saved state"
            self.checkpointer.load(plan.path, self.states, plan.saved, self.cfg.seed)
            if plan.accepted_changes:
                self.train_step.scheduler = optim.reconfigure(self.train_step.optimizer, self.cfg.train,
                                                              self.policy.max_steps, plan.step)
            resume.describe(plan, self.dist_env)
        if self.watchdog.nccl_dump is not None:  # torch writes its dump into this folder blindly
            Path(self.watchdog.nccl_dump).parent.mkdir(parents=True, exist_ok=True)
        # Recorded only now: a start refused for a mistake (exit 2) writes nothing.
        self.attempt.begin(plan.step, self.startup.launched)
        self.timeline.begin(fresh=self.cfg.checkpoint.resume == "never")
        return plan.step

    @property
    def states(self) -> dict:
        """What a checkpoint holds (trainer/checkpoint/checkpointer.py)."""
        return self.built.states(self.state)

    def save(self) -> None:
        numerics.check_weights(self.model, self.dist_env)  # a checkpoint is never of weights that are not finite
        started = time.perf_counter()
        self.checkpointer.save(self.state.step, self.states, loading.to_yaml(self.cfg), keep_also=self.selection.step)
        # What training paused for (every rank waits for rank 0's snapshot or write);
        # benchmarks/RESULTS.md puts it against the default checkpoint interval.
        self.tracker.log({"checkpoint/save_s": time.perf_counter() - started}, self.state.step)

    # --- ending ---------------------------------------------------------------------------

    def report_failure(self, error: BaseException) -> Exit:
        """What a failed step tells the user: the step, the error, every peer's state and
        this rank's stacks. Each rank reports for itself, so every local rank's stacks land
        in the log even when only one of them hit the timeout. Returns the exit code, and
        names the suspect nodes to the launcher on a node fault."""
        self.watchdog.report(f"step {self.watchdog.step} failed: {describe(error)}")
        return watchdog.judge(error, self.watchdog.silent_hosts)

    def close(self, exit_code: int) -> None:
        """On every exit path: nothing this rank started may outlive it, or hold its exit."""
        self.data.close()  # first: a worker left running (it blocks SIGTERM) would hold the exit forever
        self.checkpointer.close()
        self.watchdog.close()
        self.timeline.close()
        self.preemption.close(clean_exit=exit_code == 0)
        self.attempt.end(exit_code)
        self.tracker.close(exit_code)

    # --- what the run says ------------------------------------------------------------

    def _log_plan(self) -> None:
        cfg = self.cfg
        log.info(
            "training %s on %s (%s): world size %d, global batch %d (per rank %d x %d micro-batches), %d steps "
            "(%d per epoch), attention %s%s; trains %s",
            cfg.model.name, self.device, distributed.backend(self.dist_env), self.dist_env.world_size,
            self.batch.global_batch, self.batch.micro_batch, self.batch.grad_accum, self.policy.max_steps,
            self.data.steps_per_epoch,
            self.model.config._attn_implementation,
            ", activation checkpointing" if cfg.model.gradient_checkpointing else "",
            lora.describe(self.parameter_counts, self.precisions),
        )

    def _first_step_done(self) -> None:
        """The slow first step (allocation, compilation, cold caches) is over: from here on a
        stalled peer fails the job within dist.timeout_s."""
        distributed.set_timeout(self.dist_env, self.cfg.dist.timeout_s)
        self.watchdog.set_timeout(self.cfg.dist.timeout_s)
        self.first_step_end_unix = self.startup.mark("first_step")
        phases = self.startup.phases()
        log.info("launch to first step %.1fs: %s", sum(phases.values()),
                 ", ".join(f"{phase} {seconds:.2f}" for phase, seconds in phases.items()))
        # Here, not at start-up: a CPU's peak is measured (a matmul per precision), and the
        # first log is the first to need it. Only rank 0 logs MFU, so only rank 0 measures:
        # ranks measuring at once on one CPU would share its cores, each measure a fraction of
        # the peak, and pay the matmuls (~0.3 s a rank on AVX-512, more on AVX2) for nothing.
        if not self.dist_env.is_rank_zero:
            return
        with self.meter.paused():
            self.meter.peak, source = flops.peak_flops(self.device, self.built.amp_dtype, self.cfg.train.peak_tflops)
        log.info("MFU's peak: %s (%s)", "unknown" if self.meter.peak is None else f"{self.meter.peak:.3g} FLOP/s",
                 source)

    def _log(self, step: int, epoch: int) -> None:
        # A Tensor only for a Tensor lr; train.lr is a float.
        lr = cast(float, self.train_step.scheduler.get_last_lr()[0])
        window = self.meter.take_window(epoch, lr)
        if self.train_step.scaler.is_enabled():  # fp16: a falling scale means overflowing gradients, skipped steps
            window["loss_scale"] = self.train_step.scaler.get_scale()
        self.tracker.log(window, step)
        log.info("%s", self.meter.log_line(step, window))

    def _summary(self, start_step: int, last: int, final: tuple[int, dict], last_eval: dict,
                 test_eval: dict | None, totals: dict) -> dict:
        """summary.json as the run knows it (trainer/outputs/summary.py); the files and the
        hosts' names are `write_outputs`' to add."""
        return summary.make(
            final=final, last_eval=last_eval, test_eval=test_eval, best=self.selection.summary(),
            start_step=start_step, last=last, max_steps=self.policy.max_steps,
            steps_per_epoch=self.data.steps_per_epoch, world_size=self.dist_env.world_size,
            global_batch=self.batch.global_batch,
            run={"model": {"name": self.cfg.model.name, "revision": self.cfg.model.revision,
                           "commit": self.model_commit},
                 "labels": self.labels.state_dict(), "dropped_rows": self.dropped_rows, **self.parameter_counts,
                 "precision": self.precisions, **totals,
                 "first_step_end_unix": self.first_step_end_unix, "startup_s": self.startup.phases(),
                 "checkpoint_write_s": self.checkpointer.write_seconds,
                 "deterministic_kernels": torch.are_deterministic_algorithms_enabled(),
                 "bad_steps": self.state.bad_steps.summary(), "wandb_run_id": self.state.run_id})


def _prefixed(prefix: str, values: dict) -> dict:
    return {f"{prefix}/{k}": v for k, v in values.items()}
