"""The Trainer: build everything from the config, then train() reads top to bottom."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from omegaconf import DictConfig
from torch.nn.parallel import DistributedDataParallel

from trainer import checkpoint, config, data, faults, model, perf, rendezvous, tracking
from trainer.rendezvous import DistEnv

log = logging.getLogger(__name__)


def resolve_precision(precision: str, device: torch.device) -> torch.dtype:
    """fp32, or bf16 autocast where the device runs bf16 matmuls natively."""
    if precision == "fp32":
        return torch.float32
    if precision == "bf16":
        return torch.bfloat16
    if device.type == "cuda":
        fast = torch.cuda.is_bf16_supported()
    else:  # AVX512-BF16 / AMX: bf16 matmuls ~2.5x fp32 (see benchmarks/RESULTS.md)
        fast = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return torch.bfloat16 if fast else torch.float32


def cpu_threads(dist_env: DistEnv, threads: int | None) -> int:
    """Intra-op threads: the CPUs this process may use, shared among the node's ranks."""
    return threads or max(1, len(os.sched_getaffinity(0)) // dist_env.local_world_size)


def fault_injection(dist_env: DistEnv) -> int | None:
    """`TRAINER_FAULT_SIGKILL=RANK:STEP`: that rank SIGKILLs itself as STEP begins.

    For fault-tolerance tests and drills: a real, unannounced process death at a chosen
    step, so kill-and-resume runs can be compared with uninterrupted ones point by point.
    Only in a launch's first attempt: workers that torchrun restarts must get past STEP.
    """
    spec = os.environ.get("TRAINER_FAULT_SIGKILL")
    if not spec or dist_env.restart_count > 0:
        return None
    rank, _, step = spec.partition(":")
    return int(step) if int(rank) == dist_env.rank else None


def confusion_metrics(confusion: torch.Tensor) -> dict[str, float]:
    """Accuracy and macro F1 from a [true, predicted] count matrix.

    Macro F1 averages over the classes present in the labels or the predictions, as
    scikit-learn's f1_score(average="macro") does.
    """
    confusion = confusion.double()
    true_pos = confusion.diag()
    support, predicted = confusion.sum(1), confusion.sum(0)
    present = (support + predicted) > 0
    f1 = 2 * true_pos / (support + predicted).clamp(min=1)
    return {
        "accuracy": (true_pos.sum() / confusion.sum().clamp(min=1)).item(),
        "f1_macro": f1[present].mean().item(),
    }


class Trainer:
    def __init__(self, cfg: DictConfig, dist_env: DistEnv, device: torch.device, startup: perf.StartupClock):
        self.cfg, self.dist_env, self.device, self.startup = cfg, dist_env, device, startup
        self.output_dir = Path(cfg.output_dir)
        if cfg.train.deterministic:
            rendezvous.use_deterministic_kernels()
        if device.type == "cpu":
            torch.set_num_threads(cpu_threads(dist_env, cfg.train.threads))
        self.amp_dtype = resolve_precision(cfg.train.precision, device)

        self.tokenizer = model.load_tokenizer(cfg.model)
        self.model = model.load_model(cfg.model, cfg.data.num_labels, cfg.seed, device)
        startup.mark("model")
        self.pin_memory = device.type == "cuda" and cfg.data.pin_memory
        self.data = data.build(cfg, dist_env, self.tokenizer, pin_memory=self.pin_memory)
        startup.mark("data")
        self.sparse_embedding = model.SparseEmbeddingGrad.maybe(self.model, cfg, device)
        self.train_model = model.wrap(self.model, cfg, dist_env, device)
        self.ddp = self.train_model if isinstance(self.train_model, DistributedDataParallel) else None
        if cfg.train.compile and isinstance(getattr(self.train_model, "_orig_mod", None), DistributedDataParallel):
            self.ddp = self.train_model._orig_mod
        self.comm_clock = perf.CommClock.attach(self.ddp) if self.ddp is not None else None

        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=cfg.train.lr, weight_decay=cfg.train.weight_decay,
            fused=cfg.train.fused_adamw,
        )
        from transformers import get_linear_schedule_with_warmup

        self.scheduler = get_linear_schedule_with_warmup(
            self.optimizer, round(cfg.train.warmup_ratio * cfg.train.max_steps), cfg.train.max_steps
        )
        async_save = cfg.checkpoint.async_save
        self.checkpointer = checkpoint.Checkpointer(
            cfg.output_dir, cfg.checkpoint.keep, dist_env,
            async_save=device.type == "cuda" if async_save is None else async_save,
        )
        self.flop_model = model.FlopModel.of(self.model)
        self.peak_flops, self.peak_source = perf.peak_flops(device, self.amp_dtype)
        self.global_batch = cfg.train.batch_size * cfg.train.grad_accum * dist_env.world_size
        self.timer = perf.PhaseTimer()
        self.tracker: tracking.Tracker | None = None
        self.run_id = ""
        self.kill_at_step = fault_injection(dist_env)
        self.preemption = faults.Preemption(cfg.fault.preempt_signals)
        self.watchdog = faults.Watchdog(cfg, dist_env, self.output_dir)
        startup.mark("setup")

    # --- the run ----------------------------------------------------------------------

    def train(self) -> dict:
        cfg = self.cfg
        start_step, self.run_id = self.resume()
        self.tracker = tracking.Tracker(cfg, self.dist_env, self.run_id, start_step)
        log.info(
            "training %s on %s (%s): world size %d, global batch %d, %d steps (%d per epoch), precision %s, "
            "attention %s, peak %.3g FLOP/s (%s)",
            cfg.model.name, self.device, dist.get_backend() if dist.is_initialized() else "no process group",
            self.dist_env.world_size, self.global_batch, cfg.train.max_steps, self.data.steps_per_epoch,
            str(self.amp_dtype).removeprefix("torch."), self.model.config._attn_implementation, self.peak_flops,
            self.peak_source,
        )
        steps = data.micro_batches(self.data, cfg.train.grad_accum, start_step)
        window = self._new_window()
        run_started, trained_samples, paused_s, first_step_end_unix = time.perf_counter(), 0, 0.0, None
        progress = self._progress(start_step)
        epoch = start_step // self.data.steps_per_epoch
        self.watchdog.start()
        for step in range(start_step + 1, cfg.train.max_steps + 1):
            if step == self.kill_at_step:
                os.kill(os.getpid(), signal.SIGKILL)
            self.watchdog.step_started(step)
            self.timer.start("data")
            epoch, batches = next(steps)
            self.train_step(batches, window)
            self.watchdog.step_done()
            if step == start_step + 1:
                # The slow first step (allocation, compilation, cold caches) is done: from
                # here on a stalled peer fails the job within dist.timeout_s.
                rendezvous.set_timeout(cfg.dist.timeout_s)
                self.watchdog.set_timeout(cfg.dist.timeout_s)
                first_step_end_unix = self.startup.mark("first_step")
                self._log_startup()
            trained_samples += self.global_batch
            progress.update(1)
            if step % cfg.train.log_every == 0 or step == cfg.train.max_steps:
                metrics = self._window_metrics(window, epoch)
                self.tracker.log(metrics, step)
                step_ms = ", ".join(f"{k.removeprefix('time/').removesuffix('_s')} {1000 * v:.0f}"
                                    for k, v in metrics.items() if k.startswith("time/"))
                log.info("step %d/%d loss %.4f lr %.3g | %.1f samples/s, %.0f tokens/s, MFU %.1f%% | ms/step: %s",
                         step, cfg.train.max_steps, metrics["loss"], metrics["lr"], metrics["samples_per_s"],
                         metrics["tokens_per_s"], 100 * metrics["mfu"], step_ms)
                window = self._new_window()
            # Eval and checkpoint time is kept out of the throughput figures.
            paused_started = time.perf_counter()
            if cfg.train.eval_every and step % cfg.train.eval_every == 0 and step < cfg.train.max_steps:
                self.tracker.log({f"eval/{k}": v for k, v in self.evaluate().items()}, step)
            saved = (cfg.checkpoint.every and step % cfg.checkpoint.every == 0) or step == cfg.train.max_steps
            if saved:
                self.save(step, epoch)
            preempted_by = self.preemption.agreed()
            if preempted_by and step < cfg.train.max_steps:
                if not saved:
                    self.save(step, epoch)
                self.checkpointer.finish()  # on disk, or every rank fails with why
                raise faults.Preempted(step, preempted_by)
            paused = time.perf_counter() - paused_started
            window["paused_s"] += paused
            paused_s += paused
        progress.close()
        train_seconds = time.perf_counter() - run_started - paused_s
        self.checkpointer.finish()  # the last checkpoint is on disk before anything reports done

        final_eval = self.evaluate()
        self.tracker.log({f"eval/{k}": v for k, v in final_eval.items()}, cfg.train.max_steps)
        self.export_final()
        summary = {
            "final_eval": final_eval,
            "steps": cfg.train.max_steps,
            "resumed_from_step": start_step,
            "epochs": round(cfg.train.max_steps / self.data.steps_per_epoch, 3),
            "world_size": self.dist_env.world_size,
            "global_batch": self.global_batch,
            "samples_per_s": trained_samples / train_seconds if trained_samples else None,
            "train_seconds": train_seconds,
            "first_step_end_unix": first_step_end_unix,
            "startup_s": self.startup.phases(),
            "checkpoint_write_s": self.checkpointer.write_seconds,
            "deterministic_kernels": torch.are_deterministic_algorithms_enabled(),
            "wandb_run_id": self.run_id,
            "hosts": self._hosts(),
        }
        self.tracker.summary(summary)
        log.info("done: accuracy %.4f, macro F1 %.4f", final_eval["accuracy"], final_eval["f1_macro"])
        return summary

    def train_step(self, batches: list[dict], window: dict) -> None:
        """One optimizer step over grad_accum micro-batches.

        Gradients are all-reduced only on the last micro-batch (no_sync on the others), so
        accumulation costs no extra communication, and the result equals one big batch.
        """
        grad_accum = len(batches)
        for i, batch in enumerate(batches):
            window["tokens"] += int(batch["attention_mask"].sum())
            window["sum_sq_len"] += int(batch["attention_mask"].sum(1).square().sum())
            batch = {k: v.to(self.device, non_blocking=self.pin_memory) for k, v in batch.items()}
            is_last = i == grad_accum - 1
            with (self.ddp.no_sync() if self.ddp is not None and not is_last else nullcontext()):
                self.timer.start("forward")
                with torch.autocast(self.device.type, dtype=self.amp_dtype,
                                    enabled=self.amp_dtype != torch.float32):
                    loss = self.train_model(**batch).loss.mean() / grad_accum  # mean: DataParallel
                self.timer.start("backward")
                loss.backward()
            if is_last and self.comm_clock is not None:
                self.timer.start("comm", at=self.comm_clock.take())  # from the last bucket on
            window["loss_sum"] += loss.detach()
        self.timer.start("optimizer")
        if self.sparse_embedding is not None:
            self.sparse_embedding.densify()
        if self.cfg.train.max_grad_norm > 0:
            window["grad_norm"] = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.train.max_grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.timer.stop()
        window["steps"] += 1

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Exact global metrics: each sample once, counts summed over ranks.

        Runs the bare model, not the DDP wrapper, so no rank enters a collective per batch
        (ranks may hold one eval batch more or less than others).
        """
        self.model.eval()
        num_labels = self.cfg.data.num_labels
        confusion = torch.zeros(num_labels, num_labels, dtype=torch.long, device=self.device)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        for batch in self.data.eval_loader:
            batch = {k: v.to(self.device, non_blocking=self.pin_memory) for k, v in batch.items()}
            labels = batch.pop("labels")
            with torch.autocast(self.device.type, dtype=self.amp_dtype, enabled=self.amp_dtype != torch.float32):
                logits = self.model(**batch).logits.float()
            loss_sum += F.cross_entropy(logits, labels, reduction="sum")
            confusion.index_put_((labels, logits.argmax(-1)), torch.ones_like(labels), accumulate=True)
        rendezvous.all_reduce_sum(confusion)
        rendezvous.all_reduce_sum(loss_sum)
        self.model.train()
        return {**confusion_metrics(confusion.cpu()), "loss": (loss_sum / self.data.num_eval).item()}

    # --- checkpoints ------------------------------------------------------------------

    def resume(self) -> tuple[int, str]:
        """(step to continue after, wandb run id): from the latest valid checkpoint, or fresh."""
        path = self.checkpointer.find_resume(self.cfg.checkpoint.resume)
        if path is None:
            if self.dist_env.is_rank_zero:
                self.output_dir.mkdir(parents=True, exist_ok=True)
                (self.output_dir / "config.yaml").write_text(config.to_yaml(self.cfg))
            return 0, tracking.new_run_id()
        state = self.checkpointer.load(path, self.model, self.optimizer, self.scheduler)
        log.info("resumed from %s (step %d, epoch %d)", path, state["step"], state["epoch"])
        return state["step"], state["wandb_run_id"]

    def save(self, step: int, epoch: int) -> None:
        state = {
            "step": step,
            "epoch": epoch,
            "step_in_epoch": step - epoch * self.data.steps_per_epoch,
            "samples_seen": step * self.global_batch,
            "world_size": self.dist_env.world_size,
            "global_batch": self.global_batch,
            "wandb_run_id": self.run_id,
        }
        started = time.perf_counter()
        self.checkpointer.save(step, self.model, self.optimizer, self.scheduler, state, config.to_yaml(self.cfg))
        # What training paused for (every rank waits for rank 0's write); benchmarks/RESULTS.md
        # puts it against the default checkpoint interval.
        self.tracker.log({"checkpoint/save_s": time.perf_counter() - started}, step)

    def export_final(self) -> None:
        """output_dir/final: save_pretrained model and tokenizer, loadable by plain transformers."""
        if not self.dist_env.is_rank_zero:
            return
        final, tmp = self.output_dir / "final", self.output_dir / ".final.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        self.model.save_pretrained(tmp)
        self.tokenizer.save_pretrained(tmp)
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)

    def report_failure(self, error: BaseException) -> None:
        """What a failed step tells the user: the step, the error, every peer's state and
        this rank's stacks. Each rank reports for itself, so every local rank's stacks land
        in the log even when only one of them hit the timeout."""
        first_line = (str(error).splitlines() or [""])[0]
        self.watchdog.report(f"step {self.watchdog.step} failed: {type(error).__name__}: {first_line}")

    def close(self, exit_code: int) -> None:
        self.checkpointer.close()
        self.watchdog.close()
        self.preemption.close(clean_exit=exit_code == 0)
        if self.tracker is not None:
            self.tracker.close(exit_code)

    # --- metrics ----------------------------------------------------------------------

    def _new_window(self) -> dict:
        return {
            "loss_sum": torch.zeros((), device=self.device), "steps": 0, "tokens": 0, "sum_sq_len": 0,
            "grad_norm": None, "started": time.perf_counter(), "paused_s": 0.0,
        }

    def _window_metrics(self, window: dict, epoch: int) -> dict:
        """Global metrics of a logging window: one all-reduce, the only host sync per window."""
        seconds = time.perf_counter() - window["started"] - window["paused_s"]
        totals = torch.tensor(
            [window["loss_sum"].item(), window["tokens"], window["sum_sq_len"]], dtype=torch.float64,
            device=self.device,
        )
        loss_sum, tokens, sum_sq_len = rendezvous.all_reduce_sum(totals).tolist()
        steps, world = window["steps"], self.dist_env.world_size
        flops = self.flop_model.train_flops(tokens, sum_sq_len)
        phases = self.timer.take()
        metrics = {
            "loss": loss_sum / (steps * world),  # mean over ranks of each step's mean loss
            "lr": self.scheduler.get_last_lr()[0],
            "epoch": epoch,
            "samples_per_s": steps * self.global_batch / seconds,
            "tokens_per_s": tokens / seconds,
            "mfu": flops / seconds / (self.peak_flops * world),
            **{f"time/{phase}_s": total / steps for phase, total in phases.items()},
        }
        if window["grad_norm"] is not None:
            metrics["grad_norm"] = window["grad_norm"].item()
        if self.device.type == "cuda":  # how full the GPU is: the batch size's headroom
            metrics["memory/peak_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        return metrics

    def _log_startup(self) -> None:
        phases = self.startup.phases()
        log.info("launch to first step %.1fs: %s", sum(phases.values()),
                 ", ".join(f"{phase} {seconds:.2f}" for phase, seconds in phases.items()))

    def _progress(self, start_step: int):
        """A progress bar on rank 0, on a terminal only: in a batch job's log file it would
        be one endless line; the per-log-step lines carry the progress there."""
        from tqdm import tqdm

        return tqdm(
            total=self.cfg.train.max_steps, initial=start_step, desc="train", unit="step",
            disable=not (self.dist_env.is_rank_zero and sys.stderr.isatty()), dynamic_ncols=True,
        )

    def _hosts(self) -> list[str]:
        import socket

        hostname = socket.gethostname()
        if not dist.is_initialized():
            return [hostname]
        hosts = [None] * self.dist_env.world_size
        dist.all_gather_object(hosts, hostname)
        return sorted(set(hosts))
