"""How the test run splits over processes (pytest-xdist, ``-n 2`` as the README runs it).

Each test file runs whole on one worker, so its module-scoped runs (the shared end-to-end runs the
negative controls copy) are made once. Two groups of files share one worker each:

* the files that submit jobs to the local Slurm cluster: it has two 2-CPU nodes, and the 2-node
  tests need both idle;
* the files that run live rollout engines: each of their runs is a dozen busy processes, and two
  such runs at once (load average 15 on 2 cores) take longer than one after the other.

The longest files start first (measured on 2 cores), so that the short ones fill in at the end
instead of one long file running alone.

Each worker computes with one intra-op thread: two workers already fill the two cores, and a
second thread per worker only spins against the other worker's processes.
"""

from pathlib import PurePosixPath

import torch
from xdist.scheduler import LoadFileScheduling

import ftexp  # noqa: F401  (before any test computes: it picks torch's CPU kernels, as in every run)

torch.set_num_threads(1)

GROUPS = {"test_slurm.py": "slurm", "test_multinode.py": "slurm", "test_multinode_engines.py": "slurm",
          "test_real_rollout.py": "live_engines", "test_realistic.py": "live_engines",
          "test_realistic_gsm8k.py": "live_engines"}
LONGEST_FIRST = ["test_real_rollout.py", "test_realistic.py", "test_realistic_gsm8k.py", "test_scenarios.py",
                 "test_megatron_scenarios.py", "test_multinode.py", "test_multinode_engines.py", "test_slurm.py",
                 "test_soak.py", "test_launch.py", "test_bad_input_battery.py"]


class FileScheduling(LoadFileScheduling):
    def _split_scope(self, nodeid: str) -> str:
        path = nodeid.split("::", 1)[0]
        return GROUPS.get(PurePosixPath(path).name, path)


def pytest_xdist_make_scheduler(config, log):
    config.option.loadscopereorder = False  # keep the collection's order (below), not "most tests first"
    return FileScheduling(config, log)


def pytest_collection_modifyitems(items):
    def rank(item) -> int:
        in_e2e = item.path.parent.name == "e2e"
        return LONGEST_FIRST.index(item.path.name) if in_e2e and item.path.name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: within a file, and for every other file, the order stays

