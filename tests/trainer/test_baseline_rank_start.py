"""How the baseline's rank processes start: forked from one importer by default, fresh interpreters on request."""

import sys

from ftexp.trainer.baseline import rank_start_context

PRELOADED = "ftexp.engines.torch.replica"


def _report_preloaded(queue) -> None:
    queue.put(PRELOADED in sys.modules)


def test_ranks_fork_from_a_preloading_server_unless_asked_to_start_fresh():
    assert rank_start_context(False, (PRELOADED,)).get_start_method() == "forkserver"
    fresh = rank_start_context(True, (PRELOADED,))
    assert fresh.get_start_method() == "spawn"
    # A fresh rank imports on its own: nothing of the trainer's engine is there before it asks for it.
    queue = fresh.Queue()
    process = fresh.Process(target=_report_preloaded, args=(queue,))
    process.start()
    assert queue.get(timeout=120) is False
    process.join(timeout=60)
    assert process.exitcode == 0
