"""`python -m trainer report RUN_DIR`: where a run's time went, across every attempt and restart.

attempts.jsonl says when each attempt was launched, which checkpoint it resumed from and how
it ended (trainer/faults/attempts.py); timeline.jsonl has each step try and each phase between
steps (trainer/faults/timeline.py). Added up, over the wall time from the first launch to the
last end:

- productive: steps whose work the final model keeps;
- start-up: launch to the attempt's first step (imports, rendezvous, loading, tokenizing);
- redone: steps a failure threw away (done after the checkpoint the next attempt resumed from,
  or undone by a rollback), and step tries skipped as not finite;
- checkpoints, evaluation: the pauses for them;
- waiting: between one attempt's end and the next one's launch (the scheduler's requeue);
- other: the rest (logging, the replica comparison, the export at the end, an attempt's
  last seconds after its last record).

goodput = productive / wall. The numbers go to RUN_DIR/goodput.json (and to summary.json as a
run ends), and a picture of the attempts to RUN_DIR/goodput.png.

Of a sweep's output_dir (`python -m trainer sweep`), the same for each of its runs, in its own
folder, and one line each; the sweep's goodput is their productive seconds over their wall
seconds, summed over the runs (runs side by side each count their own).
"""

from __future__ import annotations

import glob
import itertools
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from trainer import files
from trainer.errors import ConfigError
from trainer.exit_codes import MEANING, Exit
from trainer.faults import attempts, timeline

EVALUATION = ("eval", "final-eval", "test-eval", "load-best")
CHECKPOINT = ("save",)
REDONE = ("rollback",)
CATEGORIES = ("productive", "startup", "redone", "checkpoints", "evaluation", "waiting", "other")
PICTURE = "goodput.png"


@dataclass
class Attempt:
    """One attempt's account: Unix times for `launched` and `ended`, seconds by category."""

    resumed_from: int
    launched: float
    ended: float
    ended_how: str
    """exit_codes.MEANING's words for its exit, "killed" when it left none and was restarted
    (SIGKILL, the OOM killer, a lost node), or, for the last attempt, "no exit recorded: ..."."""
    exit: int | None
    first_step_s: float | None
    """Launch to the end of its first step."""
    trained: int
    """Steps it trained (tries skipped as not finite aside)."""
    redone: list[int]
    """Its steps that a later attempt, or a rollback, did again."""
    skipped_tries: int
    seconds: dict[str, float]


Span = tuple[str, float, float]
"""(category, start, end): a step try or a phase, as the account counted it."""


def account(run_dir: Path, ending: int | None = None) -> dict:
    """The goodput of the run in `run_dir`, across its attempts. `ending`: the exit code of
    the last attempt, which ends now (the run's summary is written as it ends). Without it, a
    last attempt that recorded no exit ends at its last record (it may be running still)."""
    return _goodput(run_dir, ending)[0]


def _goodput(run_dir: Path, ending: int | None) -> tuple[dict, list[list[Span]]]:
    """`account`'s report, and each attempt's spans, which the picture draws."""
    history = attempts.read(run_dir)
    if not history:
        raise ConfigError(f"report: {run_dir}: no {attempts.FILE}: not the output_dir of a run that trained")
    now = None
    if ending is not None and "exit" not in history[-1]:
        now = time.time()
        history[-1] = {**history[-1], "exit": ending, "ended": now}
    records: list[list[dict]] = [[] for _ in history]
    for record in timeline.read(run_dir):  # an attempt's records follow its start
        records[max((i for i, a in enumerate(history) if a["started"] <= record["t1"]), default=0)].append(record)
    last = len(history) - 1
    accounts, spans = zip(*(_account(attempt, own, None if i == last else history[i + 1]["resumed_from"],
                                      now if i == last else None)
                            for i, (attempt, own) in enumerate(zip(history, records, strict=True))), strict=True)
    for before, after in itertools.pairwise(accounts):
        after.seconds["waiting"] = max(0.0, after.launched - before.ended)
    wall = accounts[-1].ended - accounts[0].launched
    totals = {name: sum(a.seconds[name] for a in accounts) for name in CATEGORIES}
    return {"wall_s": wall, "goodput": totals["productive"] / wall if wall > 0 else None, "seconds": totals,
            "steps_kept": sum(a.trained - len(a.redone) for a in accounts),
            "steps_redone": sum(len(a.redone) for a in accounts),
            "restarts": len(accounts) - 1, "attempts": [asdict(a) for a in accounts]}, list(spans)


