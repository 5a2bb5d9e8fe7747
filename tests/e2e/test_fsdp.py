"""FSDP2 (train.strategy=fsdp) keeps every guarantee of DDP: 2 sharded ranks end with the
weights of 1 process, and of 2 DDP ranks, on the same global batches; evaluation is exact
with unequal shards; a SIGKILLed run resumes bitwise, and at another world size on the same
trajectory; final/ is a plain transformers model.
"""

import json
import re
import shutil
import signal
import subprocess

import psutil
import pytest
from support.outputs import model_card, read_summary
from support.processes import kill_tree, wait_for
from support.runs import (
    BASE_ENV,
    REPO,
    failure_output,
    kill_then_resume,
    launch,
    locally,
    run,
    tiny_overrides,
    together,
    train,
    train_together,
    trainer_command,
)
from support.weights import compare_weights, sharded_checkpoint, weights

from trainer.runtime.launch import torchrun_argv

STEPS = 14
FSDP = {"train.strategy": "fsdp", "train.max_steps": STEPS, "train.global_batch": 16, "checkpoint.every": 5,
        "ddp.sparse_embedding_grad": False, "train.eval_every": 7, "train.eval_batch_size": 101}
"""Evaluated with a batch of 101: the 203 validation rows split 102 and 101 over 2 ranks, 2
batches and 1. A sharded forward is a collective, so the rank with 1 must run a filler
forward, or the other waits for ever."""
LORA = {"model.lora.r": 4, "model.lora.alpha": 8, "model.lora.dropout": 0.0}
SHARDED = {**FSDP, "train.batch_size": 8}
"""2 ranks x 8: the run that the matches, damaged-shard and activation-checkpointing tests
each need uninterrupted, trained once a module (`sharded_run`)."""
PREEMPTIBLE = {**SHARDED, "train.max_steps": 40}
"""Long enough that a SIGTERM after checkpoint step-10 still lands mid-run; the SIGKILL and
SIGTERM tests both compare with its uninterrupted run on dropout_model (`dropout_run`)."""


@pytest.fixture(scope="module")
def sharded_run(reference_run, tiny_model):
    """tiny_model, SHARDED, to the end; `launched` is its Run (the output)."""
    return reference_run(locally(2), tiny_model, **SHARDED)


@pytest.fixture(scope="module")
def dropout_run(reference_run, dropout_model):
    """dropout_model, PREEMPTIBLE, to the end, checkpoints saved synchronously."""
    return reference_run(locally(2), dropout_model, **PREEMPTIBLE).run


