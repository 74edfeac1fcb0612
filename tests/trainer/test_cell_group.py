"""Cell lifecycle and group refresh rules against real Ray actors.

The actors here are scripted stand-ins for a rank host serving one rank of a cell (they answer
init/reconfigure/train as told), reached through rank handles as the real ones are; the real
RankHost runs in ``test_rank_process.py`` and the end-to-end scenario tests.
"""

import os
import threading
import time

import pytest
import ray

from ftexp.audit.events import (CellLifecycleEvent, CellReconfigureEvent, EventLogger, ProcessIdentity,
                                TrainGroupStepEndEvent, WitnessAllocateIdEvent, read_events)
from ftexp.audit.witness import WitnessIdAllocator
from ftexp.config import TrainerConfig
from ftexp.trainer.cell import Cell, CellState
from ftexp.trainer.cell_rank import RankHandle
from ftexp.trainer.local_ray import start_local_ray
from ftexp.trainer.group import RetryableStepError, TrainGroup


@ray.remote(num_cpus=0, max_restarts=0, concurrency_groups={"heartbeat": 1, "lifeline": 1})
class ScriptedRank:
    """Hosts one rank: every call names it (``team``, ``rank``), as it names one rank of a ``RankHost``; killing
    the team ends the actor."""

    def __init__(self, cell_index: int, train: str = "normal"):
        # train: "normal"; "fail" (the cell dies mid-step); "collective" (block as in a cross-cell
        # collective with a peer in attempt 0, until the driver releases it); "discard_once" (its first
        # reduce fails). "<behaviour>@<rollout>": only at that rollout.
        self.cell_index, self.calls, self.runs, self.witness_ids = cell_index, [], [], []
        self.train_behaviour, _, at = train.partition("@")
        self.behaviour_at = int(at) if at else None
        self.released = threading.Event()
        self.discarded = False

    def ping(self, team, rank):
        return True

    @ray.method(concurrency_group="lifeline")
    def lifeline(self, team, rank):
        threading.Event().wait()

    def init(self, team, rank, info, load_rollout_id, recv_src_rank):
        self.calls.append(("init", info.quorum_id, recv_src_rank))
        return {"ok": True, "configure_s": 0.0, "transfer_wait_s": 0.0, "transfer_s": 0.0, "load_s": 0.0, "bytes": 0,
                "last_rollout_id": -1}

    def reconfigure(self, team, rank, info, send_to):
        self.calls.append(("reconfigure", info.quorum_id, list(send_to)))
        return {"ok": True, "configure_s": 0.0, "transfer_wait_s": 0.0, "load_s": 0.0, "bytes": 100 * len(send_to)}

    def train(self, team, rank, rollout_ids, attempt, witnesses):
        """As a RankHost rank: the run's rollouts in order, stopping after the first that does not commit."""
        self.runs.append((list(rollout_ids), attempt))
        self.witness_ids.append([w.witness_ids for w in witnesses] if witnesses is not None else None)
        trained, mark = [], time.perf_counter()
        for rollout_id in rollout_ids:
            outcome = self._train_rollout(rollout_id, attempt)
            trained.append((outcome, {"train/loss": 0.0} if outcome == "normal" else None, time.perf_counter() - mark))
            mark = time.perf_counter()
            if outcome != "normal":
                break
        return trained

    def _train_rollout(self, rollout_id, attempt):
        behaviour = self.train_behaviour if self.behaviour_at in (None, rollout_id) else "normal"
        if behaviour == "fail":
            raise RuntimeError("scripted death mid-step")
        if behaviour == "collective" and attempt == 0:
            released = self.released.wait(60)
            self.calls.append(("released" if released else "timed out", rollout_id))
            return "discarded_should_retry"
        self.calls.append(("train", rollout_id, attempt))
        if behaviour == "discard_once" and not self.discarded:
            self.discarded = True
            return "discarded_should_retry"
        return "normal"

    @ray.method(concurrency_group="heartbeat")
    def release_collectives(self, team, rank, quorum_id):
        self.calls.append(("release", quorum_id))
        self.released.set()

    def get_calls(self, team, rank):
        return self.calls

    def get_runs(self, team, rank):
        return self.runs

    def get_witness_ids(self, team, rank):
        return self.witness_ids

    def fail(self, team, rank):
        raise RuntimeError("scripted failure")

    def block(self, team, rank):
        time.sleep(600)  # a rank stuck in a collective with a dead peer

    @ray.method(concurrency_group="heartbeat")
    def exit(self, team, rank):
        os._exit(1)  # the process dies between the driver's calls

    @ray.method(concurrency_group="heartbeat")
    def kill(self, team):
        os._exit(1)


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    start_local_ray(num_cpus=2)
    yield
    ray.shutdown()


