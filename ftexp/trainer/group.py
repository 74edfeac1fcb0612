"""The train group: N cells, the quorum id, and the step / refresh / heal protocol.

One call of ``train(rollout_ids)`` trains a run of consecutive rollouts to a commit each: up to
``max_attempts`` attempts, each of which

0. allocates fresh witness ids for the samples of each of the run's rollouts and logs them — every
   attempt, so the analyzer can tell a retry's samples from a discarded attempt's;
1. refreshes membership — if a cell is pending, an alive cell's quorum view is stale, or the
   current quorum is spent (it never formed, or an attempt on it was discarded: some rank's group
   failed, and a failed group is never reused), bump the quorum id, allocate the pending cells,
   move every alive cell to the new cross-cell group, and heal the pending cells from the
   lowest-index alive cell (one ``CellReconfigureEvent``);
2. calls ``train`` once on every rank of every alive cell with the run's rollouts not yet committed;
   a rank trains them in order and stops after the first that does not commit. Per rollout, each cell
   is errored (its call raised; it is already stopped), discarded (a rank's reduce failed) or normal;
3. commits the rollouts in order as long as no cell discarded and at least one is normal — an
   errored cell alongside normal ones may have died after the exchange, so the survivors' commit
   stands. The rest of the run goes on at the next attempt number.

The driver makes a run longer than one rollout only where nothing has to happen between its
rollouts (no engines, no save, no test action): then the ranks go from one rollout to the next
without a round trip through the driver, and Ray's cost of a call is paid once per run. A rank
that stops before its run's end would leave its peers waiting for it in the next rollout's reduce:
its answer spends the quorum and releases them.

Cells leave from three threads: the training loop (a call on a cell failed), the control plane
(suspend) and the death watch (a cell's lifeline call failed: its process died, even between
calls). All three go through one lock and one rule: when a member of the current quorum leaves,
every other member is released from its cross-cell waits on that quorum (``release_collectives``),
so nobody waits out a collective's timeout for a peer the driver already knows is gone. A retry
after an attempt in which a cell left, or which committed part of its run, starts at once; only a
failure without a known cause backs off.

With ``trainer.spare_cells=k`` the group keeps k warm spares (``ftexp.trainer.spares``): a restarted
cell takes one — ranks already started and built — instead of starting processes, which on a loaded
machine (or with megatron-core to import) is most of a recovery; after each commit the group
tops the pool up again in the background.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import ray
from ray.exceptions import RayTaskError

from ftexp.audit.events import CellLifecycleEvent, CellReconfigureEvent, EventLogger, TrainGroupStepEndEvent
from ftexp.audit.witness import WitnessIdAllocator, WitnessInfo, allocation_event
from ftexp.trainer.cell import Cell, CellState
from ftexp.trainer.quorum import IndepDPInfo
from ftexp.trainer.rank import NORMAL
from ftexp.trainer.spares import SparePool

log = logging.getLogger(__name__)
WATCH_POLL_S = 0.5  # how often the death watch re-reads which cells to watch (a death wakes it at once)
_MEMBER_STATES = (CellState.ALLOCATED, CellState.ALIVE)


class RetryableStepError(RuntimeError):
    """This attempt did not commit (the rest of its run); refresh and try again."""


@dataclass(frozen=True)
class Commit:
    """A committed rollout: its attempt, the first normal cell's metrics, and its seconds from the previous commit
    (or the start of its run's training) to its own, as the slowest cell's ranks measured them."""

    rollout_id: int
    attempt: int
    metrics: dict[str, float]
    step_s: float


class TrainGroup:
    def __init__(self, num_cells: int, ranks_per_cell: int, make_ranks, events: EventLogger, trainer_cfg,
                 witness_allocator: WitnessIdAllocator | None = None):
        self.events = events
        self.cfg = trainer_cfg
        self.witness_allocator = witness_allocator
        self.quorum_id = 0
        # make_ranks(cell index, incarnation) -> one handle per rank of the cell, each called like a Ray actor
        # (``ftexp.trainer.cell_rank.RankHandle``), whose processes start in the background; a spare's ranks
        # are made with cell index None and the spare's number in place of the incarnation.
        self.make_ranks, self.ranks_per_cell = make_ranks, ranks_per_cell
        self.spares = SparePool(trainer_cfg.spare_cells, lambda n: make_ranks(None, n))
        self._spare_taken: dict[int, int] = {}  # cell -> the incarnation that took a warm spare's ranks
        self.cells = [Cell(i, self._ranks_for) for i in range(num_cells)]
        self.health = None  # set by the control plane: the healed cells' checkers pause around a heal
        self.on_allocated = None  # multi-node: called with each cell once its new ranks answer (placement events)
        self.waiting_on: dict[int, str] = {}  # cell -> the call the loop is blocked on (for hang diagnosis)
        self.departures = 0  # how many times a cell left its quorum (failed or stopped)
        self._lock = threading.RLock()  # membership changes come from the loop, the control plane and the death watch
        self._members: tuple[int, ...] = ()  # the cells of quorum ``quorum_id``, formed or forming
        self._spent_quorum: int | None = None  # a quorum an attempt was discarded on: it must not train again
        self._watch_stop = threading.Event()
        self._watch: threading.Thread | None = None

    # ---- start-up -----------------------------------------------------------------------------
    def init(self, load_rollout_id: int | None) -> list[dict[str, Any]]:
        """Allocate every cell and join quorum 0 with all cells alive; every rank's init result."""
        alive = [c.index for c in self.cells]
        self._members = tuple(alive)
        for cell in self.cells:
            cell.allocate()
        with self._lock:
            self.spares.fill()  # built alongside the cells, so even an early failure finds a spare ready
        self._watch = threading.Thread(target=self._watch_deaths, name="cell-death-watch", daemon=True)
        self._watch.start()
        # Every rank built (its replica too) before any starts the cross-cell rendezvous, whose timeout is
        # short: on several nodes, or under load, one cell's ranks may come up many seconds after another's.
        for cell in self.cells:
            cell.execute("ping")
        refs = {c.index: c.submit("init", IndepDPInfo.for_cell(c.index, len(self.cells), 0, alive), load_rollout_id, None)
                for c in self.cells}
        results = []
        for cell in self.cells:
            cell_results = cell.collect(refs[cell.index])
            if not all(r["ok"] for r in cell_results):
                raise RuntimeError(f"cell {cell.index} could not join quorum 0: "
                                   + next(r["error"] for r in cell_results if not r["ok"]))
            results += cell_results
            cell.mark_alive(IndepDPInfo.for_cell(cell.index, len(self.cells), 0, alive))
            if self.on_allocated is not None:
                self.on_allocated(cell)
        return results

    def _ranks_for(self, cell_index: int, incarnation: int) -> list[Any]:
        """A cell's next ranks: a warm spare's if the pool has one, else new ones."""
        ranks = self.spares.take()
        if ranks is None:
            return self.make_ranks(cell_index, incarnation)
        self._spare_taken[cell_index] = incarnation
        log.info("cell %d (incarnation %d) takes a warm spare", cell_index, incarnation)
        return ranks

    # ---- membership ---------------------------------------------------------------------------
    def alive_indices(self) -> list[int]:
        return [c.index for c in self.cells if c.is_alive]

    def stop_cell(self, index: int, by: str) -> None:
        """Suspend a cell (kill its ranks); ``by`` names who asked, for the event log."""
        with self._lock:
            cell = self.cells[index]
            if cell.state != CellState.STOPPED:
                self.events.log(CellLifecycleEvent(cell_index=index, transition="stopped", by=by))
            if cell.state in _MEMBER_STATES:
                self._leave(index)
            cell.stop()

    def start_cell(self, index: int, by: str) -> None:
        """Resume a stopped cell: it becomes Pending, and the next refresh allocates and heals it."""
        with self._lock:
            if self.cells[index].state == CellState.STOPPED:
                self.events.log(CellLifecycleEvent(cell_index=index, transition="start_requested", by=by))
            self.cells[index].start()

    def _cell_failed(self, index: int, incarnation: int, by: str) -> None:
        """A call on (or the lifeline of) this incarnation of the cell failed: log it, release its peers, stop it.

        A no-op when the cell was already stopped or restarted (another thread saw it first)."""
        with self._lock:
            cell = self.cells[index]
            if cell.incarnation != incarnation or cell.state not in _MEMBER_STATES:
                return
            self.events.log(CellLifecycleEvent(cell_index=index, transition="failed", by=by))
            self._leave(index)
            cell.fail()

    def _leave(self, index: int) -> None:
        """Cell ``index`` leaves: the other members of the current quorum stop waiting for it (fire and forget).

        The release is for the quorum, not for one call: a member that is not yet in its collective
        gives up on it as soon as it gets there. The next refresh moves everyone to a new quorum."""
        self.departures += 1
        if index in self._members:
            self._release(self.quorum_id, [peer for peer in self._members if peer != index])

    def _release(self, quorum_id: int, cells: list[int]) -> None:
        """Those of ``cells`` still members give up every cross-cell wait on ``quorum_id`` (fire and forget)."""
        for i in cells:
            if self.cells[i].state in _MEMBER_STATES:
                self.cells[i].submit("release_collectives", quorum_id)

    def _watch_deaths(self) -> None:
        """Fail a cell the moment one of its ranks' processes ends (or its host dies) — also between calls."""
        while not self._watch_stop.is_set():
            with self._lock:
                watched = {ref: (c.index, c.incarnation) for c in self.cells if c.state in _MEMBER_STATES
                           for ref in c.lifelines}
            if not watched:
                self._watch_stop.wait(WATCH_POLL_S)
                continue
            try:
                ready, _ = ray.wait(list(watched), num_returns=1, timeout=WATCH_POLL_S)
            except (Exception, SystemExit):  # Ray raises SystemExit once it is shutting down
                if not ray.is_initialized():
                    return  # Ray went down before the group (a caller that skipped shutdown)
                raise
            for ref in ready:  # a lifeline never returns: ready means its rank's process is gone
                self._cell_failed(*watched[ref], by=_death_cause(ref))

    def refresh(self, rollout_id: int) -> CellReconfigureEvent | None:
        with self._lock:
            # Allocated-but-not-alive cells are left from a heal whose quorum did not form: heal them again.
            pending = [c.index for c in self.cells if c.state in (CellState.PENDING, CellState.ALLOCATED)]
            alive = self.alive_indices()
            views = {i: self.cells[i].info for i in alive}
        assert alive, "cannot recover when all cells are dead"
        will_alive = sorted(set(pending) | set(alive))
        stale = [i for i, view in views.items()
                 if list(view.alive_cell_indices) != will_alive or view.quorum_id != self.quorum_id]
        if not pending and not stale and self._spent_quorum != self.quorum_id:
            return None
        # Only the healed cells' checkers pause: a member that freezes (a deadlock holding the GIL) never
        # answers its reconfigure call, and only its missed heartbeats get it stopped and the rest released.
        if self.health is not None:
            self.health.pause_health(pending)
        try:
            return self._reconfigure(rollout_id, pending, alive, will_alive)
        finally:
            if self.health is not None:
                self.health.resume_health(pending)

    def _reconfigure(self, rollout_id: int, pending: list[int], alive: list[int],
                     will_alive: list[int]) -> CellReconfigureEvent:
        with self._lock:
            self.quorum_id += 1
            self._members = tuple(will_alive)
            gone = [i for i in will_alive if self.cells[i].state not in
                    ((CellState.PENDING, CellState.ALLOCATED) if i in pending else (CellState.ALIVE,))]
            if gone:
                raise RetryableStepError(f"cells {gone} left before quorum {self.quorum_id} formed")
            for i in pending:
                if self.cells[i].state == CellState.PENDING:
                    self.cells[i].allocate()
        t0 = time.monotonic()
        # Wait until the new ranks are built, so the cross-cell rendezvous does not race their start-up.
        started = self._collect_cells({i: self.cells[i].submit("ping") for i in pending})
        if failed := [i for i, result in started.items() if isinstance(result, Exception)]:
            raise RetryableStepError(f"cells {failed} died starting up for quorum {self.quorum_id}")
        for i in pending:
            if self.on_allocated is not None:
                self.on_allocated(self.cells[i])
        t_allocated = time.monotonic()
        src = alive[0]
        dst_ranks = [will_alive.index(i) for i in pending]
        info = {i: IndepDPInfo.for_cell(i, len(self.cells), self.quorum_id, will_alive) for i in will_alive}
        refs = {i: self.cells[i].submit("reconfigure", info[i], dst_ranks if (i == src and pending) else [])
                for i in alive}
        refs.update({i: self.cells[i].submit("init", info[i], None, will_alive.index(src)) for i in pending})
        self.waiting_on = {i: f"quorum {self.quorum_id}: {'reconfigure' if i in alive else 'init (healing)'}"
                           for i in refs}
        results: dict[int, list[dict[str, Any]]] = {}
        failed = []
        for i, result in self._collect_cells(refs).items():
            if isinstance(result, Exception):
                log.error("reconfigure: cell %d failed: %s", i, result)
                failed.append(i)
            elif not all(r["ok"] for r in result):  # alive, but its group did not form
                log.error("reconfigure: cell %d could not join quorum %d: %s", i, self.quorum_id,
                          next(r["error"] for r in result if not r["ok"]))
                failed.append(i)
            results[i] = result
        self.waiting_on = {}
        with self._lock:
            # No event if the quorum did not form, or a cell was stopped after its call returned. The
            # survivors keep their old view and the healed cells stay Allocated: the next refresh
            # forms a new quorum with whoever is left, healing those cells again without restarting them.
            failed += [i for i in will_alive if i not in failed and self.cells[i].state not in _MEMBER_STATES]
            if failed:
                raise RetryableStepError(f"reconfigure to quorum {self.quorum_id} failed in cells {failed}")
            for i in will_alive:
                self.cells[i].mark_alive(info[i])
        timings: dict[str, float] = {}
        if pending:
            timings = {
                "allocate_s": t_allocated - t0,
                "configure_s": max(r["configure_s"] for rs in results.values() for r in rs),
                "transfer_wait_s": max(r["transfer_wait_s"] for rs in results.values() for r in rs),
                # The bytes' time as the healed ranks saw it: from their source's connection to the last byte.
                "transfer_s": max(r["transfer_s"] for i in pending for r in results[i]),
                "load_s": max(r["load_s"] for rs in results.values() for r in rs),
                "reconfigure_total_s": time.monotonic() - t0,
            }
        event = CellReconfigureEvent(
            rollout_id=rollout_id, quorum_id=self.quorum_id, src_cell_index=src if pending else None,
            healed_cell_indices=pending, alive_cell_indices_after=will_alive, timings=timings,
            spare_cell_indices=[i for i in pending if self._spare_taken.get(i) == self.cells[i].incarnation],
            bytes_transferred=sum(r["bytes"] for r in results[src]) if pending else 0,
            transfer_connections=self.ranks_per_cell * len(pending))
        self.events.log(event)
        log.info("quorum %d: alive %s (healed %s from cell %s)", self.quorum_id, will_alive, pending,
                 src if pending else None)
        return event

    # ---- a run of rollouts ---------------------------------------------------------------------
    def train(self, rollout_ids: list[int]) -> list[Commit]:
        """Train consecutive ``rollout_ids`` to a commit each, in one call per rank and attempt."""
        commits: list[Commit] = []
        backoff = self.cfg.retry_backoff_s
        since = time.monotonic()  # the previous commit as the driver saw it (here: the run's start)
        for attempt in range(self.cfg.max_attempts):
            departures = self.departures
            remaining = rollout_ids[len(commits):]
            try:
                committed, since, failure = self._attempt(remaining, attempt, since)
            except (RetryableStepError, AssertionError) as e:
                if isinstance(e, AssertionError) and not self.alive_indices():
                    raise
                committed, failure = [], str(e)
            commits += committed
            if len(commits) == len(rollout_ids):
                return commits
            if committed or self.departures != departures:  # the cause is known, or the run got on: no back-off
                log.warning("rollout %d attempt %d did not commit: %s; retrying at once",
                            remaining[len(committed)], attempt, failure)
                continue
            log.warning("rollout %d attempt %d did not commit: %s; retrying in %.1fs", remaining[0], attempt, failure,
                        backoff)
            time.sleep(backoff)
            backoff = min(backoff * 2, self.cfg.retry_backoff_max_s)
        raise RuntimeError(f"rollout {rollout_ids[len(commits)]}: no commit after {self.cfg.max_attempts} attempts")

    def _allocate_witnesses(self, rollout_ids: list[int], attempt: int) -> list[WitnessInfo] | None:
        """Fresh witness ids for each rollout of the run, in order, each allocation logged."""
        if self.witness_allocator is None:
            return None
        witnesses = []
        for rollout_id in rollout_ids:
            witnesses.append(self.witness_allocator.allocate(self.cfg.rollout.samples))
            self.events.log(allocation_event(rollout_id, attempt, witnesses[-1], self.witness_allocator.counter))
        return witnesses

    def _attempt(self, rollout_ids: list[int], attempt: int, since: float) -> tuple[list[Commit], float, str | None]:
        """One attempt of the run ``rollout_ids``: the rollouts it committed, when the last of them committed, and
        why the next one did not (None: the whole run committed).

        Raises ``RetryableStepError`` where none committed; the first that did not is the next attempt's first."""
        witnesses = self._allocate_witnesses(rollout_ids, attempt)
        self.refresh(rollout_ids[0])
        refs = {i: self.cells[i].submit("train", rollout_ids, attempt, witnesses) for i in self.alive_indices()}
        self.waiting_on = {i: f"rollouts {rollout_ids[0]}..{rollout_ids[-1]} attempt {attempt}: train" for i in refs}
        quorum_id = self.quorum_id

        def give_up_if_stopped_early(trained: list) -> None:
            """A rank that stopped before the run's end leaves its peers' next collective waiting for it: the
            quorum is spent, and every member gives up on it at once (not at the cross-cell timeout)."""
            if len(trained) < len(rollout_ids):
                with self._lock:
                    self._spent_quorum = quorum_id
                    self._release(quorum_id, list(self._members))

        results = self._collect_cells(refs, on_result=give_up_if_stopped_early)
        answered = time.monotonic()
        self.waiting_on = {}
        trained = {i: r for i, r in results.items() if not isinstance(r, Exception)}
        for i, result in results.items():
            if isinstance(result, Exception):
                log.warning("rollouts %d..%d attempt %d: cell %d errored: %s", rollout_ids[0], rollout_ids[-1], attempt,
                            i, type(result).__name__)
        committed: list[tuple[int, dict[str, float]]] = []  # (rollout, metrics)
        failure = None
        for n, rollout_id in enumerate(rollout_ids):
            # Each cell's ranks' outcomes ("missing": the rank stopped after an earlier rollout that did not commit).
            outcomes: dict[int, Any] = {i: [ranks[n][0] if n < len(ranks) else "missing" for ranks in trained[i]]
                                        if i in trained else "error" for i in results}
            normal = [i for i, o in outcomes.items() if o != "error" and all(x == NORMAL for x in o)]
            if len(normal) < len(trained) or not normal:
                if len(normal) < len(trained):
                    self._spent_quorum = quorum_id
                failure = f"rollout {rollout_id}: outcomes {outcomes}"
                if not committed:
                    raise RetryableStepError(failure)
                break
            self.events.log(TrainGroupStepEndEvent(rollout_id=rollout_id, attempt=attempt, cell_outcomes=outcomes))
            committed.append((rollout_id, next((ranks[n][1] for i in normal for ranks in trained[i]
                                                if ranks[n][1] is not None), {})))
        # Seconds per commit from the ranks' clocks, of the cell that trained longest; the first commit also
        # takes what the driver spent before and around the call, and what the ranks spent after the last
        # commit (a rollout that did not commit) goes to the next attempt's first.
        slowest = max(trained.values(), key=lambda cell: max(sum(s for *_, s in ranks) for ranks in cell))
        seconds = [max(ranks[n][2] if n < len(ranks) else 0.0 for ranks in slowest) for n in range(len(rollout_ids))]
        committed_at = answered - sum(seconds[len(committed):])
        seconds[0] = committed_at - since - sum(seconds[1:len(committed)])
        commits = [Commit(rollout_id, attempt, metrics, step_s)
                   for (rollout_id, metrics), step_s in zip(committed, seconds)]
        with self._lock:
            self.spares.fill()  # replace a spare a heal used, once the group committed again: not during the heal
        return commits, committed_at, failure

    def _collect_cells(self, refs: dict[int, list[ray.ObjectRef]],
                       on_result: Callable[[Any], None] | None = None) -> dict[int, list[Any] | Exception]:
        """Every cell's per-rank results, or the exception that failed it (the cell is then stopped).

        Waits on all cells at once, so a cell that dies is failed at once — which releases its
        peers blocked in a collective with it, instead of leaving them to their timeout.
        ``on_result`` sees each rank's result as it comes in.
        """
        owner = {ref: index for index, cell_refs in refs.items() for ref in cell_refs}
        incarnation = {index: self.cells[index].incarnation for index in refs}
        failed: dict[int, Exception] = {}
        pending = list(owner)
        while pending:
            [ready], pending = ray.wait(pending, num_returns=1)
            index = owner[ready]
            try:
                result = ray.get(ready)
            except Exception as e:
                failed[index] = e
                pending = [r for r in pending if owner[r] != index]
                self._cell_failed(index, incarnation[index], by=type(e).__name__)
            else:
                if on_result is not None:
                    on_result(result)
        return {index: failed[index] if index in failed else ray.get(cell_refs)
                for index, cell_refs in sorted(refs.items())}

    # ---- first-alive-cell actions ------------------------------------------------------------------
    def execute_first_alive(self, method: str, *args: Any) -> list[Any]:
        """Run on the lowest-index alive cell; if it fails (and is stopped), try the next one."""
        while True:
            alive = self.alive_indices()
            if not alive:
                raise RuntimeError(f"{method}: no alive cell")
            [result] = self._collect_cells({alive[0]: self.cells[alive[0]].submit(method, *args)}).values()
            if not isinstance(result, Exception):
                return result
            log.warning("%s on cell %d failed (%s); trying the next alive cell", method, alive[0], result)

    def shutdown(self) -> None:
        self._watch_stop.set()
        if self._watch is not None:
            self._watch.join(timeout=5 * WATCH_POLL_S)
        with self._lock:
            for cell in self.cells:
                if cell.state != CellState.STOPPED:
                    cell.stop()
            self.spares.shutdown()


def _death_cause(lifeline: ray.ObjectRef) -> str:
    """Why a lifeline ended: ``RankProcessEnded`` (the rank's process ended), or Ray's error for its host's death."""
    try:
        ray.get(lifeline)
    except RayTaskError as e:  # raised by the host: the rank's process ended
        return type(e.cause).__name__
    except Exception as e:  # ActorDiedError and kin: the host is gone
        return type(e).__name__
    return "ActorDiedError"
