"""RecoveryGate rules, and the random injector against a real control server on a FakeClock."""

import random
import threading

import pytest

from ftexp.control.api_models import Cell, TriState
from ftexp.control.clock import FakeClock
from ftexp.control.registry import compute_cell_status
from ftexp.errors import InputError
from ftexp.control.failure_modes import FailureMode
from ftexp.faults.injector import DEFAULT_MODES, GateState, RandomInjector, RecoveryGate

from control.scripted_cells import ScriptedCell, serve


# ---- RecoveryGate ---------------------------------------------------------------------------------

def view(name, state="AllocatedAlive", health=TriState.TRUE):
    snapshot = compute_cell_status(state, health)
    return Cell.model_validate({
        "metadata": {"name": name, "labels": {"miles.io/cell-type": "actor", "miles.io/cell-index": name[-1]}},
        "spec": {"suspend": snapshot.suspended},
        "status": {"phase": snapshot.phase, "conditions": [c.model_dump() for c in snapshot.conditions]},
    })


def by_name(*cells):
    return {c.metadata.name: c for c in cells}


def names(cells):
    return [c.metadata.name for c in cells]


def test_only_healthy_true_and_initialised_counts_as_alive():
    # actor-5 was restarted and awaits its heal: it answers health checks but has no state to heal from.
    cells = [view("actor-0"), view("actor-1", health=TriState.UNKNOWN), view("actor-2", health=TriState.FALSE),
             view("actor-3", "Pending"), view("actor-4", "Stopped"), view("actor-5", "AllocatedUninitialized")]
    assert names(RecoveryGate().genuinely_alive(cells)) == ["actor-0"]


def test_a_server_without_the_initialized_condition_is_taken_at_its_healthy_word():
    cell = view("actor-0")
    cell.status.conditions = [c for c in cell.status.conditions if c.type != "Initialized"]
    assert names(RecoveryGate().genuinely_alive([cell])) == ["actor-0"]


def test_injected_cell_that_still_reads_alive_stays_injected_and_excluded():
    gate = RecoveryGate()
    gate.note_injected("actor-1")
    for _ in range(3):  # however long the stale Healthy=True view lasts
        gate.observe(by_name(view("actor-0"), view("actor-1")))
        assert gate.state("actor-1") is GateState.INJECTED
    assert names(gate.genuinely_alive([view("actor-0"), view("actor-1")])) == ["actor-0"]


@pytest.mark.parametrize("down", [
    {"actor-1": view("actor-1", "Stopped")},
    {"actor-1": view("actor-1", health=TriState.FALSE)},
    {"actor-1": view("actor-1", health=TriState.UNKNOWN)},
    {},  # missing from the list
])
def test_down_then_up_is_a_full_cycle(down):
    gate = RecoveryGate()
    gate.note_injected("actor-1")
    gate.observe(down)
    assert gate.state("actor-1") is GateState.RECOVERING
    gate.observe(down)
    assert gate.state("actor-1") is GateState.RECOVERING
    assert gate.genuinely_alive([view("actor-1")]) == []  # still tracked until observed up
    gate.observe(by_name(view("actor-1")))
    assert gate.state("actor-1") is None
    assert names(gate.genuinely_alive([view("actor-1")])) == ["actor-1"]


def test_a_restarted_cell_is_up_only_once_healed():
    gate = RecoveryGate()
    gate.note_injected("actor-1")
    gate.observe(by_name(view("actor-1", "Stopped")))
    gate.observe(by_name(view("actor-1", "AllocatedUninitialized")))  # restarted, not healed yet
    assert gate.state("actor-1") is GateState.RECOVERING
    gate.observe(by_name(view("actor-1")))
    assert gate.state("actor-1") is None


def test_reinjecting_a_recovering_cell_restarts_its_cycle():
    gate = RecoveryGate()
    gate.note_injected("actor-1")
    gate.observe({})
    gate.note_injected("actor-1")
    gate.observe(by_name(view("actor-1")))
    assert gate.state("actor-1") is GateState.INJECTED


def test_untracked_cells_are_left_alone():
    gate = RecoveryGate()
    gate.observe(by_name(view("actor-0", "Stopped")))
    assert gate.state("actor-0") is None


# ---- RandomInjector ------------------------------------------------------------------------------