def _cell(index=0, ranks=1):
    return Cell(index, lambda c, incarnation: [RankHandle(ScriptedRank.remote(c), f"cell{c}", r) for r in range(ranks)])


def _scripted(cell_index, behaviour="normal"):
    """A one-rank cell's ranks: a scripted actor's handle for rank 0."""
    return [RankHandle(ScriptedRank.remote(cell_index, behaviour), f"cell{cell_index}", 0)]


def test_cell_transitions_and_no_ops():
    cell = _cell()
    assert cell.state == CellState.PENDING
    cell.start()  # Pending: no-op
    cell.allocate()
    assert cell.state == CellState.ALLOCATED
    cell.start()  # Allocated: no-op
    assert cell.state == CellState.ALLOCATED
    with pytest.raises(AssertionError):
        cell.allocate()
    cell.stop()
    cell.stop()  # idempotent
    assert cell.state == CellState.STOPPED
    with pytest.raises(AssertionError):
        cell.allocate()
    stopped = cell.ranks
    cell.start()  # the next incarnation's actors start at once; the cell is Pending until a refresh allocates it
    assert cell.state == CellState.PENDING and cell.ranks and cell.ranks != stopped
    assert ray.get(cell.ranks[0].ping.remote(), timeout=30)
    cell.allocate()
    assert cell.state == CellState.ALLOCATED and cell.incarnation == 2
    cell.stop()


def test_failed_call_ends_stopped_with_dead_actors():
    cell = _cell()
    cell.allocate()
    with pytest.raises(Exception):
        cell.execute("fail")
    assert cell.state == CellState.STOPPED
    assert cell.ranks  # the handles are kept, and confirmed dead:
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(cell.ranks[0].ping.remote(), timeout=10)


def test_incarnation_counts_allocations():
    seen = []
    cell = Cell(0, lambda c, incarnation: seen.append(incarnation) or _scripted(c))
    cell.allocate()
    cell.stop()
    cell.start()
    cell.allocate()
    assert seen == [1, 2]  # a restarted cell's ranks rendezvous under a new prefix
    cell.stop()


def test_a_failing_rank_fails_its_cell_without_waiting_for_blocked_peers():
    """Rank 1 fails while rank 0 blocks (as in a collective with it): the cell is stopped at once."""
    cell = _cell(ranks=2)
    cell.allocate()
    started = time.monotonic()
    with pytest.raises(ray.exceptions.RayTaskError):
        cell.collect([cell.ranks[0].block.remote(), cell.ranks[1].fail.remote()])
    assert time.monotonic() - started < 60
    assert cell.state == CellState.STOPPED


_groups: list[TrainGroup] = []


@pytest.fixture(autouse=True)
def shut_groups_down():
    """Every group ends with its test: its death watch must not outlive it (nor Ray)."""
    yield
    while _groups:
        _groups.pop().shutdown()


def _group(tmp_path, n=3, behaviour=None, witness_allocator=None, **trainer):
    events = EventLogger(tmp_path / "events", ProcessIdentity(component="main"))
    behaviour = behaviour or {}
    group = TrainGroup(n, 1, lambda c, incarnation: _scripted(c, behaviour.get(c, "normal")), events,
                       TrainerConfig(**{"retry_backoff_s": 0.01, **trainer}), witness_allocator)
    _groups.append(group)
    group.init(load_rollout_id=None)
    return group


def _reconfigures(tmp_path):
    return [(e.quorum_id, e.healed_cell_indices, e.alive_cell_indices_after)
            for e in read_events(tmp_path / "events") if isinstance(e, CellReconfigureEvent)]


def test_refresh_without_change_is_a_no_op(tmp_path):
    group = _group(tmp_path)
    assert group.refresh(0) is None and group.refresh(0) is None
    assert group.quorum_id == 0
    assert not [e for e in read_events(tmp_path / "events") if isinstance(e, CellReconfigureEvent)]


