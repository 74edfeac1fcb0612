"""MiniFTController against a real control server, stepped on a FakeClock."""

import threading

import pytest

from ftexp.control.api_models import Cell, TriState
from ftexp.control.clock import FakeClock
from ftexp.control.controller import CellHealth, MiniFTController, classify_cell
from ftexp.control.registry import compute_cell_status

from .scripted_cells import ScriptedCell, serve

RESUME_DELAY = 10.0


def cell_json(phase, conditions):
    return Cell.model_validate({
        "metadata": {"name": "actor-0", "labels": {"miles.io/cell-type": "actor", "miles.io/cell-index": "0"}},
        "spec": {"suspend": phase == "Suspended"},
        "status": {"phase": phase, "conditions": [{"type": t, "status": s} for t, s in conditions]},
    })


def cell_from_state(state, health=TriState.TRUE):
    snapshot = compute_cell_status(state, health)
    return cell_json(snapshot.phase, [(c.type, c.status.value) for c in snapshot.conditions])


@pytest.mark.parametrize("cell, expected", [
    (cell_from_state("AllocatedAlive", TriState.FALSE), CellHealth.UNHEALTHY),
    (cell_from_state("AllocatedErrored"), CellHealth.UNHEALTHY),
    (cell_from_state("Stopped"), CellHealth.UNHEALTHY),
    (cell_json("Suspended", [("Allocated", "False"), ("Healthy", "True")]), CellHealth.UNHEALTHY),
    (cell_from_state("Pending"), CellHealth.NOT_APPLICABLE),
    (cell_json("Running", [("Allocated", "True")]), CellHealth.NOT_APPLICABLE),
    (cell_from_state("AllocatedAlive", TriState.TRUE), CellHealth.HEALTHY),
    (cell_from_state("AllocatedAlive", TriState.UNKNOWN), CellHealth.HEALTHY),
    (cell_from_state("AllocatedUninitialized"), CellHealth.HEALTHY),
])
def test_classify_cell(cell, expected):
    assert classify_cell(cell) is expected


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def cluster():
    """Five actor cells covering every mapping row, behind a real server."""
    cells = [ScriptedCell("actor", 0), ScriptedCell("actor", 1, health=TriState.FALSE),
             ScriptedCell("actor", 2, state="Stopped"), ScriptedCell("actor", 3, state="Pending"),
             ScriptedCell("actor", 4, health=TriState.UNKNOWN)]
    server = serve(*cells)
    yield cells, server.base_url
    server.stop()


def in_thread(fn):
    thread = threading.Thread(target=fn, daemon=True)
    thread.start()
    return thread


def test_poll_heals_only_unhealthy_cells_one_after_another(cluster, clock):
    cells, url = cluster
    controller = MiniFTController(url, poll_interval=30.0, resume_delay=RESUME_DELAY, clock=clock)
    poll = in_thread(controller.poll_once)
    clock.wait_for_sleepers(1)
    # Mid-heal of the first unhealthy cell: suspended, not yet resumed, the next one untouched.
    assert [c.calls for c in cells] == [[], ["suspend"], [], [], []]
    clock.advance(RESUME_DELAY)
    clock.wait_for_sleepers(1)
    assert [c.calls for c in cells] == [[], ["suspend", "resume"], ["suspend"], [], []]
    clock.advance(RESUME_DELAY)
    poll.join(5.0)
    assert not poll.is_alive()
    assert [c.calls for c in cells] == [[], ["suspend", "resume"], ["suspend", "resume"], [], []]
    assert [c.state for c in cells[1:3]] == ["Pending", "Pending"]
    # Success: failures reset and a cooldown of resume_delay from the end of each heal.
    assert {n: (r.consecutive_failures, r.next_attempt_at) for n, r in controller.backoff.items()} == {
        "actor-1": (0, 20.0), "actor-2": (0, 30.0)}