def test_fsdp_matches_one_process_and_ddp_with_and_without_accumulation(sharded_run, tiny_model, reviews,
                                                                        tmp_path):
    """The 2 sharded ranks (sharded_run), with 2 micro-batches each, packed, and as 2 DDP ranks,
    end with the weights and scores of 1 process on the same global batches."""
    runs = {
        "single": ({"train.batch_size": 16}, None),
        "fsdp-accum": ({"train.batch_size": 4}, 2),  # 2 micro-batches: the reduce-scatter waits for the last
        "ddp": ({"train.batch_size": 8, "train.strategy": "ddp"}, 2),
        # data.packing: the root's own weights gathered around the packed forward too, and the
        # rank with fewer evaluation batches runs its filler forward unpacked
        "fsdp-packed": ({"train.batch_size": 8, "data.packing": True}, 2),
    }
    results = train_together(*((tiny_overrides(tiny_model, reviews, tmp_path / name, **{**FSDP, **options}), nproc)
                               for name, (options, nproc) in runs.items()))
    dirs = {"fsdp": sharded_run.run, **{name: tmp_path / name for name in runs}}
    for name, result in zip(["fsdp", *runs], [sharded_run.launched, *results], strict=True):
        assert "trains all 999,237 parameters, kept in fp32" in result.output, name
        assert ("samples laid end to end" in result.output) == (name == "fsdp-packed"), name
    single = dirs["single"]
    assert compare_weights(weights(tiny_model), weights(single, STEPS)).max_abs > 1e-3  # it trained
    for name in ("fsdp", "fsdp-accum", "ddp", "fsdp-packed"):
        # Packed, each sample's gradient comes of other shapes: equal within rounding, not bits.
        assert compare_weights(single, dirs[name], STEPS).max_abs <= (1e-5 if name == "fsdp-packed" else 1e-6), name
        scores, reference = read_summary(dirs[name])["final_eval"], read_summary(single)["final_eval"]
        assert {k: scores[k] for k in ("accuracy", "f1_macro")} == {k: reference[k] for k in ("accuracy", "f1_macro")}
        assert abs(scores["loss"] - reference["loss"]) <= 1e-5, name  # from weights within 1e-6
    assert compare_weights(dirs["ddp"], dirs["fsdp"], STEPS).max_abs <= 1e-6
    # final/, written shard by shard and merged by DCP's Hugging Face writer: plain
    # transformers loads it, with the last step's weights.
    from transformers import AutoModelForSequenceClassification

    final = AutoModelForSequenceClassification.from_pretrained(dirs["fsdp"] / "final").state_dict()
    last = weights(dirs["fsdp"], STEPS)
    assert not compare_weights(last, {name: final[name] for name in last}).differing
    # Each final/ has its model card, from the one export path: final/'s own validation results.
    for name, ranks in (("single", 1), ("fsdp", 2), ("ddp", 2)):
        card = model_card(dirs[name] / "final")
        final_eval = read_summary(dirs[name])["final_eval"]
        assert {r.metric_type: r.metric_value for r in card.data.eval_results} == \
            {k: v for k, v in final_eval.items() if k != "loss"}, name
        assert f"{ranks} rank(s) on CPU" in card.text and card.data.library_name == "transformers"


def test_fsdp_sigkill_then_resume_is_bitwise(dropout_run, dropout_model, reviews, tmp_path):
    """Dropout on, so a resume that lost any rank's RNG state is not bitwise: rank 1
    SIGKILLed at step 13, relaunched, ends as the uninterrupted run did, its AdamW moments
    included. The checkpoint is DCP's: each rank wrote its own shards, with async_save in a
    thread of its own while training went on (the GPU default; the uninterrupted run saved
    synchronously, as the resumes at another world size do)."""
    uninterrupted, resumed, last = dropout_run, tmp_path / "resumed", PREEMPTIBLE["train.max_steps"]
    overrides = tiny_overrides(dropout_model, reviews, resumed, **{**PREEMPTIBLE, "checkpoint.async_save": True})
    killed = launch(trainer_command(overrides, nproc=2), env={"TRAINER_FAULT_SIGKILL": "1:13"})
    assert killed.returncode != 0 and "SIGKILL" in killed.output, killed.output[-3000:]
    assert "saved " in killed.output and " (in the background)" in killed.output
    train(overrides)
    # A background write of step 10 is complete only once rank 1 has written its shards too:
    # killed before that, the run resumes from step 5 (on this machine, rank 1 is 3 steps on).
    assert read_summary(resumed)["resumed_from_step"] in (5, 10)
    assert not compare_weights(uninterrupted, resumed, last).differing
    import torch

    saved = [sharded_checkpoint(d / "checkpoints" / f"step-{last}")["optimizer"] for d in (uninterrupted, resumed)]
    assert sorted(saved[0]["state"]) == sorted(weights(resumed, last))  # every parameter, by name
    assert all(torch.equal(saved[0]["state"][n][k], saved[1]["state"][n][k])
               for n in saved[0]["state"] for k in ("exp_avg", "exp_avg_sq"))
    # Each rank wrote its own shard of the model and AdamW's state: about half each.
    shards = sorted((resumed / "checkpoints" / f"step-{last}" / "sharded").glob("*.distcp"))
    sizes = [f.stat().st_size for f in shards]
    assert len(sizes) == 2 and max(sizes) < 0.6 * sum(sizes), sizes


