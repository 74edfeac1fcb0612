"""How the test run splits over processes (pytest-xdist, ``-n 2`` as the README runs it).

Each test file runs whole on one worker, so its module-scoped runs (the shared end-to-end runs the
negative controls copy) are made once. The files that submit jobs to the local Slurm cluster share
one worker: the cluster has two 2-CPU nodes, and the 2-node tests need both idle.
"""

from pathlib import PurePosixPath

from xdist.scheduler import LoadFileScheduling

SLURM_FILES = {"test_slurm.py", "test_multinode.py"}


class FileScheduling(LoadFileScheduling):
    def _split_scope(self, nodeid: str) -> str:
        path = nodeid.split("::", 1)[0]
        return "slurm" if PurePosixPath(path).name in SLURM_FILES else path


def pytest_xdist_make_scheduler(config, log):
    return FileScheduling(config, log)