def _account(attempt: dict, own: list[dict], resumed_next: int | None,
             now: float | None) -> tuple[Attempt, list[Span]]:
    """One attempt's account from its records, and its spans; `now`: its end, when it is
    ending now."""
    tries = [r for r in own if "t0" in r and "phase" not in r]
    rollbacks = [r for r in own if "rollback" in r]
    exit_code = attempt.get("exit")
    launched = attempt.get("launched") or attempt["started"]
    ended = attempt.get("ended") or now or max((r["t1"] for r in own), default=attempt["started"])

    def redone(r: dict) -> bool:
        """Undone by a rollback later in this attempt, or after the checkpoint the next resumed from."""
        return any(rb["t1"] > r["t1"] and r["step"] > rb["rollback"] for rb in rollbacks) or \
            (resumed_next is not None and r["step"] > resumed_next)

    seconds = dict.fromkeys(CATEGORIES, 0.0)
    spans: list[Span] = [("startup", launched, tries[0]["t0"] if tries else ended)]
    trained, redone_steps = 0, []
    for r in own:
        if "phase" in r:
            spans.append((_kind(r["phase"]), r["t0"], r["t1"]))
        elif "t0" in r:  # a step try
            kept = r.get("taken", True) and not redone(r)
            spans.append(("productive" if kept else "redone", r["t0"], r["t1"]))
            if r.get("taken", True):
                trained += 1
                if not kept:
                    redone_steps.append(r["step"])
    for kind, t0, t1 in spans:
        seconds[kind] += t1 - t0
    seconds["other"] += max(0.0, ended - launched - sum(seconds.values()))
    if exit_code is not None:
        how = MEANING[Exit(exit_code)] if exit_code in {code.value for code in Exit} else f"exit {exit_code}"
    else:  # a kill leaves no exit; so does an attempt still running, the last one
        how = "killed" if resumed_next is not None else "no exit recorded: running, or killed"
    return Attempt(resumed_from=attempt["resumed_from"], launched=launched, ended=ended, ended_how=how,
                   exit=exit_code, first_step_s=tries[0]["t1"] - launched if tries else None, trained=trained,
                   redone=redone_steps, skipped_tries=len(tries) - trained, seconds=seconds), spans


def _kind(phase: str) -> str:
    """The category of a phase's time."""
    return "checkpoints" if phase in CHECKPOINT else "evaluation" if phase in EVALUATION else \
        "redone" if phase in REDONE else "other"


def describe(report: dict) -> str:
    """The report as a person reads it."""
    seconds, wall = report["seconds"], report["wall_s"]
    goodput = "unknown" if report["goodput"] is None else f"{100 * report['goodput']:.1f}%"
    lines = [(f"wall {_duration(wall)} over {len(report['attempts'])} attempts ({report['restarts']} restarts), "
              f"goodput {goodput}: {report['steps_kept']} steps kept, {report['steps_redone']} redone"),
             "  " + ", ".join(f"{name} {_duration(seconds[name])} ({100 * seconds[name] / wall:.1f}%)"
                              for name in CATEGORIES if wall > 0),
             f"  {'attempt':<8}{'launched':>10}{'resumed':>9}{'to step 1':>11}{'trained':>9}{'redone':>8}  ended"]
    start = report["attempts"][0]["launched"]
    for number, a in enumerate(report["attempts"], 1):
        first = "-" if a["first_step_s"] is None else _duration(a["first_step_s"])
        lines.append(f"  {number:<8}{'+' + _duration(a['launched'] - start):>10}{a['resumed_from']:>9}{first:>11}"
                     f"{a['trained']:>9}{len(a['redone']):>8}  {a['ended_how']}")
    return "\n".join(lines)


def _duration(seconds: float) -> str:
    minutes, secs = divmod(seconds, 60)
    hours, minutes = divmod(int(minutes), 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:04.1f}s" if minutes else f"{secs:.1f}s"


COLORS = {"startup": "#9e9e9e", "productive": "#2e7d32", "redone": "#c62828", "checkpoints": "#1565c0",
          "evaluation": "#ef6c00", "other": "#d7ccc8"}


def draw(run_dir: Path, path: Path, ending: int | None = None) -> dict:
    """The attempts as rows on one time axis, each span coloured by the category the account
    counted it in, each failure marked, to `path`; returns the report (`account`'s)."""
    import matplotlib

    matplotlib.use("Agg")  # no display on a cluster node
    import matplotlib.pyplot as plt

    report, spans = _goodput(run_dir, ending)
    start = report["attempts"][0]["launched"]
    fig, ax = plt.subplots(figsize=(10, 1 + 0.5 * len(report["attempts"])))
    for row, (a, own) in enumerate(zip(report["attempts"], spans, strict=True)):
        y = len(report["attempts"]) - row
        for kind, t0, t1 in own:
            ax.broken_barh([(t0 - start, max(t1 - t0, 1e-3))], (y - 0.3, 0.6), color=COLORS[kind])
        if a["exit"] not in (Exit.DONE, None) or a["ended_how"] == "killed":
            ax.plot(a["ended"] - start, y, marker="x", color="black", markersize=10)
            ax.annotate(a["ended_how"], (a["ended"] - start, y + 0.35), fontsize=8)
    ax.set_yticks(range(1, len(report["attempts"]) + 1),
                  [f"attempt {len(report['attempts']) - i}" for i in range(len(report["attempts"]))])
    ax.set_xlabel("seconds since the first launch")
    goodput = report["goodput"]
    ax.set_title(f"{run_dir.name}: goodput {'unknown' if goodput is None else f'{100 * goodput:.1f}%'}")
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=c, label=k) for k, c in COLORS.items()],
              loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=len(COLORS), fontsize=8, frameon=False)
    fig.tight_layout()
    files.write_figure(fig, path, dpi=100)
    plt.close(fig)
    return report


