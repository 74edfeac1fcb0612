"""The train group: N cells, the quorum id, and the step / refresh / heal protocol.

One rollout is trained by ``train(rollout_id)``: up to ``max_attempts`` attempts, each of which

0. allocates fresh witness ids for the rollout's samples and logs them — every attempt, so the
   analyzer can tell a retry's samples from a discarded attempt's;
1. refreshes membership — if a cell is pending or an alive cell's quorum view is stale, bump the
   quorum id, allocate the pending cells, move every alive cell to the new cross-cell group, and
   heal the pending cells from the lowest-index alive cell (one ``CellReconfigureEvent``);
2. calls ``train`` on every rank of every alive cell and classifies each cell as errored (its call
   raised; it is already stopped), discarded (a rank's reduce failed) or normal;
3. succeeds when no cell discarded and at least one is normal — an errored cell alongside normal
   ones may have died after the exchange, so the survivors' commit stands.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import ray

from ftexp.audit.events import CellLifecycleEvent, CellReconfigureEvent, EventLogger, TrainGroupStepEndEvent
from ftexp.audit.witness import WitnessIdAllocator, WitnessInfo, allocation_event
from ftexp.trainer.cell import Cell, CellState, IndepDPInfo
from ftexp.trainer.cell_rank import DISCARDED, NORMAL

log = logging.getLogger(__name__)


class RetryableStepError(RuntimeError):
    """This attempt of a rollout did not commit; refresh and try again."""


class TrainGroup:
    def __init__(self, num_cells: int, ranks_per_cell: int, make_rank, events: EventLogger, trainer_cfg,
                 witness_allocator: WitnessIdAllocator | None = None):
        self.events = events
        self.cfg = trainer_cfg
        self.witness_allocator = witness_allocator
        self.quorum_id = 0
        # make_rank(cell index, rank within cell, incarnation) -> a Ray actor handle
        self.cells = [Cell(i, lambda c, inc: [make_rank(c, r, inc) for r in range(ranks_per_cell)])
                      for i in range(num_cells)]
        self.health = None  # set by the control plane: paused around every reconfigure
        self.on_allocated = None  # multi-node: called with each cell once its new actors answer (placement events)
        self.waiting_on: dict[int, str] = {}  # cell -> the call the loop is blocked on (for hang diagnosis)

    # ---- start-up -----------------------------------------------------------------------------
    def init(self, load_rollout_id: int | None) -> list[dict[str, Any]]:
        """Allocate every cell and join quorum 0 with all cells alive; every rank's init result."""
        alive = [c.index for c in self.cells]
        for cell in self.cells:
            cell.allocate()
        # Every actor built (its replica too) before any rank starts the cross-cell rendezvous, whose timeout
        # is short: on several nodes, or under load, one cell's actors may come up many seconds after another's.
        for cell in self.cells:
            cell.execute("ping")
        refs = {c.index: c.submit("init", IndepDPInfo.for_cell(c.index, len(self.cells), 0, alive), load_rollout_id, None)
                for c in self.cells}
        results = []
        for cell in self.cells:
            results += cell.collect(refs[cell.index])
            cell.mark_alive(IndepDPInfo.for_cell(cell.index, len(self.cells), 0, alive))
            if self.on_allocated is not None:
                self.on_allocated(cell)
        return results

    # ---- membership ---------------------------------------------------------------------------
    def alive_indices(self) -> list[int]:
        return [c.index for c in self.cells if c.is_alive]

    def stop_cell(self, index: int, by: str) -> None:
        """Suspend a cell (kill its ranks); ``by`` names who asked, for the event log."""
        if self.cells[index].state != CellState.STOPPED:
            self.events.log(CellLifecycleEvent(cell_index=index, transition="stopped", by=by))
        self.cells[index].stop()

    def start_cell(self, index: int, by: str) -> None:
        """Resume a stopped cell: it becomes Pending, and the next refresh allocates and heals it."""
        if self.cells[index].state == CellState.STOPPED:
            self.events.log(CellLifecycleEvent(cell_index=index, transition="start_requested", by=by))
        self.cells[index].start()

    def refresh(self, rollout_id: int) -> CellReconfigureEvent | None:
        pending = [c.index for c in self.cells if c.state == CellState.PENDING]
        alive = self.alive_indices()
        assert alive, "cannot recover when all cells are dead"
        will_alive = sorted(set(pending) | set(alive))
        if not pending and all(list(self.cells[i].info.alive_cell_indices) == will_alive for i in alive):
            return None
        if self.health is not None:
            self.health.pause_health()
        try:
            return self._reconfigure(rollout_id, pending, alive, will_alive)
        finally:
            if self.health is not None:
                self.health.resume_health()

    def _reconfigure(self, rollout_id: int, pending: list[int], alive: list[int],
                     will_alive: list[int]) -> CellReconfigureEvent:
        self.quorum_id += 1
        t0 = time.monotonic()
        for i in pending:
            self.cells[i].allocate()
        # Wait until the new actors exist, so the cross-cell rendezvous does not race actor start-up.
        for i in pending:
            self.cells[i].execute("ping")
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
        if failed:
            # No event. Healed cells that did come up belong to a quorum that never formed: back to
            # Pending for the next refresh. Survivors keep their old view, so it reconfigures again.
            for i in pending:
                if self.cells[i].state == CellState.ALLOCATED:
                    self.cells[i].stop()
                    self.cells[i].start()
            raise RetryableStepError(f"reconfigure to quorum {self.quorum_id} failed in cells {failed}")
        for i in will_alive:
            self.cells[i].mark_alive(info[i])
        timings: dict[str, float] = {}
        if pending:
            timings = {
                "allocate_s": t_allocated - t0,
                "configure_s": max(r["configure_s"] for rs in results.values() for r in rs),
                "transfer_s": max(r["transfer_s"] for rs in results.values() for r in rs),
                "reconfigure_total_s": time.monotonic() - t0,
            }
        event = CellReconfigureEvent(
            rollout_id=rollout_id, quorum_id=self.quorum_id, src_cell_index=src if pending else None,
            healed_cell_indices=pending, alive_cell_indices_after=will_alive, timings=timings,
            bytes_transferred=sum(r["bytes"] for r in results[src]) if pending else 0)
        self.events.log(event)
        log.info("quorum %d: alive %s (healed %s from cell %s)", self.quorum_id, will_alive, pending,
                 src if pending else None)
        return event

    # ---- one rollout --------------------------------------------------------------------------
    def train(self, rollout_id: int) -> dict[str, float]:
        backoff = self.cfg.retry_backoff_s
        for attempt in range(self.cfg.max_attempts):
            try:
                return self._attempt(rollout_id, attempt)
            except (RetryableStepError, AssertionError) as e:
                if isinstance(e, AssertionError) and not self.alive_indices():
                    raise
                log.warning("rollout %d attempt %d did not commit: %s; retrying in %.1fs", rollout_id, attempt, e, backoff)
                time.sleep(backoff)
                backoff = min(backoff * 2, self.cfg.retry_backoff_max_s)
        raise RuntimeError(f"rollout {rollout_id}: no commit after {self.cfg.max_attempts} attempts")

    def _allocate_witness(self, rollout_id: int, attempt: int) -> WitnessInfo | None:
        if self.witness_allocator is None:
            return None
        rollout = self.cfg.rollout
        witness = self.witness_allocator.allocate(rollout.rollout_batch_size * rollout.n_samples_per_prompt)
        self.events.log(allocation_event(rollout_id, attempt, witness, self.witness_allocator.counter))
        return witness

    def _attempt(self, rollout_id: int, attempt: int) -> dict[str, float]:
        witness = self._allocate_witness(rollout_id, attempt)
        self.refresh(rollout_id)
        cells = [self.cells[i] for i in self.alive_indices()]
        refs = {c.index: c.submit("train", rollout_id, attempt, witness) for c in cells}
        self.waiting_on = {c.index: f"rollout {rollout_id} attempt {attempt}: train" for c in cells}
        outcomes: dict[int, Any] = {}
        metrics: dict[str, float] | None = None
        for index, results in self._collect_cells(refs).items():
            if isinstance(results, Exception):
                log.warning("rollout %d attempt %d: cell %d errored: %s", rollout_id, attempt, index,
                            type(results).__name__)
                outcomes[index] = "error"
                continue
            outcomes[index] = [outcome for outcome, _ in results]
            metrics = metrics or next((m for _, m in results if m is not None), None)
        normal = [i for i, o in outcomes.items() if o != "error" and all(x == NORMAL for x in o)]
        discarded = [i for i, o in outcomes.items() if o != "error" and any(x == DISCARDED for x in o)]
        self.waiting_on = {}
        if discarded or not normal:
            raise RetryableStepError(f"outcomes {outcomes}")
        self.events.log(TrainGroupStepEndEvent(rollout_id=rollout_id, attempt=attempt, cell_outcomes=outcomes))
        return metrics or {}

    def _collect_cells(self, refs: dict[int, list[ray.ObjectRef]]) -> dict[int, list[Any] | Exception]:
        """Every cell's per-rank results, or the exception that failed it (the cell is then stopped).

        Waits on all cells at once, so a cell that dies is killed at once: its peers blocked in a
        collective with it then fail fast instead of waiting out their timeout.
        """
        owner = {ref: index for index, cell_refs in refs.items() for ref in cell_refs}
        failed: dict[int, Exception] = {}
        pending = list(owner)
        while pending:
            [ready], pending = ray.wait(pending, num_returns=1)
            index = owner[ready]
            try:
                ray.get(ready)
            except Exception as e:
                failed[index] = e
                self.events.log(CellLifecycleEvent(cell_index=index, transition="failed", by=type(e).__name__))
                pending = [r for r in pending if owner[r] != index]
                self._release_peers({owner[r] for r in pending})
                self.cells[index].fail()
        return {index: failed[index] if index in failed else ray.get(cell_refs)
                for index, cell_refs in sorted(refs.items())}

    def _release_peers(self, indices: set[int]) -> None:
        """Tell the ranks of these cells to stop waiting in their cross-cell collective (a peer died).

        Fire and forget: a cell that is itself dead or already past its collective ignores it.
        """
        for index in sorted(indices):
            cell = self.cells[index]
            if cell.is_alive and cell.info is not None:
                cell.submit("release_collectives", cell.info.quorum_id)

    # ---- first-alive-cell actions ------------------------------------------------------------------
    def execute_first_alive(self, method: str, *args: Any) -> list[Any]:
        """Run on the lowest-index alive cell; if it fails (and is stopped), try the next one."""
        while True:
            alive = self.alive_indices()
            if not alive:
                raise RuntimeError(f"{method}: no alive cell")
            try:
                return self.cells[alive[0]].execute(method, *args)
            except ray.exceptions.RayError as e:
                log.warning("%s on cell %d failed (%s); trying the next alive cell", method, alive[0], e)

    def shutdown(self) -> None:
        for cell in self.cells:
            if cell.state != CellState.STOPPED and cell.state != CellState.PENDING:
                cell.stop()
