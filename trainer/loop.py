"""The Trainer: build everything from the config, then train() reads top to bottom."""

from __future__ import annotations

import logging
import shutil
import time
from contextlib import nullcontext
from pathlib import Path
from typing import cast

import torch
from omegaconf import DictConfig

from trainer import (
    attempts,
    checkpoint,
    config,
    data,
    distributed,
    errors,
    evaluation,
    flops,
    inject,
    lora,
    metrics,
    model,
    optim,
    parallel,
    preemption,
    resume,
    sharded,
    tracking,
    watchdog,
)
from trainer.distributed import DistEnv
from trainer.errors import CheckpointError, one_line
from trainer.exit_codes import Exit
from trainer.policy import Policy, Selection
from trainer.startup import StartupClock
from trainer.train_state import TrainState

log = logging.getLogger(__name__)


class Trainer:
    def __init__(self, cfg: DictConfig, dist_env: DistEnv, device: torch.device, startup: StartupClock):
        self.cfg, self.dist_env, self.device, self.startup = cfg, dist_env, device, startup
        self.output_dir = Path(cfg.output_dir)
        if cfg.train.deterministic:
            distributed.use_deterministic_kernels()
        if device.type == "cpu":
            torch.set_num_threads(distributed.cpu_threads(dist_env, cfg.train.threads))
        self.amp_dtype = distributed.resolve_precision(cfg.train.precision, device)
        frozen_dtype = lora.frozen_dtype(cfg.model, self.amp_dtype)
        async_save = cfg.checkpoint.async_save
        self.checkpointer = checkpoint.Checkpointer(
            cfg.output_dir, cfg.checkpoint.keep, dist_env,
            async_save=device.type == "cuda" if async_save is None else async_save,
            sharded=cfg.train.strategy == "fsdp",  # DCP: each rank its shards, even one process
        )
        # Decided first: a resume the config can't make is refused in seconds.
        self.resume_plan = resume.decide(cfg, dist_env, self.checkpointer)
        # A job that keeps failing from this checkpoint stops here (exit 77), before any weights load.
        distributed.rank_zero_does(dist_env, f"output_dir: {self.output_dir / attempts.FILE}", lambda: attempts.check(
            self.output_dir, self.resume_plan.step, cfg.fault.max_stalled_restarts, fresh=self.fresh_history))
        self.attempt_begun = False
        """Whether rank 0 recorded this attempt (trainer/attempts.py): once training starts."""
        self.batch = self.resume_plan.batch
        """The global batch, split over this run's ranks."""

        splits = data.load(cfg, dist_env)  # checked first: a data mistake costs no model download
        startup.mark("data")
        # One download per node: local rank 0 fetches a hub model into the HF cache (shared
        # by the node's ranks, or by every node on a PVC), the others then read it from there.
        with distributed.local_rank_zero_first(dist_env) if model.from_hub(cfg.model) else nullcontext():
            self.tokenizer = model.load_tokenizer(cfg.model)
            config = model.load_config(cfg.model, cfg.data.num_labels, device.type, self.tokenizer.pad_token_id)
            # Before the weights: for an 8B model a mistake costs seconds, not minutes.
            model.check_max_length(cfg.model, cfg.data.max_length, config, self.tokenizer)
            bare = model.load_model(cfg.model, config, cfg.seed, device, frozen_dtype)
        self.model = lora.apply(bare, cfg.model)
        """The model that trains, unwrapped (the transformers model, or peft's around it under
        LoRA): checkpoints, evaluation and the export read it."""
        if cfg.model.gradient_checkpointing:
            model.use_gradient_checkpointing(self.model)
        self.parameter_counts = lora.parameter_counts(self.model)
        self.precisions = lora.precisions(self.model, self.amp_dtype)
        self.model.train()  # from_pretrained returns it in eval mode: dropout would be off
        startup.mark("model")
        self.data = data.build(cfg, dist_env, splits, self.tokenizer, device, self.batch)
        model.set_label_names(self.model, self.data.label_names)
        startup.mark("tokenize")
        self.policy = Policy.from_config(cfg, self.data.steps_per_epoch)
        self.selection = Selection.from_config(cfg)
        """The best checkpoint so far, and early stopping."""
        self.parallel = parallel.Parallel(self.model, cfg, dist_env, device, self.amp_dtype)
        """The model as the training step runs it: DDP, DataParallel, compiled."""

        self.optimizer = optim.optimizer(self.model, cfg.train)
        max_steps = self.policy.max_steps  # given, or train.epochs' worth
        self.scheduler = optim.lr_schedule(self.optimizer, cfg.train, max_steps)
        # fp16 only: gradients too small for fp16 would flush to zero unless the loss is scaled
        # up first. A no-op (scale 1, an empty state) for fp32 and bf16.
        self.scaler = torch.amp.GradScaler(device.type, enabled=self.amp_dtype == torch.float16)
        self.state = TrainState(self.batch, self.data, self.selection, dist_env, tracking.new_run_id())
        """Where the run is: step, data position, run id, selection, ..."""
        self.meter = metrics.Meter(dist_env, device, self.batch.global_batch, flops.FlopModel.of(self.model),
                                   max_steps)
        self.tracker: tracking.Tracker | None = None
        self.first_step_end_unix: float | None = None
        inject.configure(dist_env)
        self.preemption = preemption.Preemption(cfg.fault.preempt_signals, dist_env)
        self.watchdog = watchdog.Watchdog(cfg, dist_env, self.output_dir)
        startup.mark("setup")

    # --- the run ----------------------------------------------------------------------

    def train(self) -> dict:
        start_step = self.restore()
        self.tracker = tracking.Tracker(self.cfg, self.dist_env, self.state.run_id, start_step)
        self._log_plan()
        steps = data.micro_batches(self.data, self.batch.grad_accum, start_step)
        self.meter.begin(start_step)
        self.watchdog.start()
        step = start_step
        while step < self.policy.max_steps and not self.selection.stop:
            step += 1
            self.watchdog.step_started(step)
            inject.point("step", step)
            self.meter.phase("data")
            epoch, batches = next(steps)
            self.train_step(batches)
            self.state.step, self.state.epoch = step, epoch
            self.watchdog.step_done()
            if step == start_step + 1:
                with self.watchdog.phase("first-step", step):
                    self._first_step_done()
            self._between_steps(step, epoch)
        return self._end_of_run(start_step, step)

    @property
    def _run_tracker(self) -> tracking.Tracker:
        """The tracker, which train() starts before anything is logged, evaluated or saved."""
        assert self.tracker is not None, "train() starts the tracker first"
        return self.tracker

    def _between_steps(self, step: int, epoch: int) -> None:
        """Log, evaluate, save and stop as the policy says. Each phase enters collectives,
        so each is watched: a rank stuck in one is reported like a stuck step."""
        watch = self.watchdog.phase
        if self.policy.log(step):
            with watch("log", step):
                self._log(step, epoch)
        with self.meter.paused():  # eval and checkpoints count in no rate
            if self.policy.evaluate(step):
                with watch("eval", step):
                    self._validate(step)
            saved = self.policy.save(step)
            if saved:
                with watch("save", step):
                    self.save()
            with watch("preemption", step):
                preempted_by = self.preemption.agreed()
            if preempted_by is not None and self.policy.stop_for_preemption(step, preempted_by):
                with watch("save", step):
                    if not saved:
                        self.save()
                    self.checkpointer.finish()  # on disk, or every rank fails with why
                raise preemption.Preempted(step, preempted_by)

    def _end_of_run(self, start_step: int, last: int) -> dict:
        """The last step (max_steps, or where early stopping stopped) is saved already;
        evaluate it, select the best, report the test split, export final/."""
        watch = self.watchdog.phase
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
            self._run_tracker.log(_prefixed("test", test_eval), last)
        with watch("export", last):
            self.export_final()
        with watch("gather", last):
            return self._summarize(start_step, last, (final_step, final_eval), last_eval, test_eval, totals)

    def train_step(self, batches: list[dict]) -> None:
        """One optimizer step over grad_accum micro-batches; the result equals one big batch."""
        grad_accum = len(batches)
        for i, batch in enumerate(batches):
            self.meter.micro_batch(batch["attention_mask"])
            batch = data.to_device(batch, self.device, self.data.train_loader)
            is_last = i == grad_accum - 1
            with self.parallel.sync_gradients(now=is_last):
                self.meter.phase("forward")
                loss = self.parallel.loss(batch) / grad_accum
                self.meter.phase("backward")
                self.scaler.scale(loss).backward()
            if is_last and self.parallel.comm_clock is not None:
                self.meter.phase("comm", at=self.parallel.comm_clock.take())  # from the last bucket on
            self.meter.loss(loss)
        self.meter.phase("optimizer")
        self.parallel.gradients_ready()
        inject.point("gradients", self.state.step + 1, model=self.model)  # the step in progress
        self.scaler.unscale_(self.optimizer)  # clip the true gradients, not the scaled ones
        grad_norm = None
        if self.cfg.train.max_grad_norm > 0:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.train.max_grad_norm)
        # With fp16, a step whose gradients overflowed is skipped and the scale halved; every
        # rank skips the same steps, because the all-reduced gradients are the same everywhere.
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.meter.step_done(grad_norm)

    def evaluate(self, loader, num_samples: int) -> dict[str, float]:
        """Exact global metrics of the model as it is now, the same on every rank."""
        return evaluation.evaluate(self.parallel.logits, loader, num_samples, self.cfg.data.num_labels,
                                   self.device, self.dist_env, sharded=self.parallel.fsdp).metrics

    def _validate(self, step: int) -> dict[str, float]:
        """Evaluate the validation split, log it, and let the selection see it."""
        results = self.evaluate(self.data.eval_loader, self.data.num_eval)
        self._run_tracker.log(_prefixed("eval", results), step)
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
            distributed.rank_zero_does(self.dist_env, f"output_dir: {self.output_dir}", self._start_output_dir)
        else:
            assert plan.saved is not None, "a plan with a checkpoint has its saved state"
            self.checkpointer.load(plan.path, self.states, plan.saved, self.cfg.seed)
            if plan.accepted_changes:
                self.scheduler = optim.reconfigure(self.optimizer, self.cfg.train, self.policy.max_steps, plan.step)
            resume.describe(plan, self.dist_env)
        if self.watchdog.nccl_dump is not None:  # torch writes its dump into this folder blindly
            Path(self.watchdog.nccl_dump).parent.mkdir(parents=True, exist_ok=True)
        # Recorded only now: a start refused for a mistake (exit 2) writes nothing.
        distributed.rank_zero_does(self.dist_env, f"output_dir: {self.output_dir / attempts.FILE}",
                                   lambda: attempts.begin(self.output_dir, plan.step, fresh=self.fresh_history))
        self.attempt_begun = True
        return plan.step

    @property
    def fresh_history(self) -> bool:
        """checkpoint.resume=never: the attempts of the runs before don't count."""
        return self.cfg.checkpoint.resume == "never"

    @property
    def states(self) -> dict:
        """What a checkpoint holds (checkpoint.Stateful)."""
        states = {"model": self.model, "optimizer": self.optimizer, "scheduler": self.scheduler,
                  "scaler": self.scaler, "train": self.state}
        if self.parallel.powersgd is not None:  # each rank's own: checkpoint.PER_RANK
            states["comm_hook"] = self.parallel.powersgd
        return states

    def _start_output_dir(self) -> None:
        errors.make_writable_dir(self.output_dir)
        (self.output_dir / "config.yaml").write_text(config.to_yaml(self.cfg))

    def save(self) -> None:
        started = time.perf_counter()
        self.checkpointer.save(self.state.step, self.states, config.to_yaml(self.cfg), keep_also=self.selection.step)
        # What training paused for (every rank waits for rank 0's snapshot or write);
        # benchmarks/RESULTS.md puts it against the default checkpoint interval.
        self._run_tracker.log({"checkpoint/save_s": time.perf_counter() - started}, self.state.step)

    def export_final(self) -> None:
        """output_dir/final: save_pretrained model (LoRA's adapters merged in) and tokenizer,
        loadable by plain transformers. Written by rank 0 (sharded, each rank writes its shards
        first); a failure stops every rank with the reason. The run's last use of the model:
        merging changes it in place."""
        final, tmp = self.output_dir / "final", self.output_dir / ".final.tmp"
        distributed.rank_zero_does(self.dist_env, f"output_dir: {tmp}", lambda: _fresh_folder(tmp))
        if self.cfg.checkpoint.export_adapter:  # only with model.lora (config.py checks)
            # First: merging consumes the adapters. Sharded, they are gathered (collective).
            adapter = sharded.trained_state(self.model) if self.parallel.fsdp else None
            distributed.rank_zero_does(self.dist_env, f"output_dir: {tmp / 'adapter'}",
                                       lambda: lora.save_adapter(self.model, tmp / "adapter", adapter))
        merged = lora.merged(self.model)
        if self.parallel.fsdp:  # every rank writes its shards of the weights
            try:
                sharded.export(tmp, merged)
            except sharded.ShardsError as e:  # e.g. a full disk on any rank: every rank fails with why
                raise CheckpointError(f"output_dir: {final}: export failed: {e}") from None

        def export() -> None:
            if self.parallel.fsdp:
                merged.config.architectures = [sharded.unsharded_class_name(merged)]
                merged.config.save_pretrained(tmp)
            else:
                merged.save_pretrained(tmp)
            self.tokenizer.save_pretrained(tmp)
            shutil.rmtree(final, ignore_errors=True)
            tmp.rename(final)

        distributed.rank_zero_does(self.dist_env, f"output_dir: {final}", export)

    # --- ending ---------------------------------------------------------------------------

    def report_failure(self, error: BaseException) -> Exit:
        """What a failed step tells the user: the step, the error, every peer's state and
        this rank's stacks. Each rank reports for itself, so every local rank's stacks land
        in the log even when only one of them hit the timeout. Returns the exit code, and
        names the suspect nodes to the launcher on a node fault."""
        self.watchdog.report(f"step {self.watchdog.step} failed: {type(error).__name__}: {one_line(error)}")
        return watchdog.judge(error, self.watchdog.silent_hosts)

    def close(self, exit_code: int) -> None:
        """On every exit path: nothing this rank started may outlive it, or hold its exit."""
        self.checkpointer.close()
        self.data.close()
        self.watchdog.close()
        self.preemption.close(clean_exit=exit_code == 0)
        if self.dist_env.is_rank_zero and self.attempt_begun:
            try:  # a full disk must not hide the exit code, nor skip the closing below
                attempts.end(self.output_dir, exit_code)
            except OSError as e:
                log.warning("attempt's end not recorded in %s: %s", self.output_dir / attempts.FILE, e)
        if self.tracker is not None:
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
        # first log is the first to need it.
        with self.meter.paused():
            self.meter.peak, source = flops.peak_flops(self.device, self.amp_dtype, self.cfg.train.peak_tflops)
        log.info("MFU's peak: %s (%s)", "unknown" if self.meter.peak is None else f"{self.meter.peak:.3g} FLOP/s",
                 source)

    def _log(self, step: int, epoch: int) -> None:
        lr = cast(float, self.scheduler.get_last_lr()[0])  # a Tensor only for a Tensor lr; train.lr is a float
        window = self.meter.take_window(epoch, lr)
        if self.scaler.is_enabled():  # fp16: a falling scale means overflowing gradients, skipped steps
            window["loss_scale"] = self.scaler.get_scale()
        self._run_tracker.log(window, step)
        log.info("%s", self.meter.log_line(step, window))

    def _summarize(self, start_step: int, last: int, final: tuple[int, dict], last_eval: dict,
                   test_eval: dict | None, totals: dict) -> dict:
        """summary.json: `final_eval` and `test_eval` score the model in final/, which with
        load_best_at_end is the best step's; `last_step_eval` is the last step's."""
        summary = {
            "final_model_step": final[0],
            "final_eval": final[1],
            "test_eval": test_eval,
            "last_step_eval": last_eval,
            "best": self.selection.summary(),
            "steps": last,
            "max_steps": self.policy.max_steps,
            "stopped_early": last < self.policy.max_steps,
            "resumed_from_step": start_step,
            "epochs": round(last / self.data.steps_per_epoch, 3),
            "world_size": self.dist_env.world_size,
            "global_batch": self.batch.global_batch,
            **self.parameter_counts,
            "precision": self.precisions,
            **totals,
            "first_step_end_unix": self.first_step_end_unix,
            "startup_s": self.startup.phases(),
            "checkpoint_write_s": self.checkpointer.write_seconds,
            "deterministic_kernels": torch.are_deterministic_algorithms_enabled(),
            "wandb_run_id": self.state.run_id,
            "hosts": sorted(set(distributed.all_gather(self.dist_env, _hostname()))),
        }
        self._run_tracker.summary(summary)
        log.info("%s", done_line(summary))
        return summary


def _fresh_folder(folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)


def done_line(summary: dict) -> str:
    """What the run ends with: how the model in final/ scores, and which step it is."""
    final_step, last = summary["final_model_step"], summary["steps"]
    which = "the last step" if final_step == last else f"the best by {summary['best']['metric']}"
    line = f"done: final/ holds step {final_step} ({which}): validation {_scores(summary['final_eval'])}"
    if summary["test_eval"] is not None:
        line += f", test {_scores(summary['test_eval'])}"
    if final_step != last:
        line += f"; the last step, {last}: validation {_scores(summary['last_step_eval'])}"
    return line


def _scores(metrics: dict) -> str:
    return f"accuracy {metrics['accuracy']:.4f}, macro F1 {metrics['f1_macro']:.4f}"


def _prefixed(prefix: str, values: dict) -> dict:
    return {f"{prefix}/{k}": v for k, v in values.items()}


def _hostname() -> str:
    import socket

    return socket.gethostname()
