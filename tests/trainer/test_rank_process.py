"""A node's rank host and the plain processes its ranks train in.

Real rank hosts (torch engine) on a local Ray: each rank's replica is in a child process of the
node's fork server, with no Ray inside; a call's error comes back as itself. A rank's process that
ends, whatever ended it, takes its team (a cell incarnation's ranks on the node) with it and nothing
else: the host goes on serving the other teams, even beside a frozen rank. The host's death ends all
of its ranks' processes.
"""

import os
import time
from multiprocessing.connection import Pipe

import pytest
import ray
import psutil  # noqa: E402  (Ray ships psutil and puts it on sys.path)

from ftexp.config import Engine, ModeConfig, TrainerConfig
from ftexp.faults.plan import FaultPlan
from ftexp.job import JobSpec
from ftexp.errors import RunDirError
from ftexp.rundir import SideDir
from ftexp.store import LoopbackStore
from ftexp.trainer.quorum import IndepDPInfo
from ftexp.placement import Placement
from ftexp.trainer.cell_rank import RankHandle, start_host
from ftexp.trainer.nodes import RankHosts
from ftexp.trainer.rank_process import RANK_PRELOAD, WHERE, RankProcessEnded
from ftexp.trainer.local_ray import start_local_ray
from ftexp.forkserver import answer, forkserver
from ftexp.trainer.weight_order import WeightPush

DIES_WITHIN_S = 30.0


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    with forkserver(RANK_PRELOAD) as address:  # the ranks' processes fork from it
        start_local_ray(num_cpus=2)
        yield address
        ray.shutdown()


def _spec(tmp_path) -> JobSpec:
    return JobSpec(side="target", phase="", side_dir=SideDir(tmp_path), data_dir=tmp_path / "data",
                   trainer=TrainerConfig(engine=Engine.torch, enable_witness=False),
                   mode=ModeConfig(name="dp1", num_cells=1), num_rollout=1, plan=FaultPlan([], 1))


@pytest.fixture
def host():
    """A rank host for up to four ranks at once, killed after the test (its ranks' processes with it)."""
    actor = start_host("node0", 4, 4)
    yield actor
    ray.kill(actor, no_restart=True)


def _team(host, tmp_path, team: str, ranks: list[int]):
    """Handles for ``ranks`` of a new team on ``host`` (torch engine: each rank builds a replica of its own), and
    the store they rendezvous on, which the caller keeps alive."""
    store = LoopbackStore()
    host.start.remote(team, _spec(tmp_path / team), 0, ranks, store.address, 0)
    handles = [RankHandle(host, team, r) for r in ranks]
    ray.get([h.ping.remote() for h in handles], timeout=120)
    return handles, store


@pytest.fixture
def rank(host, tmp_path):
    [handle], _store = _team(host, tmp_path, "cell0.inc1", [0])  # the store lives as long as this frame
    yield handle
    handle.kill()


def _host_and_children(handle) -> tuple[psutil.Process, list[psutil.Process]]:
    """The host's process and the processes of the handle's team, in rank order."""
    host_pid, pids = ray.get(handle.host.__ray_call__.remote(
        lambda host, team: (os.getpid(), [host._teams[team].processes[r].child.pid
                                          for r in sorted(host._teams[team].processes)]), handle.team))
    return psutil.Process(host_pid), [psutil.Process(pid) for pid in pids]


def _processes(handle) -> tuple[psutil.Process, psutil.Process]:
    """The host's process and the rank's process (its team's only one)."""
    host, [child] = _host_and_children(handle)
    return host, child


def _dead(process: psutil.Process, within_s: float = DIES_WITHIN_S) -> bool:
    try:
        process.wait(timeout=within_s)
        return True
    except psutil.TimeoutExpired:
        return False


