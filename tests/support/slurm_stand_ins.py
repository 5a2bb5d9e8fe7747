"""Stand-ins for what slurm/ddp.sh runs, to test the script's own logic on the real cluster in
a second or two a job: its exit-code mapping, its requeues, what it hands a container.

- `fake_venv(folder)`: a TRAINER_VENV whose `python` answers `-m trainer check` with 0 and
  `-m trainer.cli.torchrun ...` as FAKE_TORCHRUN says, per attempt and node, after writing its
  argv and environment to FAKE_OUT/torchrun.ATTEMPT.NODE. FAKE_TORCHRUN holds rules
  `ATTEMPT:NODE=ACTION` (NODE may be `*`); ACTION is an exit code, `CODE>HOST` (append HOST to
  $TRAINER_NODE_FAULTS, as a rank that suspects HOST does, then exit CODE), or `hang` (until
  srun ends it). No rule: exit 0. A node that exits first waits (60 s at most) until each
  other node told to hang in this attempt is hanging: srun's TERM then finds its process.
  Otherwise, at once as it exits, srun may end the step before the other node's relay has
  started its child, which then misses the TERM and dies of the SIGKILL after KillWait.
- `fake_apptainer(folder)`: an `apptainer` that writes its argv and environment to
  FAKE_OUT/apptainer.NODE.PID and exits 0: what ddp.sh asks of Apptainer, on each node.

Both read the node's name with `uname -n`, as ddp.sh's relay does.
"""

from __future__ import annotations

from pathlib import Path

_PYTHON = r"""#!/bin/bash
attempt=${SLURM_RESTART_COUNT:-0}
node=$(uname -n)
case "$1 $2" in
    "-m trainer") exit 0 ;;
    "-m trainer.cli.torchrun") ;;
    *) echo "fake python: not a call slurm/ddp.sh makes: $*" >&2; exit 99 ;;
esac
{ echo "argv: $*"; env; } > "$FAKE_OUT/torchrun.$attempt.$node"
others_hanging() {
    for rule in $FAKE_TORCHRUN; do
        local host=${rule#*:}; host=${host%%=*}
        [[ ${rule%%:*} == "$attempt" && ${rule#*=} == hang && $host != "$node" && $host != "*" ]] || continue
        for _ in $(seq 600); do [[ -e $FAKE_OUT/hanging.$attempt.$host ]] && break; sleep 0.1; done
    done
}
for rule in $FAKE_TORCHRUN; do
    [[ ${rule%%:*} == "$attempt" ]] || continue
    rest=${rule#*:}
    [[ ${rest%%=*} == "*" || ${rest%%=*} == "$node" ]] || continue
    action=${rest#*=}
    case $action in
        hang) : > "$FAKE_OUT/hanging.$attempt.$node"; exec sleep 120 ;;
        *'>'*) echo "${action#*>}" >> "$TRAINER_NODE_FAULTS"; others_hanging; exit "${action%%>*}" ;;
        *) others_hanging; exit "$action" ;;
    esac
done
exit 0
"""

_APPTAINER = r"""#!/bin/bash
{ printf 'argv:'; printf ' %q' "$@"; echo; env; } > "$FAKE_OUT/apptainer.$(uname -n).$$"
"""


def _script(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    return path


def fake_venv(folder: Path) -> Path:
    """A TRAINER_VENV folder whose bin/python is the stand-in above."""
    _script(folder / "bin" / "python", _PYTHON)
    return folder


def fake_apptainer(folder: Path) -> Path:
    """A folder to put first on PATH, holding the `apptainer` stand-in."""
    _script(folder / "apptainer", _APPTAINER)
    return folder


def recorded_env(path: Path) -> tuple[str, dict[str, str]]:
    """(the argv line, the environment) a stand-in recorded."""
    argv, *lines = path.read_text().splitlines()
    return argv, dict(line.split("=", 1) for line in lines if "=" in line)
