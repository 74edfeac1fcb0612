"""One rank of a cell, as the driver sees it: a Ray actor that is the rank's address and supervisor.

The actor holds no model: it starts the rank's own process (``ftexp.trainer.rank``), where the
replica lives and trains, and forwards every call to it (``ftexp.trainer.rank_process``). The two
die together, so the actor's death is the rank's death, reported by Ray as before. The actor is
placed by Ray (on its cell's node, in a multi-node job), and the rank's process runs beside it.
"""

from __future__ import annotations

import logging
import sys
import threading
from typing import Any

import ray

from ftexp.audit.witness import WitnessInfo
from ftexp.job import JobSpec
from ftexp.trainer.quorum import IndepDPInfo
from ftexp.trainer.rank_process import RankProcess
from ftexp.trainer.weight_order import WeightPush

log = logging.getLogger(__name__)


# Heartbeats, releases, fault injection and the lifeline get their own concurrency groups, so they
# are served while a training call is blocked (e.g. in a collective waiting for a dead peer).
@ray.remote(num_cpus=0, max_restarts=0, concurrency_groups={"heartbeat": 1, "fault_injector": 1, "lifeline": 1})
class CellRank:
    """Rank ``rank_within_cell`` of cell ``cell_index`` in its ``incarnation``, or of warm spare number
    ``incarnation`` when ``cell_index`` is None (it learns its cell from its first ``init``).
    Returns from construction once the rank's process has built its replica."""

    def __init__(self, spec: JobSpec, cell_index: int | None, rank_within_cell: int, store_addr: str,
                 incarnation: int = 0):
        name = f"cell{cell_index}" if cell_index is not None else f"spare{incarnation}"
        logging.basicConfig(level=logging.INFO, stream=sys.stdout, force=True,
                            format=f"[%(asctime)s] {name}/rank{rank_within_cell} actor %(name)s: %(message)s",
                            datefmt="%H:%M:%S")
        self.process = RankProcess((spec, cell_index, rank_within_cell, store_addr, incarnation,
                                    ray.util.get_node_ip_address()))

    @ray.method(concurrency_group="heartbeat")
    def ping(self) -> bool:
        return self.process.ask_control("ping")

    @ray.method(concurrency_group="heartbeat")
    def heartbeat(self) -> dict[str, float]:
        """Liveness is "this RPC returned" (the rank's process answered); the payload says when it last worked."""
        return self.process.ask_control("heartbeat")

    @ray.method(concurrency_group="heartbeat")
    def release_collectives(self, quorum_id: int) -> None:
        """A member of quorum ``quorum_id`` died: every cross-cell wait on that quorum gives up, now and later."""
        self.process.ask_control("release_collectives", quorum_id)

    @ray.method(concurrency_group="fault_injector")
    def inject_fault(self, mode: str) -> None:
        """Fail the rank's process in the given way (``ftexp.control.failure_modes``); the actor follows."""
        self.process.inject_fault(mode)

    @ray.method(concurrency_group="lifeline")
    def lifeline(self) -> None:
        """Never returns: the driver's pending call on it fails the moment this process dies."""
        threading.Event().wait()

    def init(self, info: IndepDPInfo, load_rollout_id: int | None, recv_src_rank: int | None) -> dict[str, Any]:
        return self.process.call("init", info, load_rollout_id, recv_src_rank)

    def reconfigure(self, info: IndepDPInfo, send_to: list[int]) -> dict[str, Any]:
        return self.process.call("reconfigure", info, send_to)

    def train(self, rollout_ids: list[int], attempt: int,
              witness: WitnessInfo | None) -> list[tuple[str, dict[str, float] | None, float]]:
        return self.process.call("train", rollout_ids, attempt, witness)

    def update_weights(self, order: WeightPush) -> dict[str, str] | None:
        return self.process.call("update_weights", order)

    def save(self, rollout_id: int) -> None:
        self.process.call("save", rollout_id)