POLL = 2.0


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def make_injector(clock):
    started = []

    def make(*cells, **kwargs):
        server = serve(*cells)
        args = dict(seed=42, crash_probability=1.0, time_unit_s=1.0, poll_interval=POLL, clock=clock)
        injector = RandomInjector(server.base_url, **(args | kwargs))
        injector.start()
        started.append((injector, server))
        clock.wait_for_sleepers(1)
        return injector

    yield make
    for injector, server in started:
        injector.stop_and_join(5.0)
        server.stop()


def polls(clock, count, poll=POLL):
    for _ in range(count):
        clock.advance(poll)
        clock.wait_for_sleepers(1)


def injected(cells):
    return sum(len(c.injected) for c in cells)


@pytest.mark.parametrize("num_cells", [1, 2, 3])
def test_stale_view_never_kills_the_last_live_cell(make_injector, clock, num_cells):
    # Injections are accepted but every cell keeps reading Healthy=True forever.
    cells = [ScriptedCell("actor", i) for i in range(num_cells)]
    injector = make_injector(*cells)
    polls(clock, 100)
    assert len(injector.injections) == injected(cells) == num_cells - 1
    assert len({i.cell for i in injector.injections}) == num_cells - 1


def test_injects_again_after_a_full_recovery_cycle(make_injector, clock):
    cells = [ScriptedCell("actor", 0), ScriptedCell("actor", 1)]
    injector = make_injector(*cells)
    polls(clock, 1)
    assert len(injector.injections) == 1
    victim = next(c for c in cells if c.injected)
    victim.state = "Stopped"  # the control plane finally notices
    polls(clock, 5)
    assert len(injector.injections) == 1  # down is not enough: the survivor is the last live cell
    victim.state = "AllocatedAlive"
    polls(clock, 1)  # seen up again: the gate forgets it ...
    polls(clock, 5)
    assert len(injector.injections) == 2  # ... and injecting resumes


def test_cells_awaiting_their_heal_do_not_count_as_survivors(make_injector, clock):
    # Two cells were restarted and wait for the next refresh to heal them; two hold the state. Killing
    # both of those would leave nobody to heal from, however healthy the restarted two read.
    cells = [ScriptedCell("actor", i) for i in range(4)]
    cells[0].state = cells[1].state = "AllocatedUninitialized"
    for cell in cells:
        cell.on_inject = lambda c: setattr(c, "state", "Stopped")
    injector = make_injector(*cells)
    polls(clock, 50)
    assert [i.cell for i in injector.injections] in (["actor-2"], ["actor-3"])
    survivor = cells[5 - int(injector.injections[0].cell[-1])]
    assert survivor.state == "AllocatedAlive" and not survivor.injected


def test_records_match_what_the_server_received(make_injector, clock):
    cells = [ScriptedCell("actor", i) for i in range(4)]
    for cell in cells:
        cell.on_inject = lambda c: setattr(c, "state", "Stopped")  # crash visible at once
    injector = make_injector(*cells)
    for _ in range(30):
        polls(clock, 3)
        for cell in cells:  # heal everything that went down
            cell.state = "AllocatedAlive"
    assert len(injector.injections) >= 10
    for cell in cells:  # same faults, same order, always into actor 0 of the cell
        assert [(i.mode, 0) for i in injector.injections if i.cell == f"actor-{cell.index}"] == cell.injected
    assert {i.mode for i in injector.injections} == set(DEFAULT_MODES)  # never deadlock by default


