"""A cell lost during a heal: the survivors leave the new quorum's rendezvous at once, and the retry heals.

Real ranks on a real rank host (torch engine, one rank per cell) on a real TCPStore: cells 0 and 1 are
alive, cell 2 is healed from cell 0, and cell 1 freezes just before the reconfigure, so cells 0
and 2 sit in quorum 1's rendezvous waiting for it. The control plane would then suspend cell 1;
the test does so by hand and measures how long the survivors take to come back.
"""

import threading
import time

import pytest
import ray

from ftexp.audit.events import CellLifecycleEvent, CellReconfigureEvent, EventLogger, ProcessIdentity, read_events
from ftexp.config import ControlConfig, Engine, ModeConfig, TrainerConfig
from ftexp.control.train_cells import ControlPlane
from ftexp.faults.plan import FaultPlan
from ftexp.job import JobSpec
from ftexp.rundir import SideDir
from ftexp.trainer.cell import CellState
from ftexp.placement import Placement
from ftexp.trainer.nodes import RankHosts
from ftexp.trainer.local_ray import start_local_ray
from ftexp.forkserver import forkserver
from ftexp.trainer.rank_process import RANK_PRELOAD
from ftexp.trainer.group import RetryableStepError, TrainGroup
from ftexp.store import LoopbackStore

CROSS_CELL_TIMEOUT_S = 120.0  # what the survivors would wait without the release
FROZEN_FOR_S = 2.0           # how long the survivors wait in the rendezvous before the frozen cell is suspended


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    with forkserver(RANK_PRELOAD):  # the ranks' processes fork from it
        start_local_ray(num_cpus=3)
        yield
        ray.shutdown()


def _group(tmp_path) -> TrainGroup:
    spec = JobSpec(side="target", phase="", side_dir=SideDir(tmp_path), data_dir=tmp_path / "data",
                   trainer=TrainerConfig(engine=Engine.torch, enable_witness=False,
                                         cross_cell_timeout_s=CROSS_CELL_TIMEOUT_S),
                   mode=ModeConfig(name="dp3", num_cells=3), num_rollout=1, plan=FaultPlan([], 3))
    store = LoopbackStore()
    events = EventLogger(spec.side_dir.events, ProcessIdentity(component="main"))
    hosts = RankHosts(spec, store.address, Placement.single_node(3, 1), 0, pinned=False)
    group = TrainGroup(3, 1, hosts.team, events, spec.trainer)
    group.store, group.hosts = store, hosts  # keep the rendezvous store and the host alive as long as the group
    group.init(load_rollout_id=None)
    return group


def _freezes(actor, within_s: float = 30.0) -> bool:
    """Whether the actor stops answering heartbeats within ``within_s``.

    The fault lands on another thread of the actor when that thread gets the GIL, which on a loaded
    machine can come after many quick heartbeats: so the wait is bounded by time, not by a count.
    """
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.heartbeat.remote(), timeout=1.0)
        except ray.exceptions.GetTimeoutError:
            return True
        time.sleep(0.1)
    return False


