"""`python -m support.fresh_state [EXIT] [--until-signalled]`: what a process starts with, as one
JSON line (tests/e2e/test_sweep_preload.py compares a forked run's with a fresh interpreter's),
then its exit status EXIT. With --until-signalled it first says "ready" and waits for SIGTERM,
which it answers by exiting EXIT."""

import json
import os
import random
import signal
import sys
import threading

NAMES = ("SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1", "SIGUSR2", "SIGPIPE", "SIGCHLD", "SIGQUIT")

code = int(sys.argv[1]) if len(sys.argv) > 1 else 0
torch = sys.modules.get("torch")
print(json.dumps({
    "argv": sys.argv[1:],
    "threads": threading.active_count(),
    "signals": {name: repr(signal.getsignal(getattr(signal, name))) for name in NAMES},
    "blocked": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
    "random": random.random(),
    "numpy_random": sys.modules["numpy"].random.random() if "numpy" in sys.modules else None,
    "torch_imported": torch is not None,
    "cuda_initialized": torch is not None and torch.cuda.is_initialized(),
    "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    "cwd": os.getcwd(),
    "stdin": os.read(0, 1).decode(),
}), flush=True)
if "--until-signalled" in sys.argv:
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(code))
    print("ready", flush=True)
    while True:
        signal.pause()
sys.exit(code)