def _stops_answering(handle, within_s: float = DIES_WITHIN_S, call=None) -> bool:
    """Whether the rank stops answering ``call`` (its heartbeat by default) within ``within_s`` (an injected
    fault lands when the rank's control thread gets the GIL: on a loaded machine, after a few more answers)."""
    call = call or handle.heartbeat.remote
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            ray.get(call(), timeout=1.0)
        except ray.exceptions.GetTimeoutError:
            return True
        time.sleep(0.1)
    return False


def test_the_replica_lives_in_a_process_forked_by_the_fork_server_without_ray(rank):
    actor, child = _processes(rank)
    server = psutil.Process(child.ppid())
    assert "ftexp.forkserver" in " ".join(server.cmdline()) and server.ppid() == os.getpid()
    modules = {m.path for m in child.memory_maps()}
    assert not any("_raylet" in path for path in modules), "Ray is loaded into the process that trains"
    assert any("_raylet" in path for path in {m.path for m in actor.memory_maps()})
    # The actor process never imported torch: it holds no model.
    assert not any("libtorch_cpu" in path for path in {m.path for m in actor.memory_maps()})
    assert any("libtorch_cpu" in path for path in modules)
    beat = ray.get(rank.heartbeat.remote(), timeout=30)
    assert set(beat) == {"last_active_timestamp", "bump_count"}


def test_a_calls_error_comes_back_as_itself(rank):
    # Quorum 0 of a one-cell group, then a train call for a rollout whose file does not exist.
    info = IndepDPInfo.for_cell(0, 1, 0, [0])
    assert ray.get(rank.init.remote(info, None, None), timeout=60)["ok"]
    with pytest.raises(ray.exceptions.RayTaskError) as raised:
        ray.get(rank.train.remote([0], 0, None), timeout=60)
    assert isinstance(raised.value.cause, RunDirError)
    assert "rollout file not found" in str(raised.value)
    assert "in the rank's process" in str(raised.value)
    assert ray.get(rank.ping.remote(), timeout=30)  # the rank lives on after a failed call


def test_the_actor_only_forwards_and_never_imports_torch(rank):
    # Were a call's argument or answer to pull torch into the actor, that import would hold the actor's GIL
    # for seconds and stall the heartbeats and faults it serves beside the call.
    info = IndepDPInfo.for_cell(0, 1, 0, [0])
    assert ray.get(rank.init.remote(info, None, None), timeout=60)["ok"]
    # The torch engine exports no HF weights, so the push fails in the rank's process: after the actor
    # unpickled the order, which is what matters here.
    order = WeightPush(rollout_id=None, group_name="unsent", engine_urls=(), send=False)
    with pytest.raises(ray.exceptions.RayTaskError, match="export_hf"):
        ray.get(rank.update_weights.remote(order), timeout=60)
    ray.get(rank.save.remote(0), timeout=60)
    assert ray.get(rank.heartbeat.remote(), timeout=30)["bump_count"] >= 0
    actor, _ = _processes(rank)
    assert not any("libtorch_cpu" in m.path for m in actor.memory_maps()), "a call pulled torch into the actor"


class EngineRefused(Exception):
    """An error whose module (this test's) the actor has not imported, as torch's or the engine client's."""


def _raise(error: Exception):
    raise error


@pytest.mark.parametrize("error, arrives_as, says", [
    (RunDirError("rollout file not found"), RunDirError, "rollout file not found"),
    (ValueError("bad order"), ValueError, "bad order"),
    (EngineRefused("engine 2 refused"), RuntimeError, "test_rank_process.EngineRefused: engine 2 refused"),
])
def test_an_error_reaches_the_actor_as_a_type_it_holds(error, arrives_as, says):
    actor_end, rank_end = Pipe()
    answer(rank_end, lambda: _raise(error), WHERE)
    kind, sent = actor_end.recv()
    assert kind == "error" and type(sent) is arrives_as and says in str(sent)
    assert "in the rank's process" in (str(sent) + "".join(getattr(sent, "__notes__", [])))