def test_first_injection_waits_for_the_exponential_schedule(make_injector, clock):
    seed, time_unit_s, probability, poll = 7, 60.0, 0.5, 1.0
    due = random.Random(seed).expovariate(1 / 120.0)
    cells = [ScriptedCell("actor", 0), ScriptedCell("actor", 1)]
    fired_at = []
    for cell in cells:
        cell.on_inject = lambda c: fired_at.append(clock.now())
    injector = make_injector(*cells, seed=seed, crash_probability=probability, time_unit_s=time_unit_s,
                             poll_interval=poll)
    assert injector.mean_interval_s == 120.0
    polls(clock, int(due // poll) + 3, poll)
    assert fired_at == [float(int(due // poll) + 1)]  # the first poll at or after the due time


@pytest.mark.parametrize("probability, mean", [(0.5, 120.0), (0.1, 600.0), (0.0, 6000.0), (0.001, 6000.0)])
def test_mean_interval(probability, mean):
    assert RandomInjector("http://127.0.0.1:9", 0, probability).mean_interval_s == pytest.approx(mean)


@pytest.mark.parametrize("kwargs", [{"crash_probability": 1.5}, {"crash_probability": -0.1},
                                    {"crash_probability": 0.5, "modes": []}])
def test_bad_configuration_is_an_input_error(kwargs):
    with pytest.raises(InputError):
        RandomInjector("http://127.0.0.1:9", 0, **kwargs)


def test_rejected_injection_keeps_the_schedule_and_retries(make_injector, clock):
    seed, poll = 3, 20.0
    due = random.Random(seed).expovariate(1 / 600.0)
    # No actor to inject into: every POST is a 500 until the cells are fixed.
    cells = [ScriptedCell("actor", 0, num_actors=0), ScriptedCell("actor", 1, num_actors=0)]
    injector = make_injector(*cells, seed=seed, time_unit_s=600.0, poll_interval=poll)
    polls(clock, int(due // poll) + 5, poll)  # past the due time: several rejected attempts
    assert injector.injections == []
    for cell in cells:
        cell.num_actors = 1
    polls(clock, 1, poll)  # still due: the rejections did not draw a new time
    assert len(injector.injections) == injected(cells) == 1


def test_recovery_between_sparse_injections_is_seen(make_injector, clock):
    cells = [ScriptedCell("actor", 0), ScriptedCell("actor", 1)]
    injector = make_injector(*cells, time_unit_s=60.0, crash_probability=0.5)  # mean 120 s, polls every 2 s
    while not injector.injections:
        polls(clock, 1)
    victim = next(c for c in cells if c.injected)
    victim.state = "Stopped"
    polls(clock, 1)
    victim.state = "AllocatedAlive"
    polls(clock, 1)  # the whole down→up cycle happened long before the next due time
    polls(clock, 1000)
    assert len(injector.injections) >= 2


def test_survives_list_failures_and_stops_promptly(make_injector, clock):
    cells = [ScriptedCell("actor", 0, state="Bogus"), ScriptedCell("actor", 1)]  # listing is a 500
    injector = make_injector(*cells)
    polls(clock, 10)
    assert injector.injections == []
    cells[0].state = "AllocatedAlive"
    polls(clock, 1)
    assert len(injector.injections) == 1
    injector.stop_and_join(5.0)
    assert "random-fault-injector" not in [t.name for t in threading.enumerate()]


def test_explicit_modes_are_used(make_injector, clock):
    cells = [ScriptedCell("actor", i) for i in range(3)]
    injector = make_injector(*cells, modes=[FailureMode.DEADLOCK])
    polls(clock, 3)
    assert [i.mode for i in injector.injections] == [FailureMode.DEADLOCK] * 2


def test_first_mode_forces_only_the_first_injection(make_injector, clock):
    cells = [ScriptedCell("actor", i) for i in range(3)]
    injector = make_injector(*cells, modes=[FailureMode.SIGKILL], first_mode=FailureMode.DEADLOCK)
    polls(clock, 3)
    assert [i.mode for i in injector.injections] == [FailureMode.DEADLOCK, FailureMode.SIGKILL]


def test_first_after_s_forces_the_first_injections_time(make_injector, clock):
    # Mean interval 100 s: the first poll injects only where the first time is forced.
    forced = [ScriptedCell("actor", i) for i in range(3)]
    drawn = [ScriptedCell("drawn", i) for i in range(3)]
    forced_injector = make_injector(*forced, crash_probability=0.01, first_after_s=0.0)
    drawn_injector = make_injector(*drawn, crash_probability=0.01)
    clock.wait_for_sleepers(2)
    clock.advance(POLL)
    clock.wait_for_sleepers(2)
    assert len(forced_injector.injections) == 1 and drawn_injector.injections == []


def test_a_negative_first_after_s_is_refused():
    with pytest.raises(InputError, match="first_after_s"):
        RandomInjector("http://127.0.0.1:1", seed=0, crash_probability=0.5, first_after_s=-1.0)
