"""The first import of the train loader's worker server (worker_server.start_worker_server), before the
modules it preloads: the server is to run one thread when it forks a worker, and those imports
would start two, numpy's OpenBLAS pool and pyarrow's jemalloc purging thread. Its workers miss
neither: DataLoader runs their torch on one thread, and they read memory-mapped Arrow files."""

import os

os.environ["OPENBLAS_NUM_THREADS"] = "1"
os.environ["JE_ARROW_MALLOC_CONF"] = "background_thread:false"
