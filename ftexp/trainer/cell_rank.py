"""A cell's ranks on one node, as the driver sees them: one Ray actor, the ranks' address and supervisor.

The actor holds no model: it has one plain process per rank (``ftexp.trainer.rank``), forked by its
node's fork server (``ftexp.forkserver``), where the replica's shard lives and trains,
and forwards every call to it (``ftexp.trainer.rank_process``).
One actor serves all of a cell's ranks on its node because an idle Ray actor still costs about 1 %
of a core (its main thread checks for signals every 10 ms): a cell of four ranks pays that once,
not four times. The driver addresses each rank through a ``RankHandle``, as if it had an actor of
its own. A rank's process and its actor die together, so one rank's death ends the actor and its
node's other ranks of the cell with it — a cell fails as a whole anyway — and Ray reports the
death of every handle, as it would for the actor of each rank.
"""

from __future__ import annotations

import logging
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import ray

from ftexp.audit.witness import WitnessInfo
from ftexp.job import JobSpec
from ftexp.trainer.quorum import IndepDPInfo
from ftexp.trainer.rank_process import RankProcess
from ftexp.trainer.weight_order import WeightPush

log = logging.getLogger(__name__)


# Heartbeats, releases, fault injection and the lifeline get their own concurrency groups, so they
# are served while a training call is blocked (e.g. in a collective waiting for a dead peer). The
# default group, the training calls', has a thread per hosted rank (``host_ranks``): the ranks of a
# cell train together. The other groups have one thread: their calls are quick, and a rank frozen
# in one holds up only its own cell's, which the control plane then fails as a whole. A lifeline
# queued behind another still fails when the actor dies.
@ray.remote(num_cpus=0, max_restarts=0, concurrency_groups={"heartbeat": 1, "fault_injector": 1, "lifeline": 1})
class CellRanks:
    """Ranks ``ranks`` of cell ``cell_index`` in its ``incarnation``, or of warm spare number
    ``incarnation`` when ``cell_index`` is None (they learn their cell from their first ``init``).
    Returns from construction once every rank's process has built its part of the replica (together:
    a multi-rank replica's ranks meet in their own world while they build)."""

    def __init__(self, spec: JobSpec, cell_index: int | None, ranks: list[int], store_addr: str,
                 incarnation: int = 0):
        name = f"cell{cell_index}" if cell_index is not None else f"spare{incarnation}"
        logging.basicConfig(level=logging.INFO, stream=sys.stdout, force=True,
                            format=f"[%(asctime)s] {name}/ranks{','.join(map(str, ranks))} actor %(name)s: "
                                   "%(message)s", datefmt="%H:%M:%S")
        node_ip = ray.util.get_node_ip_address()
        self.processes = {r: RankProcess(ranks_in_actor=len(ranks)) for r in ranks}
        with ThreadPoolExecutor(len(ranks)) as pool:
            list(pool.map(lambda r: self.processes[r].build(spec, cell_index, r, store_addr, incarnation, node_ip),
                          ranks))

    @ray.method(concurrency_group="heartbeat")
    def ping(self, rank: int) -> bool:
        return self.processes[rank].ask_control("ping")

    @ray.method(concurrency_group="heartbeat")
    def heartbeat(self, rank: int) -> dict[str, float]:
        """Liveness is "this RPC returned" (the rank's process answered); the payload says when it last worked."""
        return self.processes[rank].ask_control("heartbeat")

    @ray.method(concurrency_group="heartbeat")
    def release_collectives(self, rank: int, quorum_id: int) -> None:
        """A member of quorum ``quorum_id`` died: every cross-cell wait on that quorum gives up, now and later."""
        self.processes[rank].ask_control("release_collectives", quorum_id)

    @ray.method(concurrency_group="fault_injector")
    def inject_fault(self, rank: int, mode: str) -> None:
        """Fail the rank's process in the given way (``ftexp.control.failure_modes``); the actor follows."""
        self.processes[rank].inject_fault(mode)

    @ray.method(concurrency_group="lifeline")
    def lifeline(self, rank: int) -> None:
        """Never returns: the driver's pending call on it fails the moment this process dies."""
        threading.Event().wait()

    def init(self, rank: int, info: IndepDPInfo, load_rollout_id: int | None,
             recv_src_rank: int | None) -> dict[str, Any]:
        return self.processes[rank].call("init", info, load_rollout_id, recv_src_rank)

    def reconfigure(self, rank: int, info: IndepDPInfo, send_to: list[int]) -> dict[str, Any]:
        return self.processes[rank].call("reconfigure", info, send_to)

    def train(self, rank: int, rollout_ids: list[int], attempt: int,
              witnesses: list[WitnessInfo] | None) -> list[tuple[str, dict[str, float] | None, float]]:
        return self.processes[rank].call("train", rollout_ids, attempt, witnesses)

    def update_weights(self, rank: int, order: WeightPush) -> dict[str, str] | None:
        return self.processes[rank].call("update_weights", order)

    def save(self, rank: int, rollout_id: int) -> None:
        self.processes[rank].call("save", rollout_id)


def host_ranks(spec: JobSpec, cell_index: int | None, ranks: list[int], store_addr: str, incarnation: int,
               **options: Any) -> list[RankHandle]:
    """Start one ``CellRanks`` actor for ``ranks`` (Ray ``options`` place it); a handle per rank."""
    actor = CellRanks.options(max_concurrency=len(ranks), **options).remote(spec, cell_index, ranks, store_addr,
                                                                            incarnation)
    return [RankHandle(actor, r) for r in ranks]


class RankHandle:
    """One rank of an actor that hosts several, called as if it were an actor of its own:
    ``handle.train.remote(...)`` is ``actor.train.remote(rank, ...)``. ``actor`` is the Ray handle
    that ``ray.kill`` and ``__ray_call__`` take; killing it ends its other ranks too."""

    def __init__(self, actor: Any, rank: int):
        self.actor, self.rank = actor, rank

    def kill(self) -> None:
        """End the actor, and with it every rank it hosts (never restarted)."""
        ray.kill(self.actor, no_restart=True)

    def __getattr__(self, method: str) -> _RankMethod:
        if method.startswith("_"):  # not a call: keeps copy, pickle and the like from forwarding
            raise AttributeError(method)
        return _RankMethod(getattr(self.actor, method), self.rank)


class _RankMethod:
    def __init__(self, method: Any, rank: int):
        self.method, self.rank = method, rank

    def remote(self, *args: Any, **kwargs: Any) -> ray.ObjectRef:
        return self.method.remote(self.rank, *args, **kwargs)