def test_fsdp_resumes_at_another_world_size_on_the_same_trajectory(tiny_model, reviews, tmp_path):
    """Saved by 2 sharded ranks, continued by 3 and by 1 process (DCP reshards on load): the
    same global batches (12, which 1, 2 and 3 divide), so the same weights within 1e-5."""
    options = {**FSDP, "train.global_batch": 12, "train.batch_size": 6}
    reference, killed_dir = tmp_path / "uninterrupted", tmp_path / "killed"
    # The uninterrupted run and the killed one at once: two independent launches. Each resume
    # continues a copy of what the killed run left, so that neither changes what the other finds.
    uninterrupted, killed = together(
        (trainer_command(tiny_overrides(tiny_model, reviews, reference, **options), 2), {}),
        (trainer_command(tiny_overrides(tiny_model, reviews, killed_dir, **options), 2),
         {"TRAINER_FAULT_SIGKILL": "0:12"}))
    assert uninterrupted.returncode == 0, failure_output(uninterrupted.output)
    assert killed.returncode != 0 and "SIGKILL" in killed.output, killed.output[-3000:]
    resumes = {3: 4, None: 12}  # nproc: batch_size, of the same global batch
    outs = {nproc: tmp_path / f"resumed-on-{nproc or 1}" for nproc in resumes}
    for out in outs.values():
        shutil.copytree(killed_dir, out)
    results = together(*((trainer_command([*tiny_overrides(tiny_model, reviews, outs[nproc], **options),
                                           f"train.batch_size={batch_size}"], nproc), {})
                         for nproc, batch_size in resumes.items()))
    for (nproc, out), resumed in zip(outs.items(), results, strict=True):
        assert resumed.returncode == 0, (nproc, failure_output(resumed.output))
        assert f"resumed from {out / 'checkpoints' / 'step-10'}" in resumed.output, resumed.output[-3000:]
        assert compare_weights(reference, out, STEPS).max_abs <= 1e-5, nproc
        assert json.loads((out / "checkpoints" / f"step-{STEPS}" / "state.json").read_text())["step"] == STEPS


def test_a_damaged_shard_is_skipped_and_evaluate_reads_a_sharded_checkpoint(sharded_run, tiny_model, reviews,
                                                                             tmp_path):
    """One byte of rank 1's shard flipped in the newest checkpoint: its marker's checksum
    names the file, the run resumes from the one before and ends bitwise as the uninterrupted
    run. `evaluate` of a sharded checkpoint (one model, whole, per rank) reports what the run
    reported for that step. Both on copies of sharded_run, which other tests read, at once."""
    uninterrupted, out, evaluated_run = sharded_run.run, tmp_path / "damaged", tmp_path / "evaluated"
    shutil.copytree(uninterrupted, out)
    shutil.copytree(uninterrupted, evaluated_run)
    shard = out / "checkpoints" / f"step-{STEPS}" / "sharded" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    checkpoint = evaluated_run / "checkpoints" / f"step-{STEPS}"
    resumed, evaluated = together(
        (trainer_command(tiny_overrides(tiny_model, reviews, out, **SHARDED), nproc=2), {}),
        (trainer_command([*tiny_overrides(tiny_model, reviews, evaluated_run, **SHARDED), f"checkpoint={checkpoint}"],
                         nproc=2, command="evaluate"), {}))
    assert resumed.returncode == 0, failure_output(resumed.output)
    assert (f"skipping checkpoint {out / 'checkpoints'}/step-{STEPS}: sharded/__1_0.distcp does not match its "
            "checksum") in resumed.output
    assert read_summary(out)["resumed_from_step"] == 10
    assert not compare_weights(uninterrupted, out, STEPS).differing

    assert evaluated.returncode == 0, evaluated.output[-3000:]
    assert json.loads((checkpoint / "eval-test.json").read_text())["accuracy"] == \
        read_summary(uninterrupted)["final_eval"]["accuracy"]


