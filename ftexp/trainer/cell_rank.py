"""The ranks on one node, as the driver sees them: one Ray actor per node, the rank host, serves them all.

The host holds no model: it has one plain process per rank (``ftexp.trainer.rank``), forked by its
node's fork server (``ftexp.forkserver``), where the replica's shard lives and trains, and forwards
every call to it (``ftexp.trainer.rank_process``). One actor serves every rank on its node because
an idle Ray actor still costs about 1 % of a core and wakes a hundred times a second (its main
thread checks for signals every 10 ms), taking a core from a rank each time: four one-rank cells
paid that four times when each had its own actor.

Ranks come and go in teams: a team is a cell incarnation's ranks on the node, or a warm spare's. A
team starts together (``start``, in the background: the driver's next call on one of its ranks waits
for it), dies together (when one of its processes ends, the host kills the others: a cell fails as a
whole anyway) and is killed together (``kill``). The driver addresses each rank through a
``RankHandle``, as if it had an actor of its own: a call on a rank whose process has ended raises
``RankProcessEnded``, and its ``lifeline`` call raises it the moment the process ends. A host dies
only with its node or the driver's Ray; then every call on its ranks fails with Ray's actor-death
error, as it would for an actor per rank.
"""

from __future__ import annotations

import functools
import logging
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import ray

from ftexp.audit.witness import WitnessInfo
from ftexp.job import JobSpec
from ftexp.trainer.quorum import IndepDPInfo
from ftexp.trainer.rank_process import RankProcess, RankProcessEnded
from ftexp.trainer.weight_order import WeightPush

log = logging.getLogger(__name__)

# Threads per hosted rank in each of the host's concurrency groups. A call on a frozen rank holds its
# thread until the rank is killed, and a frozen rank collects a few (its missed heartbeats, a
# release, its training call); the rest of the node's ranks must still be served meanwhile.
THREADS_PER_RANK = 4


class Team:
    """A team's rank processes on this host, once built (``built``); ``error``: why its start failed."""

    def __init__(self) -> None:
        self.processes: dict[int, RankProcess] = {}
        self.built = threading.Event()
        self.error: Exception | None = None
        self.killed = False