def write(run_dir: Path) -> dict:
    """The report of `run_dir`, written as goodput.json and goodput.png in it."""
    report = draw(run_dir, run_dir / PICTURE)
    files.write_text(run_dir / "goodput.json", json.dumps(report, indent=2) + "\n")
    return report


def run(run_dir: Path) -> dict:
    """The report of `run_dir`: printed, and written as goodput.json and goodput.png in it."""
    if not run_dir.is_dir():
        raise ConfigError(f"report: {run_dir}: no such folder (give a run's output_dir)")
    report = write(run_dir)
    print(describe(report))
    print(f"  {run_dir / 'goodput.json'}, {run_dir / PICTURE}")
    return report


def run_sweep(sweep_dir: Path, run_dirs: list[Path]) -> dict:
    """The report of a sweep's output_dir: each run's, written in its folder (`write`), a line
    each; and the sweep's, printed and written as sweep_dir/goodput.json."""
    each: dict[str, dict | None] = {}
    for folder in run_dirs:
        if not (folder / attempts.FILE).is_file():
            each[folder.name] = None  # not started yet
            continue
        report = write(folder)
        each[folder.name] = {k: report[k] for k in ("wall_s", "goodput", "restarts", "steps_kept", "steps_redone")} \
            | {"productive_s": report["seconds"]["productive"]}
    started = [r for r in each.values() if r is not None]
    wall = sum(r["wall_s"] for r in started)
    productive = sum(r["productive_s"] for r in started)
    sweep = {"runs": each, "run_wall_s": wall, "goodput": productive / wall if wall > 0 else None}
    files.write_text(sweep_dir / "goodput.json", json.dumps(sweep, indent=2) + "\n")
    goodput = "unknown" if sweep["goodput"] is None else f"{100 * sweep['goodput']:.1f}%"
    print(f"sweep of {len(each)} runs ({len(started)} started): {_duration(wall)} of run wall time, goodput {goodput}")
    print(f"  {'run':<24}{'wall':>9}{'goodput':>9}{'restarts':>10}{'kept':>6}{'redone':>8}")
    for name, r in each.items():
        if r is None:
            print(f"  {name:<24}{'not started':>9}")
            continue
        runs_goodput = "-" if r["goodput"] is None else f"{100 * r['goodput']:.1f}%"
        print(f"  {name:<24}{_duration(r['wall_s']):>9}{runs_goodput:>9}{r['restarts']:>10}{r['steps_kept']:>6}"
              f"{r['steps_redone']:>8}")
    print(f"  {sweep_dir / 'goodput.json'}; each run's goodput.json and {PICTURE} in its folder")
    return sweep


def run_scoring(output: Path) -> dict:
    """A `score` output folder: its workers' summaries summed, and each worker's line (the
    summaries `trainer/scoring/command.py` writes in .score/summaries/; named here, not
    imported: scoring is a layer above)."""
    workers = [json.loads(p.read_text()) for p in sorted((output / ".score" / "summaries").glob("*.json"))]
    shards = json.loads((output / ".score" / "manifest.json").read_text())["shards"]
    published = [name for name, *_ in shards if any(output.glob(f"{glob.escape(name)}.*"))]
    total = {key: sum(w[key] for w in workers) for key in ("rows", "chunks", "truncated", "skipped", "scored_twice")}
    total |= {"workers": len(workers), "shards": len(shards), "shards_published": len(published)}
    skipped = {p.name.replace("%2F", "/"): p.read_text() for p in sorted((output / ".score" / "skipped").glob("*"))}
    total["shards_skipped"] = skipped
    failed = output / ".score" / "failed"
    if failed.exists():
        total["failed"] = failed.read_text()
    print(f"scoring of {output}: {total['shards_published']} of {total['shards']} shards published"
          + (f", {len(skipped)} unreadable and skipped" if skipped else "") + ", "
          f"{total['rows']} rows in {total['chunks']} chunks by {total['workers']} worker(s); "
          f"{total['truncated']} truncated, {total['skipped']} skipped, {total['scored_twice']} chunks scored twice")
    for w in workers:
        print(f"  {w['worker']:<40}{w['rows']:>10} rows{w['rows_per_s']:>10.1f} rows/s{w['seconds']:>9.0f} s")
    for why in skipped.values():
        print(f"  skipped: {why}")
    if "failed" in total:
        print(f"  failed: {total['failed']}")
    return total