def test_stop_stop_start_bumps_quorum_each_time_and_heals_from_lowest_alive(tmp_path):
    group = _group(tmp_path)
    group.stop_cell(0, by="test")
    shrink = group.refresh(1)
    assert (group.quorum_id, shrink.src_cell_index, shrink.alive_cell_indices_after) == (1, None, [1, 2])
    group.stop_cell(2, by="test")
    assert group.refresh(2).alive_cell_indices_after == [1] and group.quorum_id == 2
    group.start_cell(0, by="test")
    group.start_cell(2, by="test")
    heal = group.refresh(3)
    assert group.quorum_id == 3
    assert (heal.src_cell_index, heal.healed_cell_indices, heal.alive_cell_indices_after) == (1, [0, 2], [0, 1, 2])
    # the source sends to each healed cell's alive rank; each healed cell receives from the source's
    assert ray.get(group.cells[1].ranks[0].get_calls.remote())[-1] == ("reconfigure", 3, [0, 2])
    assert ray.get(group.cells[0].ranks[0].get_calls.remote()) == [("init", 3, 1)]
    assert group.refresh(4) is None  # a repeated refresh after a reconfigure is a no-op


def test_stop_then_start_before_refresh_is_one_heal(tmp_path):
    group = _group(tmp_path, n=2)
    group.stop_cell(1, by="test")
    group.start_cell(1, by="test")
    group.train([5])
    events = [e for e in read_events(tmp_path / "events") if isinstance(e, CellReconfigureEvent)]
    assert [(e.src_cell_index, e.healed_cell_indices) for e in events] == [(0, [1])]


def test_a_dead_cell_releases_its_peers_from_the_collective_at_once(tmp_path):
    """Cells 0 and 1 wait in a collective with cell 2, which dies: they are released at once, not at a timeout."""
    events = EventLogger(tmp_path / "events", ProcessIdentity(component="main"))
    behaviour = {0: "collective", 1: "collective", 2: "fail"}
    group = TrainGroup(3, 1, lambda c, incarnation: _scripted(c, behaviour[c]), events, TrainerConfig())
    _groups.append(group)
    group.init(load_rollout_id=None)
    started = time.monotonic()
    with pytest.raises(RetryableStepError):
        group._attempt([0], 0, time.monotonic())
    assert time.monotonic() - started < 30  # the scripted collective would wait 60 s
    for survivor in (0, 1):
        assert ray.get(group.cells[survivor].ranks[0].get_calls.remote())[-2:] == [("release", 0), ("released", 0)]
    [failed] = [e for e in read_events(tmp_path / "events") if isinstance(e, CellLifecycleEvent)]
    assert (failed.cell_index, failed.transition) == (2, "failed")


def test_a_cell_dying_between_calls_is_failed_at_once_and_its_peers_released(tmp_path):
    """No call is in flight: the death watch (the cell's lifeline) notices, not the next train call."""
    group = _group(tmp_path)
    group.cells[2].ranks[0].exit.remote()
    died = time.monotonic()
    while group.cells[2].state != CellState.STOPPED and time.monotonic() - died < 30:
        time.sleep(0.01)
    # Nothing else watches the cell here (no control plane, no call): only its lifeline can stop it.
    assert group.cells[2].state == CellState.STOPPED, time.monotonic() - died
    [failed] = [e for e in read_events(tmp_path / "events") if isinstance(e, CellLifecycleEvent)]
    assert (failed.cell_index, failed.transition, failed.by) == (2, "failed", "ActorDiedError")
    for survivor in (0, 1):  # quorum 0 is released: a survivor entering a collective on it gives up at once
        # The release is fire-and-forget on the heartbeat group: it may land just after the cell stops.
        assert _eventually_last_call(group.cells[survivor].ranks[0]) == ("release", 0)
    group.train([1])
    assert _reconfigures(tmp_path) == [(1, [], [0, 1])]


def _wait_until_dead(actor, timeout_s: float = 30.0) -> None:
    """A kill is asynchronous: a call sent right after it may still be answered."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.ping.remote(), timeout=timeout_s)
        except ray.exceptions.RayActorError:
            return
        time.sleep(0.02)
    pytest.fail("the killed actor still answers")


def _eventually_last_call(actor, timeout_s: float = 10.0):
    """The actor's last recorded call once it is a release, or whatever it is at the timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        last = ray.get(actor.get_calls.remote())[-1]
        if last[0] == "release" or time.monotonic() > deadline:
            return last
        time.sleep(0.02)


