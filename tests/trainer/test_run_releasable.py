"""A released cross-cell wait: given up at once, and, when it can be cancelled, ended before the caller moves on."""

import threading
import time

import pytest

from ftexp.trainer.rank import CollectiveReleased, run_releasable


def test_a_release_gives_up_on_a_collective_that_cannot_be_cancelled():
    released, stuck = threading.Event(), threading.Event()
    threading.Timer(0.1, released.set).start()
    started = time.monotonic()
    with pytest.raises(CollectiveReleased):
        run_releasable(lambda: stuck.wait(30), released)
    assert time.monotonic() - started < 5
    stuck.set()  # lets the abandoned thread end


def test_a_cancellable_collective_has_ended_when_the_release_is_raised():
    """As a heal receiving into the replica's own tensors must: its last write comes before the release."""
    released, woken, writes = threading.Event(), threading.Event(), []

    def receive():
        woken.wait(30)
        time.sleep(0.2)  # what is left of the receive after the cancel woke it
        writes.append("last write")

    threading.Timer(0.1, released.set).start()
    with pytest.raises(CollectiveReleased):
        run_releasable(receive, released, cancel=woken.set)
    assert writes == ["last write"]


def test_a_collective_that_completes_returns_and_its_error_is_raised():
    run_releasable(lambda: None, threading.Event())

    def failing():
        raise ConnectionError("the source closed the heal transfer")

    with pytest.raises(ConnectionError, match="closed the heal transfer"):
        run_releasable(failing, threading.Event())