def test_a_rank_that_fails_or_freezes_inside_a_sharded_step_ends_every_rank(tiny_model, reviews, tmp_path):
    """FSDP's collectives run inside the forward and backward. A rank that raises at step 3
    ends the job; a rank frozen as step 8 begins (SIGSTOP, a test hook) leaves its peer in an
    all-gather, whose watchdog names the step and the silent rank before dist.timeout_s."""
    options = {**FSDP, "train.batch_size": 8, "train.max_steps": 100000, "checkpoint.every": 0,
               "train.eval_every": 0}
    raised = launch(trainer_command(tiny_overrides(tiny_model, reviews, tmp_path / "raised", **options), nproc=2),
                    env={"TRAINER_FAULT_RAISE": "1:3"}, timeout=180)
    assert raised.returncode != 0
    assert "InjectedFault: TRAINER_FAULT_RAISE: injected at step 3" in raised.output, raised.output[-4000:]

    # What is guaranteed is rank 0's report and exit. torchrun then takes 30 s to SIGKILL the
    # stopped rank, as it would a hung one, which this test does at once instead.
    timeout_s, log = 10, tmp_path / "frozen.log"
    with log.open("w") as sink:
        torchrun = subprocess.Popen(
            trainer_command(tiny_overrides(tiny_model, reviews, tmp_path / "frozen", **{
                **options, "dist.timeout_s": timeout_s, "fault.slow_step_min_s": 2, "fault.heartbeat_s": 1}),
                nproc=2), cwd=REPO, env={**BASE_ENV, "TRAINER_FAULT_SIGSTOP": "1:step:8"}, stdout=sink,
            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        def ranks() -> list[psutil.Process] | None:
            workers = psutil.Process(torchrun.pid).children()
            stopped = [w for w in workers if w.status() == psutil.STATUS_STOPPED]
            return workers if len(workers) == 2 and stopped else None

        workers = wait_for(ranks, 180, "rank 1 frozen as step 8 begins", {"torchrun": torchrun})
        (rank0,) = [w for w in workers if w.status() != psutil.STATUS_STOPPED]
        gone, _ = psutil.wait_procs([rank0], timeout=timeout_s + 60)
    finally:
        kill_tree(torchrun)
    output = log.read_text()
    assert gone, output[-5000:]  # rank 0 ended, on its own (not torchrun's child: no exit code here)
    assert re.search(r"rank 0 on \S+: step 8 failed: ", output), output[-5000:]
    reports = re.findall(r"rank 0 on \S+: stalled in train step at step 8: has run ([\d.]+)s", output)
    assert reports and float(reports[0]) < timeout_s, output[-5000:]
    assert re.search(r"rank 1 on \S+: NOT RESPONDING", output), output[-5000:]


def test_sigterm_saves_every_rank_s_shards_and_the_run_resumes_bitwise(dropout_run, dropout_model, reviews,
                                                                       tmp_path):
    """Preemption: SIGTERM to torchrun, which forwards it to its workers; they agree at a
    step boundary, save one sharded checkpoint together and exit 75. The workers are frozen
    while the signal is sent, so that it lands mid-run however fast this machine is."""
    options, uninterrupted, out = PREEMPTIBLE, dropout_run, tmp_path / "preempted"
    proc = subprocess.Popen(trainer_command(tiny_overrides(dropout_model, reviews, out, **options), nproc=2),
                            cwd=REPO, env=BASE_ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        wait_for(lambda: (out / "checkpoints" / "step-10" / "COMPLETE").is_file(), 120, "checkpoint step-10",
                 {"torchrun": proc})
        workers = psutil.Process(proc.pid).children()
        for worker in workers:
            worker.suspend()
        proc.send_signal(signal.SIGTERM)
        for worker in workers:
            worker.resume()
        output, _ = proc.communicate(timeout=120)
    finally:
        kill_tree(proc)
    saved = re.findall(r"preempted by (.+?): saved the checkpoint of step (\d+); exiting with 75", output)
    assert len(saved) >= 1 and len({step for _, step in saved}) == 1, output[-4000:]
    step = int(saved[0][1])
    assert 10 <= step < 40 and (out / "checkpoints" / f"step-{step}" / "sharded" / ".metadata").is_file()
    assert not (out / "summary.json").exists()
    train(tiny_overrides(dropout_model, reviews, out, **options))
    assert read_summary(out)["resumed_from_step"] == step
    assert not compare_weights(uninterrupted, out, 40).differing


def test_each_rank_holds_its_share_and_the_memory_plan_is_rank_zero_s(tiny_model, reviews, tmp_path):
    """3 ranks, so that most weights split unevenly: from each rank's local shards after a
    step, the weights, gradients and AdamW state summed over the ranks are the whole model's
    (nothing held twice), no rank holds more than rank 0, and the memory plan, from
    config.json on the meta device, equals rank 0's to the byte. With LoRA, the frozen base
    is sharded too, and only what trains has gradients. Full fine-tuning and LoRA are two
    cases of one launch (tests/support/fsdp_shards.py), each built, stepped and measured in turn."""
    cases = {"full": {**FSDP, "train.batch_size": 4}, "lora": {**FSDP, "train.batch_size": 4, **LORA}}
    args = [arg for case, options in cases.items()
            for arg in (f"case={case}", *tiny_overrides(tiny_model, reviews, tmp_path / case, **options))]
    result = run(torchrun_argv(3, ["tests/support/fsdp_shards.py", *args]), timeout=180)
    assert result.returncode == 0, result.output[-3000:]
    # Where its line starts: another rank's progress bar, written without a newline, may precede
    # it on the same line of the shared stdout (seen under CI's load).
    lines = [json.JSONDecoder().raw_decode(line, line.index('{"case"'))[0]
             for line in result.output.splitlines() if '{"case"' in line]
    for case in cases:
        lora = case == "lora"
        ranks = sorted((r for r in lines if r["case"] == case), key=lambda r: r["rank"])
        assert len(ranks) == 3, (case, result.output[-3000:])
        whole, buffers = ranks[0]["whole_weights"], ranks[0]["buffers"]
        assert sum(r["weights"] - buffers for r in ranks) == whole, case
        assert sum(r["gradients"] for r in ranks) == ranks[0]["whole_trained"], case
        assert (ranks[0]["whole_trained"] < whole / 100) == lora, case
        assert all(r[kind] <= ranks[0][kind] for r in ranks for kind in ("weights", "gradients", "optimizer")), case
        assert ranks[0]["weights"] - buffers < whole / 3 * 1.01, case  # 1/3, within the rows' rounding
        for kind in ("weights", "gradients", "optimizer"):
            assert ranks[0]["plan"][kind] == ranks[0][kind], (case, kind)


def test_activation_checkpointing_and_the_best_step_under_fsdp(sharded_run, tiny_model, reviews, tmp_path):
    """Activation checkpointing composes with FSDP and changes no weight (the plain run:
    sharded_run); with load_best_at_end the best step's sharded checkpoint is loaded back,
    and final/ holds it."""
    # "Best" is the highest loss here: the earlier evaluation (step 7, of 7 and 14), so that
    # the load is exercised. Every evaluation saves a checkpoint too, beside every 5 steps.
    plain, checkpointed = sharded_run.run, tmp_path / "checkpointed"
    recomputed = {**SHARDED, "model.gradient_checkpointing": True, "checkpoint.best_metric": "loss",
                  "checkpoint.best_mode": "max", "checkpoint.load_best_at_end": True}
    train(tiny_overrides(tiny_model, reviews, checkpointed, **recomputed))
    assert compare_weights(plain, checkpointed, STEPS).max_abs <= 1e-6
    summary = read_summary(checkpointed)
    best = summary["best"]["step"]
    assert best == 7 and summary["final_model_step"] == best and summary["steps"] == STEPS
    from transformers import AutoModelForSequenceClassification

    final = AutoModelForSequenceClassification.from_pretrained(checkpointed / "final").state_dict()
    saved = weights(checkpointed, best)
    assert not compare_weights(saved, {name: final[name] for name in saved}).differing


def test_lora_under_fsdp_matches_one_process_at_any_world_size_and_exports_merged(tiny_model, reviews, tmp_path):
    """LoRA's adapters and head train over a sharded frozen base: 2 sharded ranks end with
    the weights of 1 process; killed at step 13 and resumed by 1 process from the DCP
    checkpoint of step 10, the same trajectory. The checkpoint holds what trains alone, and
    final/ is the merged model, whose logits are the unsharded run's."""
    import torch
    from test_lora import adapter_logits, logits_without_peft_of

    options = {**FSDP, **LORA}
    single, ranks, elastic = tmp_path / "single", tmp_path / "ranks", tmp_path / "elastic"
    overrides = tiny_overrides(tiny_model, reviews, elastic, **{**options, "train.batch_size": 8})
    # The 1-process reference, the 2-rank run and a third killed at step 13, all at once.
    first, trained, killed = together(
        (trainer_command(tiny_overrides(tiny_model, reviews, single, **{**options, "train.strategy": "ddp",
                                                                        "train.batch_size": 16}), None), {}),
        (trainer_command(tiny_overrides(tiny_model, reviews, ranks, **{**options, "train.batch_size": 8,
                                                                       "checkpoint.export_adapter": True}), 2), {}),
        (trainer_command(overrides, nproc=2), {"TRAINER_FAULT_SIGKILL": "1:13"}))
    assert first.returncode == 0 and trained.returncode == 0, (first.output[-3000:], trained.output[-3000:])
    assert killed.returncode != 0 and "SIGKILL" in killed.output, killed.output[-3000:]
    assert "trains 1,189 of 1,000,261 parameters" in trained.output
    saved = weights(ranks, STEPS)
    assert sum(t.numel() for t in saved.values()) == 1189, sorted(saved)  # nothing of the frozen base
    assert max(float(t.abs().max()) for name, t in saved.items() if "lora_B" in name) > 1e-3  # it trained
    assert compare_weights(single, ranks, STEPS).max_abs <= 1e-6
    merged, unsharded = map(torch.tensor, logits_without_peft_of(ranks / "final", single / "final"))
    assert float((merged - unsharded).abs().max()) <= 1e-5
    assert float((merged - adapter_logits(tiny_model, ranks / "final" / "adapter")).abs().max()) <= 1e-5

    resumed = train([*overrides, "train.batch_size=16"], nproc=None)
    assert f"resumed from {elastic / 'checkpoints' / 'step-10'}" in resumed.output, resumed.output[-3000:]
    assert compare_weights(single, elastic, STEPS).max_abs <= 1e-5


def test_lora_under_fsdp_over_a_bf16_base_resumes_bitwise(dropout_model, reviews, tmp_path):
    """model.dtype=bf16 under FSDP: the sharded frozen base is bf16, what trains is fp32 (one
    dtype per FSDP unit's trained weights, as FSDP2 requires); rank 1 SIGKILLed at step 13
    resumes bitwise, adapters' dropout and AdamW moments included."""
    options = {**FSDP, **LORA, "model.lora.dropout": 0.1, "train.batch_size": 8, "model.dtype": "bf16",
               "train.precision": "bf16"}
    uninterrupted, resumed = tmp_path / "uninterrupted", tmp_path / "resumed"
    resumed_run = kill_then_resume(tiny_overrides(dropout_model, reviews, resumed, **options), resumed,
                                   {"TRAINER_FAULT_SIGKILL": "1:13"}, resumed_from=10,
                                   beside=((tiny_overrides(dropout_model, reviews, uninterrupted, **options), 2),))
    assert "kept in fp32, the frozen rest in bf16; computes in bf16" in resumed_run.output
    assert not compare_weights(uninterrupted, resumed, STEPS).differing
    import torch

    saved = [sharded_checkpoint(d / "checkpoints" / f"step-{STEPS}") for d in (uninterrupted, resumed)]
    assert {t.dtype for t in saved[1]["model"].values()} == {torch.float32}
    assert sorted(saved[0]["optimizer"]["state"]) == sorted(saved[1]["model"])  # adapters and head alone
    assert all(torch.equal(saved[0]["optimizer"]["state"][n][k], saved[1]["optimizer"]["state"][n][k])
               for n in saved[0]["optimizer"]["state"] for k in ("exp_avg", "exp_avg_sq"))
    assert read_summary(resumed)["precision"] == {"compute": "bf16", "trained": "fp32", "frozen": "bf16"}
