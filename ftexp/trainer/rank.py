"""One rank of a cell: the process that holds the rank's replica, trains, reduces across cells, and heals others.

It runs as a plain process, forked by its node's fork server (``ftexp.forkserver``) for its
node's rank host, a Ray actor (``ftexp.trainer.cell_rank``), which forwards every call to it
(``ftexp.trainer.rank_process``): no Ray runs in the process that trains.

The torch engine has one rank per cell; a megatron cell has ``tp·pp·cp`` ranks that form their
own torch.distributed gloo world (rendezvous under ``cell<i>/<incarnation>/`` on the driver's
store, so a restarted cell never meets its predecessor's keys). Ranks with the same
rank-within-cell across all alive cells form the cross-cell group: a torchft
``ProcessGroupGloo`` configured under ``<store>/indep_dp/gloo/<quorum_id>/<rank>``. A new quorum
id means a new group; a group that failed once is never used again (the next refresh replaces
it). A step commits only if every rank of the cell reduced successfully (``cell_agrees``), and a
healing source's rank r sends its own shard of the state to rank r of the healed cell.

Every cross-cell wait — the group's rendezvous, the reduce, the state transfer — can be released
by the driver: once it has seen a member of quorum q die, quorum q can never complete a
collective, so the rank gives up on it at once instead of waiting out the timeout.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import sys
import threading
import time
from multiprocessing.connection import Connection, wait
from typing import Any, Callable

import torch
import torch.distributed as dist
from torchft.process_group import ProcessGroupGloo

from ftexp.audit.events import EventLogger, FaultInjectedEvent, ProcessIdentity, TrainEngineLocalWeightChecksumEvent
from ftexp.audit.witness import WitnessInfo
from ftexp.control.failure_modes import inject_fault
from ftexp.engines.base import rng_state
from ftexp.engines.collectives import ascending_fold, sum_across, tree_fold
from ftexp.engines.registry import get_engine
from ftexp.faults.nodes import NodeFiles
from ftexp.faults.plan import NegativeControl
from ftexp.forkserver import answer
from ftexp.job import JobSpec
from ftexp.rollout.recorded import load_rollout
from ftexp.rundir import rollout_path
from ftexp.tasks.warmup import warm_start
from ftexp.trainer import transfer
from ftexp.trainer.checkpoint import complete_checkpoint, load_rank_state, save_rank_state
from ftexp.trainer.quorum import IndepDPInfo
from ftexp.trainer.rank_process import WHERE, rank_cpu_seconds
from ftexp.trainer.step import SectionTimer, record_metrics, record_sections, settle_heap, train_step
from ftexp.trainer.weight_order import WeightPush
from ftexp.trainer.weight_push import WeightPusher

log = logging.getLogger(__name__)
NORMAL, DISCARDED = "normal", "discarded_should_retry"
RELEASE_POLL_S = 0.02
NODE_KILL_WAIT_S = 120.0  # a rank that asked for its node's death waits this long for it


class CollectiveReleased(RuntimeError):
    """The driver saw a peer cell die and released this rank from the cross-cell collective."""


def run_releasable(collective: Callable[[], None], released: threading.Event,
                   cancel: Callable[[], None] | None = None) -> None:
    """Run a blocking cross-cell collective, but give up as soon as ``released`` is set.

    A gloo collective (or rendezvous) cannot be interrupted: with a dead peer it returns only at its
    timeout. The driver learns of the death at once (Ray reports it) and sets ``released`` through
    an RPC that runs beside the blocked call; the rank then stops waiting and voids the attempt. The
    abandoned thread ends at the collective's timeout and writes only into buffers (or a group
    object) that nobody reads again, on a quorum that is never used again. A collective that can
    be interrupted, and writes where it must not once abandoned (a heal receiving into the
    replica's own tensors), comes with ``cancel``: it is called, and its thread has ended, before
    the release is raised.
    """
    done, errors = threading.Event(), []

    def target() -> None:
        try:
            collective()
        except BaseException as e:  # handed to the caller's thread
            errors.append(e)
        finally:
            done.set()

    threading.Thread(target=target, name="cross-cell-collective", daemon=True).start()
    while not done.wait(RELEASE_POLL_S):
        if released.is_set():
            if cancel is not None:
                cancel()
                done.wait()
            raise CollectiveReleased("released by the driver: a peer cell died")
    if errors:
        raise errors[0]


class Rank:
    """One rank of cell ``cell_index`` in its ``incarnation``; or, with ``cell_index`` None, of warm spare
    number ``incarnation`` (``ftexp.trainer.spares``): built alike, it learns its cell from its first ``init``.
    ``node_ip`` is the address of its node, where a healed rank listens for its state."""

    def __init__(self, spec: JobSpec, cell_index: int | None, rank_within_cell: int, store_addr: str,
                 incarnation: int, node_ip: str):
        torch.set_num_threads(spec.trainer.threads_per_rank)
        torch.use_deterministic_algorithms(spec.deterministic)
        self.spec, self.rank = spec, rank_within_cell
        self.store_addr, self.node_ip = store_addr, node_ip
        self._take_place(cell_index, f"cell{cell_index}" if cell_index is not None else f"spare{incarnation}")
        engine = get_engine(spec.trainer.engine)
        self.ranks_per_cell = engine.ranks_per_replica(spec.mode)
        self.has_world = engine.needs_process_world
        if self.has_world:
            self._join_cell_world(f"cell{cell_index}/{incarnation}/" if cell_index is not None else f"spare{incarnation}/")
        self.replica = engine.build_replica(spec.trainer, spec.mode, seed=spec.seed, deterministic=spec.deterministic)
        # A task's supervised warm-up, on a cold start only: computed by the first cell's first actors and
        # loaded by the other cells' (incarnation 1; a healed cell's later ones, like a resumed run's or a
        # spare's, receive their state). Here, because the group meets the cells only once every one is
        # built, so a long warm-up delays no rendezvous.
        if (spec.task is not None and spec.task.warmup.steps and cell_index is not None and incarnation <= 1
                and spec.load_dir is None):
            warm_start(self.replica, spec, cell_index, rank_within_cell)
        self.info: IndepDPInfo | None = None
        self.pg: ProcessGroupGloo | None = None
        # quorum id -> set once the driver saw a member of that quorum die. Kept per quorum, so a
        # release that overtakes the call it is meant for (they run on different threads) still holds.
        self._released: dict[int, threading.Event] = {}
        self._released_lock = threading.Lock()
        self.last_active, self.bump_count = time.time(), 0
        self.weight_pusher: WeightPusher | None = None  # live rollout engines: made on the first push
        self.last_commit_quorum: int | None = None  # the quorum id of this process's last commit
        settle_heap()

    def _take_place(self, cell_index: int | None, name: str) -> None:
        """Become a rank of cell ``cell_index`` (None: a spare, no cell yet): log lines and events say so."""
        logging.basicConfig(level=logging.INFO, stream=sys.stdout, force=True,
                            format=f"[%(asctime)s] {name}/rank{self.rank} %(name)s: %(message)s", datefmt="%H:%M:%S")
        self.cell_index = cell_index
        self.events = EventLogger(self.spec.side_dir.events, ProcessIdentity(
            component="actor", cell_index=cell_index, rank_within_cell=self.rank)) if cell_index is not None else None

    def _join_cell_world(self, prefix: str) -> None:
        """The replica's own world, under a prefix of the store that no other incarnation or spare uses."""
        host, port = self.store_addr.rsplit(":", 1)
        timeout = dt.timedelta(seconds=self.spec.trainer.world_timeout_s)
        store = dist.TCPStore(host, int(port), is_master=False, timeout=timeout)
        dist.init_process_group("gloo", store=dist.PrefixStore(prefix, store),
                                rank=self.rank, world_size=self.ranks_per_cell, timeout=timeout)

    def ping(self) -> bool:
        return True

    def heartbeat(self) -> dict[str, float]:
        """When the rank last worked."""
        return {"last_active_timestamp": self.last_active, "bump_count": self.bump_count}

    def release_collectives(self, quorum_id: int) -> None:
        """A member of quorum ``quorum_id`` died: every cross-cell wait on that quorum gives up, now and later."""
        self._release_event(quorum_id).set()

    def _release_event(self, quorum_id: int) -> threading.Event:
        with self._released_lock:
            return self._released.setdefault(quorum_id, threading.Event())

    def _bump(self) -> None:
        self.last_active, self.bump_count = time.time(), self.bump_count + 1

    # ---- membership ---------------------------------------------------------------------------
    def _heal_store(self) -> dist.TCPStore:
        """A client of the driver's store, where a healed rank publishes its transfer address.

        A new one per heal: a released transfer's thread may still block in this client's ``get``, and a
        client serves one call at a time.
        """
        host, port = self.store_addr.rsplit(":", 1)
        return dist.TCPStore(host, int(port), is_master=False,
                             timeout=dt.timedelta(seconds=self.spec.trainer.cross_cell_timeout_s))

    def _configure_group(self, info: IndepDPInfo) -> None:
        """Drop the old cross-cell group and join the one of ``info.quorum_id`` (releasable).

        ``self.pg`` is set only here, on this thread, once the rendezvous completed: a released
        rendezvous that completes later on its abandoned thread never becomes the rank's group.
        """
        self.pg = None
        self.info = info
        if info.alive_size > 1:
            pg = ProcessGroupGloo(timeout=dt.timedelta(seconds=self.spec.trainer.cross_cell_timeout_s))
            run_releasable(lambda: pg.configure(
                f"{self.store_addr}/indep_dp/gloo/{info.quorum_id}/{self.rank}", replica_id=str(self.cell_index),
                rank=info.alive_rank, world_size=info.alive_size, quorum_id=info.quorum_id, group_rank=self.rank,
                group_world_size=self.ranks_per_cell), self._release_event(info.quorum_id))
            self.pg = pg

    def init(self, info: IndepDPInfo, load_rollout_id: int | None, recv_src_rank: int | None) -> dict[str, Any]:
        """Join quorum ``info``; start from a checkpoint, from a live cell (healing), or from scratch.

        A quorum that does not form (a member died, or the source did mid-transfer) is answered with
        ``ok: False``: this cell is fine, and the group may heal it again in the next quorum.
        """
        t0 = time.monotonic()
        if self.cell_index is None:  # a warm spare, taken by this cell
            self._take_place(info.cell_index, f"cell{info.cell_index}")
        if load_rollout_id is not None:
            self.replica.load_state_dict(load_rank_state(self.spec.load_dir, load_rollout_id, self.replica.coords))
        received, control = 0, self.spec.trainer.negative_control
        try:
            if recv_src_rank is not None:
                store = self._heal_store()
                # Straight into this replica's own tensors, unless a negative control needs some of them kept.
                into = None if control in (NegativeControl.skip_heal_transfer,
                                           NegativeControl.skip_optimizer_transfer) else self.replica.state_dict()
                receiver = transfer.StateReceiver(self.node_ip, self.spec.trainer.cross_cell_timeout_s,
                                                  into)
            self._configure_group(info)
            t1 = time.monotonic()
            if recv_src_rank is not None:
                key, box = transfer.heal_key(info.quorum_id, self.rank, info.alive_rank), []
                run_releasable(lambda: box.append(receiver.receive(store, key)),
                               self._release_event(info.quorum_id), cancel=receiver.cancel)
                [(state, received)] = box
        except Exception as e:
            return self._quorum_failed(info, e)
        # From this rank's configured group to its source's connection; then the bytes, timed where
        # they arrive; then the load, from the last byte (the rebuild of the state around the received
        # bytes and the hand-back from the receiving thread are the load's, not the transfer's).
        connected, arrived = (receiver.connected_at, receiver.received_at) if recv_src_rank is not None else (t1, t1)
        if recv_src_rank is not None:
            if control == NegativeControl.skip_optimizer_transfer:
                state["optimizer"] = self.replica.optimizer.state_dict()
            if control == NegativeControl.skip_rng_transfer:
                state["rng"] = rng_state()  # the bug: the healed cell keeps its own fresh generators
            if control != NegativeControl.skip_heal_transfer:
                self.replica.load_state_dict(state)
        return {"ok": True, "configure_s": t1 - t0, "transfer_wait_s": connected - t1, "transfer_s": arrived - connected,
                "load_s": time.monotonic() - arrived, "bytes": received, "last_rollout_id": self.replica.last_rollout_id}

    def reconfigure(self, info: IndepDPInfo, send_to: list[int]) -> dict[str, Any]:
        """Move to a new quorum; as the healing source, send the full state to each new alive rank.

        A peer that dies meanwhile makes the rendezvous or the send fail. That is the peer's fault,
        not this rank's: report ``ok: False`` (the group retries the reconfigure) instead of raising,
        which would get this healthy cell — possibly the last one — killed.
        """
        self._bump()
        t0 = time.monotonic()
        keys = [transfer.heal_key(info.quorum_id, self.rank, dst) for dst in send_to]
        sent: list[int] = []
        waited: list[float] = []  # for each receiver: until it published its address (its group configured)
        try:
            if keys:  # encoded while the group meets: the state is that of the last commit either way
                store, encoded = self._heal_store(), transfer.encode(self.replica.state_dict())
            self._configure_group(info)
            t1 = time.monotonic()
            if keys:
                timeout_s = self.spec.trainer.cross_cell_timeout_s

                def send_all() -> None:
                    for key in keys:
                        asked = time.monotonic()
                        address = transfer.published_address(store, key)
                        waited.append(time.monotonic() - asked)
                        sent.append(transfer.send_state_to(address, encoded, timeout_s))

                run_releasable(send_all, self._release_event(info.quorum_id))
        except Exception as e:
            return self._quorum_failed(info, e)
        # The transfer itself is timed where the bytes arrive (``init`` of the healed ranks).
        return {"ok": True, "configure_s": t1 - t0, "transfer_wait_s": sum(waited), "load_s": 0.0, "bytes": sum(sent)}

    def _quorum_failed(self, info: IndepDPInfo, error: Exception) -> dict[str, Any]:
        log.warning("joining quorum %d failed: %s", info.quorum_id, error)
        self.pg = None
        return {"ok": False, "error": str(error).splitlines()[0] if str(error) else type(error).__name__}

    # ---- training -----------------------------------------------------------------------------
    def train(self, rollout_ids: list[int], attempt: int,
              witnesses: list[WitnessInfo] | None) -> list[tuple[str, dict[str, float] | None, float]]:
        """One attempt of a run of consecutive rollouts, in order, stopping after the first that does not commit.

        Per rollout trained: its outcome, its metrics, and its seconds since the previous one's end (the first:
        since the call began). ``witnesses``: each rollout's witness ids, where the model has witnesses."""
        assert witnesses is None or len(witnesses) == len(rollout_ids), "witness ids come one set per rollout"
        trained = []
        mark = time.perf_counter()
        for n, rollout_id in enumerate(rollout_ids):
            outcome, metrics = self._train_rollout(rollout_id, attempt, witnesses[n] if witnesses is not None else None)
            now = time.perf_counter()
            trained.append((outcome, metrics, now - mark))
            mark = now
            if outcome != NORMAL:
                break
        return trained

    def _train_rollout(self, rollout_id: int, attempt: int,
                       witness: WitnessInfo | None) -> tuple[str, dict[str, float] | None]:
        info, spec = self.info, self.spec
        assert info is not None, "train before init"
        self._bump()
        started, events_before, timer = time.perf_counter(), self.events.write_s, SectionTimer()
        cpu_started = rank_cpu_seconds()
        control = spec.trainer.negative_control
        rollout = load_rollout(rollout_path(spec.data_dir, rollout_id), expected_rollout_id=rollout_id)
        # The first alive cell writes the group's dumps and metrics (the negative control: always cell 0).
        logs_for_group = info.cell_index == 0 if control == NegativeControl.cell0_writes_group_logs else info.alive_rank == 0
        fold = ascending_fold if control == NegativeControl.ascending_cell_fold else tree_fold

        def before_reduce() -> None:
            if info.alive_size > 1:
                self._maybe_crash(rollout_id, attempt)

        def reduce_across_cells(flat: torch.Tensor) -> bool:
            if info.alive_size == 1:
                return True
            pg = self.pg
            if pg is None:  # this quorum's group failed in an earlier attempt: never reuse it
                return False
            try:
                with timer.section("reduce_s"):
                    run_releasable(lambda: sum_across(pg, flat, world_size=info.alive_size,
                                                      deterministic=spec.deterministic, torchft=True, fold=fold),
                                   self._release_event(info.quorum_id))
                return True
            except Exception as e:  # a dead or frozen peer: this attempt is void
                log.warning("cross-cell reduce failed at rollout %d attempt %d: %s", rollout_id, attempt, e)
                self.pg = None  # never reuse a failed group
                return False

        def reduce(flat: torch.Tensor) -> bool:
            ok = self.replica.cell_agrees(reduce_across_cells(flat))
            if not ok and control == NegativeControl.leak_discarded_attempt:
                self.replica.optimizer_step(rollout_id)  # the bug: the void attempt's local gradient lands
            return ok

        def dump() -> None:
            # The other cells dump too (part of the audit) at their first commit in a new quorum (after a shrink,
            # a heal, a start): between, the checksum rule holds them bitwise equal to the first alive cell.
            if logs_for_group:
                leaf = spec.side_dir.dump_leaf(rollout_id)
            elif spec.trainer.audit and info.quorum_id != self.last_commit_quorum:
                leaf = spec.side_dir.cell_dump_leaf(self.cell_index, rollout_id)
            else:
                return
            with timer.section("dump_s"):
                self.replica.dump(leaf)

        with self.events.context(rollout_id=rollout_id, attempt=attempt):
            ok, metrics = train_step(self.replica, rollout, rollout_id, attempt, shard_rank=info.alive_rank,
                                     shard_size=info.alive_size, witness=witness, events=self.events, reduce=reduce,
                                     before_reduce=before_reduce, on_commit=dump, timer=timer)
            if not ok:
                return DISCARDED, None
            if control == NegativeControl.double_apply_retry and attempt == 0:
                return DISCARDED, None  # the bug: stepped, yet reported void, so the retry steps again
            self.last_commit_quorum = info.quorum_id
            if spec.trainer.audit:
                with timer.section("checksum_s"):
                    checksums = self.replica.checksums()
                self.events.log(TrainEngineLocalWeightChecksumEvent(rollout_id=rollout_id, state=checksums))
            if logs_for_group and self.rank == 0:
                record_metrics(spec.side_dir, self.events, rollout_id, attempt, metrics)
        self._record_sections(rollout_id, attempt, timer, time.perf_counter() - started, events_before,
                              rank_cpu_seconds() - cpu_started)
        return NORMAL, metrics

    def _record_sections(self, rollout_id: int, attempt: int, timer: SectionTimer, total_s: float,
                         events_before: float, cpu_s: float) -> None:
        """Where this rank's step went (compute is what the named sections leave), and its CPU seconds (with its
        share of its host's)."""
        seconds = timer.breakdown(total_s, event_write_s=self.events.write_s - events_before)
        record_sections(self.spec.side_dir, rollout_id, attempt, self.cell_index, self.rank, dict(seconds, cpu_s=cpu_s))

    def update_weights(self, order: WeightPush) -> dict[str, str] | None:
        """Push this cell's weights to the rollout engines (all ranks export; the first sends)."""
        if self.weight_pusher is None:
            self.weight_pusher = WeightPusher()
        return self.weight_pusher.push(self.replica, order)

    def _maybe_crash(self, rollout_id: int, attempt: int) -> None:
        self._maybe_take_node_away(rollout_id, attempt)  # multi-node
        crash = self.spec.plan.crash_before_reduce(self.cell_index, self.rank, rollout_id, attempt)
        if crash is None:
            return
        self.events.log(FaultInjectedEvent(rollout_id=rollout_id, attempt=attempt, action=crash.action.value,
                                           cell_index=self.cell_index, rank=self.rank))
        log.warning("test action %s: exiting hard before the cross-cell reduce", crash.action.value)
        sys.stdout.flush()
        os._exit(1)

    def _maybe_take_node_away(self, rollout_id: int, attempt: int) -> None:
        """If the plan takes this rank's node away right before this attempt's reduce: log the fault, ask the node's
        supervisor to kill the node, and wait for it to (this process dies with the node). Else return at once."""
        fault = self.spec.plan.node_fault_before_reduce(self.cell_index, self.rank, rollout_id, attempt)
        if fault is None:
            return
        self.events.log(FaultInjectedEvent(rollout_id=rollout_id, attempt=attempt, action=fault.action.value,
                                           cell_index=self.cell_index, rank=self.rank, node_index=fault.node))
        log.warning("test action %s: taking node %d (cells %s) away before the cross-cell reduce", fault.action.value,
                    fault.node, list(fault.cells))
        sys.stdout.flush()
        NodeFiles(self.spec.side_dir.cluster).request_down(fault.node, f"rollout {rollout_id} attempt {attempt}",
                                                           fault.how)
        time.sleep(NODE_KILL_WAIT_S)
        log.error("node %d was not taken away within %.0f s; exiting hard instead", fault.node, NODE_KILL_WAIT_S)
        sys.stdout.flush()
        os._exit(1)

    def save(self, rollout_id: int) -> None:
        """Every rank writes its file; rank 0 then (after a barrier) the tracker and the event snapshot."""
        save_rank_state(self.replica, self.spec.side_dir.ckpt, rollout_id)
        if self.has_world:
            dist.barrier()
        if self.rank == 0:
            complete_checkpoint(self.spec.side_dir.ckpt, rollout_id, self.spec.side_dir.events)


CONTROL_METHODS = ("ping", "heartbeat", "release_collectives")
CALL_METHODS = ("init", "reconfigure", "train", "update_weights", "save")


def serve(connections: list[Connection]) -> None:
    """The rank process's main, on its (calls, control, faults) pipes: build the rank from the first call, then
    answer calls until the host is gone (or kills this process)."""
    calls, control, faults = connections
    method, build_args = calls.recv()
    assert method == "__build__", method
    built: list[Rank] = []
    answer(calls, lambda: built.append(Rank(*build_args)), WHERE)
    if built:
        threading.Thread(target=_serve_control, args=(built[0], control, faults), name="rank-control",
                         daemon=True).start()
    while True:
        try:
            method, args = calls.recv()
        except EOFError:  # the host is gone
            os._exit(0)
        assert built and method in CALL_METHODS, method
        answer(calls, lambda: getattr(built[0], method)(*args), WHERE)


def _serve_control(rank: Rank, control: Connection, faults: Connection) -> None:
    """Heartbeats, releases and injected faults, beside whatever call the main thread is in."""
    while True:
        for conn in wait([control, faults]):
            try:
                request = conn.recv()
            except EOFError:  # the host is gone
                os._exit(0)
            if conn is faults:
                log.warning("injected fault: %s", request)
                sys.stdout.flush()
                inject_fault(request)
            else:
                method, args = request
                assert method in CONTROL_METHODS, method
                answer(control, lambda: getattr(rank, method)(*args), WHERE)