# Heartbeats, releases and fault injection are in "control", kills in "kill", lifelines in "lifeline"
# and team starts in "start", so each is served while training calls are blocked (e.g. in a collective
# waiting for a dead peer), and a kill while a frozen rank's unanswered calls hold control threads.
# ``start_host`` sizes every group.
class RankHost:
    """Every rank on one node: ``node_name`` names it in the log; ``ranks_sharing`` is how many ranks train on
    it at once (its cells' ranks), whose processes share the host's CPU in their accounting."""

    def __init__(self, node_name: str, ranks_sharing: int):
        logging.basicConfig(level=logging.INFO, stream=sys.stdout, force=True,
                            format=f"[%(asctime)s] {node_name} rank host %(name)s: %(message)s", datefmt="%H:%M:%S")
        self.ranks_sharing = ranks_sharing
        self._teams: dict[str, Team] = {}
        self._gone: dict[str, str] = {}  # team -> how it ended, once every process of it has
        self._changed = threading.Condition()  # guards both; notified when a team is added

    @ray.method(concurrency_group="start")
    def start(self, team: str, spec: JobSpec, cell_index: int | None, ranks: list[int], store_addr: str,
              incarnation: int) -> None:
        """Start ``team``: ranks ``ranks`` of cell ``cell_index`` in its ``incarnation``, or of warm spare number
        ``incarnation`` when ``cell_index`` is None (they learn their cell from their first ``init``). Returns
        once every rank's process has built its part of the replica (together: a multi-rank replica's ranks
        meet in their own world while they build); on a failure the team's processes are killed."""
        members = Team()
        with self._changed:
            assert team not in self._teams, f"team {team} started twice"
            self._teams[team] = members
            self._changed.notify_all()
        node_ip = ray.util.get_node_ip_address()
        try:
            for r in ranks:
                if members.killed:
                    raise RankProcessEnded(f"team {team} was killed while it started")
                members.processes[r] = RankProcess(self.ranks_sharing,
                                                   lambda how, r=r: self._ended(team, members, r, how))
            with ThreadPoolExecutor(len(ranks)) as pool:
                list(pool.map(lambda r: members.processes[r].build(spec, cell_index, r, store_addr, incarnation,
                                                                   node_ip), ranks))
        except Exception as e:
            members.error = e
            self.kill(team)
            raise
        finally:
            members.built.set()

    @ray.method(concurrency_group="kill")
    def kill(self, team: str) -> None:
        """SIGKILL every process of ``team`` (a no-op for those already ended), frozen ones too."""
        members = self._teams.get(team)
        if members is None:
            return
        members.killed = True
        for process in list(members.processes.values()):
            process.kill()

    def _ended(self, team: str, members: Team, rank: int, how: str) -> None:
        """One of ``team``'s processes ended: the others end too. A team whose every process has ended is kept
        only as its name and how it ended; its processes' pipes close once no call holds them."""
        log.warning("team %s: rank %d's process ended (%s)%s", team, rank, how,
                    "" if members.killed else "; killing its team's other ranks")
        self.kill(team)
        with self._changed:
            if (self._teams.get(team) is members and members.built.is_set()
                    and all(p.ended.is_set() for p in members.processes.values())):
                self._gone[team] = f"rank {rank}'s process last, {how}"
                del self._teams[team]

    def _process(self, team: str, rank: int) -> RankProcess:
        """``rank`` of ``team``, once the team has started; ``RankProcessEnded`` if its process has ended or the
        team failed to start."""
        with self._changed:
            self._changed.wait_for(lambda: team in self._teams or team in self._gone)
            if team in self._gone:
                raise RankProcessEnded(f"team {team} has ended ({self._gone[team]})")
            members = self._teams[team]
        members.built.wait()
        if members.error is not None:
            raise RankProcessEnded(f"team {team} did not start: {members.error}")
        process = members.processes[rank]
        if process.ended.is_set():
            raise process.ended_error()
        return process

    @ray.method(concurrency_group="control")
    def ping(self, team: str, rank: int) -> bool:
        return self._process(team, rank).ask_control("ping")

    @ray.method(concurrency_group="control")
    def heartbeat(self, team: str, rank: int) -> dict[str, float]:
        """Liveness is "this RPC returned" (the rank's process answered); the payload says when it last worked."""
        return self._process(team, rank).ask_control("heartbeat")

    @ray.method(concurrency_group="control")
    def release_collectives(self, team: str, rank: int, quorum_id: int) -> None:
        """A member of quorum ``quorum_id`` died: every cross-cell wait on that quorum gives up, now and later."""
        self._process(team, rank).ask_control("release_collectives", quorum_id)

    @ray.method(concurrency_group="control")
    def inject_fault(self, team: str, rank: int, mode: str) -> None:
        """Fail the rank's process in the given way (``ftexp.control.failure_modes``); its team follows."""
        self._process(team, rank).inject_fault(mode)

    @ray.method(concurrency_group="lifeline")
    def until_gone(self) -> None:
        """Never returns: the driver's pending call on it fails when the host dies (with its node)."""
        threading.Event().wait()

    @ray.method(concurrency_group="lifeline")
    def lifeline(self, team: str, rank: int) -> None:
        """Raises ``RankProcessEnded`` once the rank's process has ended, never returns before: the driver's
        pending call on it fails the moment the process dies."""
        process = self._process(team, rank)
        process.ended.wait()
        raise process.ended_error()

    def init(self, team: str, rank: int, info: IndepDPInfo, load_rollout_id: int | None,
             recv_src_rank: int | None) -> dict[str, Any]:
        return self._process(team, rank).call("init", info, load_rollout_id, recv_src_rank)

    def reconfigure(self, team: str, rank: int, info: IndepDPInfo, send_to: list[int]) -> dict[str, Any]:
        return self._process(team, rank).call("reconfigure", info, send_to)

    def train(self, team: str, rank: int, rollout_ids: list[int], attempt: int,
              witnesses: list[WitnessInfo] | None) -> list[tuple[str, dict[str, float] | None, float]]:
        return self._process(team, rank).call("train", rollout_ids, attempt, witnesses)

    def update_weights(self, team: str, rank: int, order: WeightPush) -> dict[str, str] | None:
        return self._process(team, rank).call("update_weights", order)

    def save(self, team: str, rank: int, rollout_id: int) -> None:
        self._process(team, rank).call("save", rollout_id)


def start_host(node_name: str, ranks_sharing: int, ranks_at_once: int, **options: Any) -> Any:
    """A new ``RankHost`` actor (Ray ``options`` place it) for teams that hold at most ``ranks_at_once`` ranks at a
    time, ``ranks_sharing`` of them training at once."""
    return _host_class(THREADS_PER_RANK * ranks_at_once).options(**options).remote(node_name, ranks_sharing)


@functools.cache
def _host_class(threads: int) -> Any:
    """``RankHost`` as a Ray actor class with ``threads`` threads per group (Ray sizes the groups per class, not
    per actor)."""
    return ray.remote(num_cpus=0, max_restarts=0, max_concurrency=threads,  # the training calls'
                      concurrency_groups={"control": threads, "kill": threads, "lifeline": threads + 1,
                                          "start": threads})(RankHost)


class RankHandle:
    """One rank of a team on a host, called as if it were an actor of its own: ``handle.train.remote(...)`` is
    ``host.train.remote(team, rank, ...)``. ``host`` is the Ray handle of the node's host."""

    def __init__(self, host: Any, team: str, rank: int):
        self.host, self.team, self.rank = host, team, rank

    def kill(self) -> None:
        """End the rank's process, and with it its team's other ranks on the node (fire and forget)."""
        self.host.kill.remote(self.team)

    def __getattr__(self, method: str) -> _RankMethod:
        if method.startswith("_"):  # not a call: keeps copy, pickle and the like from forwarding
            raise AttributeError(method)
        return _RankMethod(getattr(self.host, method), self.team, self.rank)


class _RankMethod:
    def __init__(self, method: Any, team: str, rank: int):
        self.method, self.team, self.rank = method, team, rank

    def remote(self, *args: Any, **kwargs: Any) -> ray.ObjectRef:
        return self.method.remote(self.team, self.rank, *args, **kwargs)