def test_a_retry_after_a_lost_cell_starts_at_once(tmp_path):
    group = _group(tmp_path, behaviour={0: "collective", 1: "collective", 2: "fail"}, retry_backoff_s=60.0)
    started = time.monotonic()
    group.train([0])  # attempt 0: cell 2 dies, the others are released and discard; attempt 1 shrinks and commits
    assert time.monotonic() - started < 30  # no 60 s back-off
    assert _reconfigures(tmp_path) == [(1, [], [0, 1])]
    assert ("train", 0, 1) in ray.get(group.cells[0].ranks[0].get_calls.remote())


def test_a_discarded_attempt_spends_its_quorum_and_backs_off(tmp_path):
    """Every cell answered but a reduce failed: no cell left, so the retry backs off, and it runs on a new
    quorum of the same cells (a rank's failed group is never reused)."""
    group = _group(tmp_path, behaviour={0: "discard_once"}, retry_backoff_s=1.0)
    started = time.monotonic()
    group.train([0])
    assert time.monotonic() - started >= 1.0
    assert _reconfigures(tmp_path) == [(1, [], [0, 1, 2])]
    assert ray.get(group.cells[1].ranks[0].get_calls.remote())[-2:] == [("reconfigure", 1, []), ("train", 0, 1)]
    group.train([1])  # committed on quorum 1: nothing to change
    assert len(_reconfigures(tmp_path)) == 1


def test_a_restarted_cell_takes_a_warm_spare_and_the_pool_is_refilled(tmp_path):
    """spare_cells=1: the spare starts with the cells; a restarted cell takes its ranks (no new actor), its
    heal says so, and the next commit starts a replacement; a spare that died waiting is passed over."""
    made = []  # (cell index or None for a spare, incarnation or spare number, handle) per rank actor started
    events = EventLogger(tmp_path / "events", ProcessIdentity(component="main"))
    group = TrainGroup(3, 1, lambda c, inc: made.append((c, inc, *_scripted(c))) or [made[-1][2]], events,
                       TrainerConfig(retry_backoff_s=0.01, spare_cells=1))
    _groups.append(group)
    group.init(load_rollout_id=None)
    assert [m[:2] for m in made] == [(0, 1), (1, 1), (2, 1), (None, 1)]
    spare = made[-1][2]
    assert ray.get(spare.ping.remote(), timeout=30)
    group.stop_cell(2, by="test")
    group.start_cell(2, by="test")
    assert len(made) == 4 and group.cells[2].ranks == [spare] and group.cells[2].incarnation == 2
    heal = group.refresh(1)
    assert (heal.healed_cell_indices, heal.spare_cell_indices) == ([2], [2])
    assert ray.get(spare.get_calls.remote())[0] == ("init", 1, 0)  # the spare's rank was healed from cell 0
    assert len(made) == 4  # not replaced during the heal ...
    group.train([1])
    assert ("train", 1, 0) in ray.get(spare.get_calls.remote())
    assert [m[:2] for m in made[4:]] == [(None, 2)]  # ... but after the commit
    replacement = made[-1][2]

    ray.get(replacement.ping.remote(), timeout=30)
    replacement.kill()  # the spare dies while waiting
    _wait_until_dead(replacement)
    group.stop_cell(1, by="test")
    group.start_cell(1, by="test")
    assert [m[:2] for m in made[5:]] == [(1, 2)]  # passed over: cell 1 starts new ranks instead
    heal = group.refresh(2)
    assert (heal.healed_cell_indices, heal.spare_cell_indices) == ([1], [])
    group.train([2])
    assert [m[:2] for m in made[6:]] == [(None, 3)]
    left_over = made[-1][2]
    group.shutdown()  # spares end with the group
    _wait_until_dead(left_over)


def test_without_spares_a_restarted_cell_starts_new_ranks(tmp_path):
    made = []
    events = EventLogger(tmp_path / "events", ProcessIdentity(component="main"))
    group = TrainGroup(2, 1, lambda c, inc: made.append((c, inc)) or _scripted(c), events,
                       TrainerConfig(retry_backoff_s=0.01))
    _groups.append(group)
    group.init(load_rollout_id=None)
    group.stop_cell(1, by="test")
    group.start_cell(1, by="test")
    heal = group.refresh(1)
    assert made == [(0, 1), (1, 1), (1, 2)] and (heal.healed_cell_indices, heal.spare_cell_indices) == ([1], [])


def _commits(tmp_path):
    """(rollout, attempt) of every committed step, in order."""
    return [(e.rollout_id, e.attempt) for e in read_events(tmp_path / "events") if isinstance(e, TrainGroupStepEndEvent)]