def test_cooldown_after_a_successful_heal(cluster, clock):
    cells, url = cluster
    for cell in cells[2:]:
        cell.state, cell.health = "AllocatedAlive", TriState.TRUE
    controller = MiniFTController(url, resume_delay=RESUME_DELAY, clock=clock)
    poll = in_thread(controller.poll_once)
    clock.wait_for_sleepers(1)
    clock.advance(RESUME_DELAY)
    poll.join(5.0)
    cells[1].state = "Stopped"  # down again right away
    clock.advance(RESUME_DELAY - 1)
    controller.poll_once()  # would block on the heal sleep if it healed
    assert cells[1].calls == ["suspend", "resume"]
    clock.advance(1)
    poll = in_thread(controller.poll_once)
    clock.wait_for_sleepers(1)
    assert cells[1].calls == ["suspend", "resume", "suspend"]
    clock.advance(RESUME_DELAY)
    poll.join(5.0)


def test_backoff_sequence_and_cleanup(clock):
    cell = ScriptedCell("actor", 0, health=TriState.FALSE)
    cell.fail_patch = True  # every heal fails at the suspend PATCH (500), so no sleep happens
    server = serve(cell)
    try:
        controller = MiniFTController(server.base_url, resume_delay=RESUME_DELAY, clock=clock)
        delays = []
        for attempt in range(1, 9):
            controller.poll_once()
            record = controller.backoff["actor-0"]
            assert record.consecutive_failures == attempt
            assert len(cell.calls) == attempt
            delay = record.next_attempt_at - clock.now()
            delays.append(delay)
            clock.advance(delay - 1)
            controller.poll_once()  # still backing off: no attempt
            assert len(cell.calls) == attempt
            clock.advance(1)
        assert delays == [10, 20, 40, 80, 160, 300, 300, 300]

        cell.health = TriState.TRUE
        controller.poll_once()
        assert controller.backoff == {}  # the record of a recovered cell is dropped
        cell.health = TriState.FALSE
        controller.poll_once()  # a fresh record: attempt at once, count restarts
        assert len(cell.calls) == 9
        assert controller.backoff["actor-0"].consecutive_failures == 1
    finally:
        server.stop()


def test_failed_resume_counts_as_failed_heal(clock):
    cell = ScriptedCell("actor", 0, state="Stopped")
    server = serve(cell)
    try:
        controller = MiniFTController(server.base_url, resume_delay=RESUME_DELAY, clock=clock)
        poll = in_thread(controller.poll_once)
        clock.wait_for_sleepers(1)
        cell.fail_patch = True
        clock.advance(RESUME_DELAY)
        poll.join(5.0)
        record = controller.backoff["actor-0"]
        assert (record.consecutive_failures, record.next_attempt_at) == (1, RESUME_DELAY + 10)
    finally:
        server.stop()


def test_unreachable_server_is_survived(clock):
    controller = MiniFTController("http://127.0.0.1:9", clock=clock)
    controller.poll_once()
    assert controller.backoff == {}


def test_run_survives_a_failed_list_paces_polls_and_stops(clock):
    cell = ScriptedCell("actor", 0, state="Bogus")  # listing fails with a 500 while this holds
    server = serve(cell)
    try:
        controller = MiniFTController(server.base_url, poll_interval=30.0, resume_delay=RESUME_DELAY, clock=clock)
        loop = in_thread(controller.run)
        clock.wait_for_sleepers(1)  # poll at t=0 failed; waiting for t=30
        assert cell.calls == []
        cell.state = "Stopped"
        clock.advance(30)
        clock.wait_for_sleepers(1)  # the poll at t=30 heals: suspended, in the resume delay
        assert cell.calls == ["suspend"]
        clock.advance(RESUME_DELAY)
        clock.wait_for_sleepers(1)  # resumed at t=40; the next poll is due at t=60, not t=70
        assert cell.calls == ["suspend", "resume"]
        cell.state = "Stopped"
        clock.advance(19)
        clock.wait_for_sleepers(1)
        assert cell.calls == ["suspend", "resume"]
        clock.advance(1)
        clock.wait_for_sleepers(1)
        assert cell.calls == ["suspend", "resume", "suspend"]
        controller.request_stop()
        clock.advance(RESUME_DELAY)  # the heal in flight completes before the loop ends
        loop.join(5.0)
        assert not loop.is_alive()
        assert cell.calls == ["suspend", "resume", "suspend", "resume"]
    finally:
        server.stop()