def _ended_with_its_team(call) -> None:
    """``call()``'s result raises ``RankProcessEnded`` (the host answers for the rank: its process has ended)."""
    with pytest.raises(ray.exceptions.RayTaskError) as raised:
        ray.get(call(), timeout=DIES_WITHIN_S)
    assert isinstance(raised.value.cause, RankProcessEnded), raised.value


@pytest.mark.parametrize("mode", ["sigkill", "exit", "segfault"])
def test_a_rank_process_that_dies_fails_its_lifeline_and_the_host_serves_on(rank, host, tmp_path, mode):
    [other], _store = _team(host, tmp_path, "cell1.inc1", [0])
    host_process, child = _processes(rank)
    lifeline = rank.lifeline.remote()
    rank.inject_fault.remote(mode)
    assert _dead(child), f"the rank's process survived an injected {mode}"
    _ended_with_its_team(lambda: lifeline)
    _ended_with_its_team(rank.ping.remote)  # and every call after it
    assert host_process.is_running(), "the host died with one of its ranks"
    assert set(ray.get(other.heartbeat.remote(), timeout=30)) == {"last_active_timestamp", "bump_count"}
    other.kill()


def test_a_frozen_rank_holds_up_no_other_team_and_dies_when_killed(rank, host, tmp_path):
    [other], _store = _team(host, tmp_path, "cell1.inc1", [0])
    host_process, child = _processes(rank)
    rank.inject_fault.remote("deadlock")
    assert _stops_answering(rank), "the frozen rank's heartbeat kept answering"
    # Its unanswered heartbeats hold some of the host's threads; the other team's are answered meanwhile.
    for _ in range(3):
        ray.get(other.heartbeat.remote(), timeout=10)
    assert child.is_running()
    rank.kill()
    assert _dead(child), "the frozen rank's process outlived its kill"
    _ended_with_its_team(rank.heartbeat.remote)
    assert host_process.is_running()
    ray.get(other.save.remote(0), timeout=60)
    other.kill()


def test_a_team_of_two_trains_each_beside_the_other_and_dies_with_either(host, tmp_path):
    handles, _store = _team(host, tmp_path, "cell0.inc1", [0, 1])
    first, second = handles
    host_process, children = _host_and_children(first)
    assert len(children) == 2
    assert [set(beat) for beat in ray.get([h.heartbeat.remote() for h in handles], timeout=30)] == \
        [{"last_active_timestamp", "bump_count"}] * 2
    # Rank 0 frozen in a call holds one of the host's training threads; rank 1's calls go on.
    first.inject_fault.remote("deadlock")
    assert _stops_answering(first, call=lambda: first.save.remote(0))
    ray.get(second.save.remote(0), timeout=60)
    lifelines = [h.lifeline.remote() for h in handles]
    second.inject_fault.remote("exit")
    assert all(_dead(child) for child in children), "a rank's process outlived its teammate's"
    for lifeline in lifelines:
        _ended_with_its_team(lambda: lifeline)
    assert host_process.is_running()


def test_the_host_ends_its_ranks_processes_when_it_dies(rank, host, tmp_path):
    host_process, child = _processes(rank)
    lifeline = rank.lifeline.remote()
    ray.kill(host, no_restart=True)
    assert _dead(host_process) and _dead(child), "a rank's process outlived its host"
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(lifeline, timeout=DIES_WITHIN_S)


def test_the_driver_starts_another_host_once_a_node_s_host_is_gone(tmp_path):
    store = LoopbackStore()
    hosts = RankHosts(_spec(tmp_path), store.address, Placement.single_node(2, 1), 0, pinned=False)
    try:
        [first] = hosts.team(0, 1)
        assert ray.get(first.ping.remote(), timeout=120)
        [second] = hosts.team(1, 1)
        assert second.host == first.host  # one host per node
        ray.kill(first.host, no_restart=True)
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(first.ping.remote(), timeout=DIES_WITHIN_S)
        [again] = hosts.team(0, 2)
        assert again.host != first.host and ray.get(again.ping.remote(), timeout=120)
    finally:
        hosts.shutdown()