def test_a_run_of_rollouts_trains_in_one_call_per_rank(tmp_path):
    group = _group(tmp_path, n=2)
    commits = group.train([0, 1, 2])
    assert [(c.rollout_id, c.attempt) for c in commits] == _commits(tmp_path) == [(0, 0), (1, 0), (2, 0)]
    assert all(c.metrics == {"train/loss": 0.0} and c.step_s > 0 for c in commits), commits
    for cell in group.cells:
        assert ray.get(cell.ranks[0].get_runs.remote()) == [([0, 1, 2], 0)]
    assert not _reconfigures(tmp_path)


def test_a_rollout_that_does_not_commit_ends_the_attempt_and_the_rest_of_the_run_goes_on_at_the_next(tmp_path):
    """Cell 1 discards rollout 1 of the run 0..2: rollout 0 stands, and rollouts 1 and 2 train at attempt 1 on a
    new quorum. Cell 0, which committed rollout 1 and waits in rollout 2's collective for cell 1, is released at
    once (its scripted collective would wait 60 s)."""
    group = _group(tmp_path, n=2, behaviour={0: "collective@2", 1: "discard_once@1"}, retry_backoff_s=60.0)
    started = time.monotonic()
    commits = group.train([0, 1, 2])
    assert time.monotonic() - started < 30  # no back-off either: the run got on
    assert [(c.rollout_id, c.attempt) for c in commits] == _commits(tmp_path) == [(0, 0), (1, 1), (2, 1)]
    assert ray.get(group.cells[0].ranks[0].get_runs.remote()) == [([0, 1, 2], 0), ([1, 2], 1)]
    assert ("released", 2) in ray.get(group.cells[0].ranks[0].get_calls.remote())
    assert ray.get(group.cells[1].ranks[0].get_runs.remote()) == [([0, 1, 2], 0), ([1, 2], 1)]
    assert _reconfigures(tmp_path) == [(1, [], [0, 1])]  # the discarded attempt spent quorum 0


def test_each_rollout_of_a_run_gets_fresh_witness_ids_at_every_attempt(tmp_path):
    """The run 0..2 with witnesses: attempt 0 hands out ids for all three rollouts before any trains, and logs
    each allocation; cell 1 discards rollout 1, so attempt 1 gives rollouts 1 and 2 new ids (a retry's samples
    must be told from the discarded attempt's), and attempt 0's ids of rollout 2, never trained, are not reused."""
    samples = TrainerConfig().rollout.samples
    group = _group(tmp_path, n=2, behaviour={1: "discard_once@1"}, witness_allocator=WitnessIdAllocator(100 * samples))
    group.train([0, 1, 2])
    ids = lambda first, count: [list(range(first + k * samples, first + (k + 1) * samples)) for k in range(count)]
    for cell in group.cells:
        assert ray.get(cell.ranks[0].get_witness_ids.remote()) == [ids(0, 3), ids(3 * samples, 2)]
    allocations = [(e.rollout_id, e.attempt, sorted(e.witness_id_to_sample_index))
                   for e in read_events(tmp_path / "events") if isinstance(e, WitnessAllocateIdEvent)]
    assert allocations == [(0, 0, ids(0, 1)[0]), (1, 0, ids(samples, 1)[0]), (2, 0, ids(2 * samples, 1)[0]),
                           (1, 1, ids(3 * samples, 1)[0]), (2, 1, ids(4 * samples, 1)[0])]


def test_a_cell_dying_in_a_run_leaves_the_commits_before_it_and_the_retry_shrinks(tmp_path):
    """Cell 1 dies at rollout 1 of the run 0..2 while cell 0 waits for it in rollout 1's collective: rollout 0
    stands, and rollouts 1 and 2 commit at attempt 1 on cell 0 alone, at once (no back-off: the cause is known)."""
    group = _group(tmp_path, n=2, behaviour={0: "collective@1", 1: "fail@1"}, retry_backoff_s=60.0)
    started = time.monotonic()
    commits = group.train([0, 1, 2])
    assert time.monotonic() - started < 30
    assert [(c.rollout_id, c.attempt) for c in commits] == [(0, 0), (1, 1), (2, 1)]
    ends = [e for e in read_events(tmp_path / "events") if isinstance(e, TrainGroupStepEndEvent)]
    # The dead cell's call raised: it is "error" for the whole run, rollout 0 too, which it may have committed.
    assert [e.cell_outcomes for e in ends] == [{0: ["normal"], 1: "error"}, {0: ["normal"]}, {0: ["normal"]}]
    assert _reconfigures(tmp_path) == [(1, [], [0])]