def test_a_cell_lost_mid_heal_releases_the_survivors_at_once_and_the_retry_heals(tmp_path, caplog):
    group = _group(tmp_path)
    try:
        group.stop_cell(2, by="test")
        group.start_cell(2, by="test")  # cell 2 pending: the next refresh heals it from cell 0
        healing_incarnation = group.cells[2].incarnation
        group.cells[1].ranks[0].inject_fault.remote("deadlock")
        assert _freezes(group.cells[1].ranks[0])  # it will never join quorum 1

        suspended_at = []

        def suspend_frozen_cell() -> None:
            time.sleep(FROZEN_FOR_S)
            suspended_at.append(time.monotonic())
            group.stop_cell(1, by="test")  # what the control plane does once heartbeats fail

        threading.Thread(target=suspend_frozen_cell, daemon=True).start()
        started = time.monotonic()
        with pytest.raises(RetryableStepError, match="quorum 1 failed"):
            group.refresh(rollout_id=1)
        returned = time.monotonic()
        assert returned - started >= FROZEN_FOR_S  # the survivors really were stuck in the rendezvous
        released_after = returned - suspended_at[0]
        print(f"survivors released {released_after:.3f} s after the driver stopped the lost cell")
        # The proof is the cause each survivor gives, not a time: on a loaded host the release has
        # taken 16 s. Without the release they would leave with the rendezvous timeout's error.
        released = {r.args[0] for r in caplog.records
                    if "could not join quorum" in r.msg and "released by the driver" in str(r.args[-1])}
        assert released == {0, 2}, caplog.text
        assert released_after < CROSS_CELL_TIMEOUT_S / 2, released_after

        # The retry forms quorum 2 with who is left and heals the same (not restarted) incarnation of cell 2.
        heal = group.refresh(rollout_id=1)
        assert (heal.quorum_id, heal.src_cell_index, heal.healed_cell_indices, heal.alive_cell_indices_after) == \
            (2, 0, [2], [0, 2])
        assert heal.bytes_transferred > 0 and heal.transfer_connections == 1  # one rank per cell here
        assert group.cells[2].incarnation == healing_incarnation and group.cells[2].state == CellState.ALIVE
        assert group.cells[1].state == CellState.STOPPED
        assert group.refresh(rollout_id=1) is None
        events = read_events(tmp_path / "events")
        assert [e.quorum_id for e in events if isinstance(e, CellReconfigureEvent)] == [2]
        assert [(e.cell_index, e.transition) for e in events if isinstance(e, CellLifecycleEvent)] == \
            [(2, "stopped"), (2, "start_requested"), (1, "stopped")]
    finally:
        group.shutdown()
        group.hosts.shutdown()


def test_the_control_plane_finds_a_cell_that_freezes_before_a_heal_and_the_heal_goes_on(tmp_path):
    """As above, with no hand on the frozen cell: its missed heartbeats get it suspended mid-reconfigure.

    Checkers paused for the whole reconfigure (all of them) would leave the heal waiting for the frozen
    cell's call forever."""
    group = _group(tmp_path)
    cfg = ControlConfig(enabled=True, heartbeat_interval_s=0.5, heartbeat_timeout_s=1.0, heartbeat_first_wait_s=0.5,
                        heartbeat_failure_threshold=2, controller_poll_interval_s=0.5,
                        controller_resume_delay_s=30.0)  # the frozen cell stays suspended through the test
    plane = ControlPlane(group, cfg)
    group.health = plane
    plane.start()
    try:
        group.stop_cell(2, by="test")
        group.start_cell(2, by="test")
        group.cells[1].ranks[0].inject_fault.remote("deadlock")
        assert _freezes(group.cells[1].ranks[0])

        outcome = []

        def heal() -> None:
            try:
                outcome.append(group.refresh(rollout_id=1))
            except RetryableStepError as e:
                outcome.append(e)

        refresh = threading.Thread(target=heal, daemon=True)
        refresh.start()
        refresh.join(60.0)  # detection is ~3 s here; the frozen cell's call alone never returns
        assert outcome, "the heal still waits for the frozen cell"
        assert isinstance(outcome[0], RetryableStepError) and "quorum 1 failed" in str(outcome[0])
        assert group.cells[1].state == CellState.STOPPED

        heal = group.refresh(rollout_id=1)
        assert (heal.src_cell_index, heal.healed_cell_indices, heal.alive_cell_indices_after) == (0, [2], [0, 2])
        lifecycle = [(e.cell_index, e.transition, e.by) for e in read_events(tmp_path / "events")
                     if isinstance(e, CellLifecycleEvent)]
        assert (1, "stopped", "control_plane") in lifecycle, lifecycle
    finally:
        plane.stop()
        group.shutdown()
        group.hosts.shutdown()
