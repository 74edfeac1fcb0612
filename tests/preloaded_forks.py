"""One fork server per test process, for the tests' command lines and megatron ranks.

A fresh interpreter spends ~4-5 CPU-seconds importing torch, torch's compiler stack (a torch optimizer
pulls it in), megatron-core, Ray, Hydra and matplotlib, far more than a test's megatron rank or refused
command line then runs, and a run's driver pays it once more on top of its jobs. multiprocessing's
forkserver imports ``PRELOAD`` once, and every process started from it is a fork of that server: it
still starts from a state no test touched, before any thread or process group. The server is a
singleton of the test process that keeps what it imported when it first started, so every user asks
for the same list; it lives as long as the test process.
"""

import multiprocessing

# The model module loads megatron-core; a command line that reaches a verdict plots its curves with matplotlib.
PRELOAD = ["torch", "torch._dynamo", "ftexp.engines.megatron.model", "ftexp.cli", "matplotlib.figure",
           "matplotlib.backends.backend_agg"]


def forkserver_context():
    """multiprocessing's forkserver context, its server preloaded with ``PRELOAD``."""
    multiprocessing.set_forkserver_preload(PRELOAD)
    return multiprocessing.get_context("forkserver")
