"""The target side's driver: Ray, the TCPStore, the train group, and the rollout loop.

Runs inside the launched training job. It starts a local Ray instance bound to 127.0.0.1, hosts
the TCPStore on which the cross-cell groups rendezvous, builds the cells, and for every rollout:
train (with retries and healing) → group-level test actions → checkpoint. Consecutive rollouts with
nothing due between them train in one call per rank (``next_run``); the audit's analyzer checks
each call's events before the next.
With live rollout engines, each rollout is first generated from the engines, and after it the
first alive cell pushes its weights to them (``ftexp.trainer.rollout_engines``). With a task, the
engines also answer its eval set before every ``eval_interval``-th rollout and after the last:
``eval/<task>`` at step r is the accuracy of the policy that generates rollout r (trained on r
rollouts after the warm-up).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import ray

from ftexp.atomic_files import write_text_atomically
from ftexp.audit.analyzer import EventAnalysisError, IncrementalAnalyzer
from ftexp.audit.events import ControlServerStartedEvent, EventLogger, ProcessIdentity
from ftexp.audit.witness import WitnessIdAllocator, allocations_between_commits
from ftexp.control.train_cells import ControlPlane
from ftexp.engines.registry import get_engine
from ftexp.faults.nodes import NodeFiles
from ftexp.faults.plan import NegativeControl, TestActionKind
from ftexp.forkserver import forkserver
from ftexp.job import JobSpec
from ftexp.placement import Placement
from ftexp.trainer.checkpoint import resume_event, start_event_log
from ftexp.trainer.group import TrainGroup
from ftexp.trainer.local_ray import start_local_ray
from ftexp.trainer.nodes import CellPlacer, RankHosts, restore_node
from ftexp.trainer.rank_process import RANK_PRELOAD
from ftexp.tasks import build_task
from ftexp.tasks.base import Task
from ftexp.trainer.rollout_engines import (EngineAddresses, GroupNames, SideEngines, engine_preload, evaluate_task,
                                           record_update, write_rollout)
from ftexp.trainer.step import record_metrics, record_step_time
from ftexp.trainer.weight_order import WeightPush
from ftexp.store import LoopbackStore

log = logging.getLogger(__name__)


def _group_actions(spec: JobSpec, group: TrainGroup, rollout_id: int) -> None:
    """The plan's ``stop_cell_at_end`` / ``start_cell_at_end`` run after the rollout committed."""
    for action in spec.plan.group_actions_after(rollout_id):
        if action.action == TestActionKind.stop_cell_at_end:
            log.info("test action: stop cell %d after rollout %d", action.cell, rollout_id)
            group.stop_cell(action.cell, by="test_action")
        elif action.action == TestActionKind.restore_node_at_end:
            log.info("test action: restore node %d (cells %s) after rollout %d", action.node, list(action.cells),
                     rollout_id)
            restore_node(NodeFiles(spec.side_dir.cluster), action.node, group.events, spec.cluster.join_timeout_s)
            for cell in action.cells:
                group.start_cell(cell, by="test_action")
        else:
            log.info("test action: start cell %d after rollout %d", action.cell, rollout_id)
            group.start_cell(action.cell, by="test_action")


class StepWatchdog:
    """Turns a hang into a failure: no commit for ``deadline_s`` → log who waits on what, then exit."""

    def __init__(self, group: TrainGroup, hosts: RankHosts, deadline_s: float):
        self.group, self.hosts, self.deadline_s = group, hosts, deadline_s
        self.last_progress = time.monotonic()
        self._stop = threading.Event()
        threading.Thread(target=self._run, name="step-watchdog", daemon=True).start()

    def progress(self) -> None:
        self.last_progress = time.monotonic()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            if time.monotonic() - self.last_progress > self.deadline_s:
                states = {c.index: c.state.value for c in self.group.cells}
                log.error("HANG: no commit for %.0f s; the driver waits on %s; cell states %s",
                          self.deadline_s, self.group.waiting_on or "nothing (between calls)", states)
                sys.stdout.flush()
                self.hosts.shutdown()  # a frozen rank would outlive us otherwise
                os._exit(3)


def _start_control_plane(spec: JobSpec, group: TrainGroup, events: EventLogger) -> ControlPlane:
    plane = ControlPlane(group, spec.control)
    port = plane.start()
    group.health = plane
    events.log(ControlServerStartedEvent(host=spec.control.host, port=port))
    # The harness (soak injector) finds the server through this file, which it polls: never half written.
    write_text_atomically(spec.side_dir.control_file, json.dumps({"base_url": plane.server.base_url, "port": port}))
    return plane


def _update_weights(spec: JobSpec, group: TrainGroup, engines: EngineAddresses, events: EventLogger,
                    rollout_id: int | None, names: GroupNames) -> None:
    """The first alive cell pushes its weights to every engine; the engines' checksums become an event.

    The weight-update group is formed anew whenever the first alive cell (incarnation) changes
    (``names``). A restarted cell is in its second incarnation or later; from the first restart on,
    the engine negative controls plant their bugs.
    """
    first = group.cells[group.alive_indices()[0]]
    healed = any(c.incarnation > 1 for c in group.cells)
    control = spec.trainer.negative_control if healed else None
    urls = engines.engine_urls
    if control == NegativeControl.stale_engine_after_heal:
        urls = urls[:-1]
    order = WeightPush(rollout_id=rollout_id, group_name=names.name(first.index, first.incarnation, len(urls)),
                       engine_urls=urls, send=control != NegativeControl.skip_engine_update_after_heal,
                       transpose_one=spec.trainer.negative_control == NegativeControl.transposed_weight_conversion)
    pushed = [c for c in group.execute_first_alive("update_weights", order) if c is not None]
    record_update(events, engines, rollout_id, pushed[0])


def _evaluate(spec: JobSpec, engines: EngineAddresses, task: Task, events: EventLogger, step: int) -> None:
    """``eval/<task>`` of the engines' policy, as the metric of ``step`` (the rollout it is about to generate)."""
    started = time.monotonic()
    accuracy = evaluate_task(spec, engines, task)
    record_metrics(spec.side_dir, events, step, 0, {task.metric_key: accuracy})
    log.info("eval before rollout %d: %s = %.4f (%d problems, %.1f s)", step, task.metric_key, accuracy,
             len(task.eval_problems()), time.monotonic() - started)


def _fail_fast(analyzer: IncrementalAnalyzer | None) -> None:
    """Stop the run at the first broken rule instead of training on from a corrupt state: before each train call,
    on the events of the calls before (``trainer.rollouts_per_call=1``: of every rollout before the next).

    With the audit off (``analyzer`` None: what a production run would use) nothing is analyzed while
    training; the verdict still checks what the log holds (e.g. the engine updates) at the end.
    """
    if analyzer is None:
        return
    issues = analyzer.check()
    if issues:
        raise EventAnalysisError(issues)


def next_run(spec: JobSpec, pending: list[int]) -> list[int]:
    """The rollouts the next train call trains, from the consecutive ``pending``: the first, and the ones after it
    that nothing has to run before — no rollout engines, no soak or control plane, no planted bug, no save and no
    test action after the one before — at most ``trainer.rollouts_per_call``.

    The audit runs at a run's edges: the analyzer checks the events of the run before, and the group hands out
    the witness ids of all its rollouts before its first; so a run's ids must fit in what the witness ring
    allows between two commits. The rollout right after a test action that stops or starts cells is a run of its
    own: its refresh shrinks or heals the group, and that quorum's first commit then reaches the driver at once,
    not after a whole run."""
    if (spec.live_rollout or spec.soak is not None
            or (spec.control is not None and spec.control.enabled) or spec.trainer.negative_control is not None):
        return pending[:1]
    if spec.plan.group_actions_after(pending[0] - 1):
        return pending[:1]
    longest = spec.trainer.rollouts_per_call
    if spec.trainer.witness_on:
        longest = min(longest, allocations_between_commits(spec.trainer.witness_buffer_size,
                                                           spec.trainer.rollout.samples))
    run = pending[:1]
    for rollout_id in pending[1:longest]:
        if spec.should_save(run[-1]) or spec.plan.group_actions_after(run[-1]):
            break
        run.append(rollout_id)
    return run


def forkserver_preload(spec: JobSpec) -> tuple[str, ...]:
    """What a node's fork server imports for the target: the ranks' modules (the engine's among them), and the
    rollout engines' where the side runs ours."""
    return (*RANK_PRELOAD, *get_engine(spec.trainer.engine).preload_modules, *engine_preload(spec))


def run_ft_driver(spec: JobSpec) -> None:
    """Train the target side: on a Ray of its own with this node's fork server, unless a multi-node job's
    launcher has started the cluster's head here already (with the head's fork server)."""
    if ray.is_initialized():
        _drive(spec)
        return
    engine = get_engine(spec.trainer.engine)
    with forkserver(forkserver_preload(spec)):
        start_local_ray(num_cpus=max(2, spec.num_cells * engine.ranks_per_replica(spec.mode)))
        _drive(spec)


def _drive(spec: JobSpec) -> None:
    witness_counter = start_event_log(spec)
    events = EventLogger(spec.side_dir.events, ProcessIdentity(component="main"))
    witness = None
    if spec.trainer.witness_on:
        witness = WitnessIdAllocator(spec.trainer.witness_buffer_size)
        witness.resume(witness_counter)
    rollouts = spec.rollout_ids()
    analyzer = IncrementalAnalyzer(spec.side_dir.events) if spec.trainer.audit else None
    ranks = get_engine(spec.trainer.engine).ranks_per_replica(spec.mode)
    # Multi-node: the store listens on the head's Ray address (127.0.0.1 on loopback), every cell pinned to its node.
    store = LoopbackStore(ray.util.get_node_ip_address() if spec.placement is not None else "127.0.0.1")
    store_addr = store.address
    placer = CellPlacer(spec.placement, events) if spec.placement is not None else None
    hosts = RankHosts(spec, store_addr, spec.placement or Placement.single_node(spec.num_cells, ranks),
                      spec.trainer.spare_cells, pinned=spec.placement is not None)

    group = TrainGroup(spec.num_cells, ranks, hosts.team, events, spec.trainer, witness)
    if placer is not None:
        group.on_allocated = placer.log_placement
    plane = watchdog = None
    soak = spec.soak
    side_engines = SideEngines(spec, events) if spec.live_rollout else None
    task = build_task(spec.task) if spec.task is not None else None
    group_names = GroupNames(spec.side)
    # The engines start while the cells do; the first weight push waits for both.
    starting = ThreadPoolExecutor(1).submit(side_engines.start) if side_engines is not None else None
    try:
        ranks_started = group.init(load_rollout_id=rollouts.start - 1 if spec.load_dir is not None else None)
        if spec.load_dir is not None:  # what was restored, for the verifier's absolute resume checks
            events.log(resume_event(spec, witness_counter, [r["last_rollout_id"] for r in ranks_started]))
        engines = starting.result() if starting is not None else None
        if engines is not None:  # the initial sync: the engines start from random weights
            _update_weights(spec, group, engines, events, None, group_names)
        if spec.control is not None and spec.control.enabled:
            plane = _start_control_plane(spec, group, events)
        if soak is not None:
            watchdog = StepWatchdog(group, hosts, soak.step_deadline_s)
        pending = list(rollouts)
        while pending:
            run, rollout_id = next_run(spec, pending), pending[0]
            pending = pending[len(run):]
            if soak is not None:
                time.sleep(soak.simulated_rollout_s)  # "generation": the window in which faults land
            if engines is not None:
                _fail_fast(analyzer)  # the previous rollout's events, its engine update too, before generating
                if task is not None and rollout_id % spec.task.eval_interval == 0:
                    _evaluate(spec, engines, task, events, rollout_id)
                write_rollout(spec, engines, rollout_id, events, task)
            started, cpu_started = time.monotonic(), time.process_time()
            _fail_fast(analyzer)  # on the previous run's events
            analyzer_s = time.monotonic() - started
            commits = group.train(run)
            cpu_s = (time.process_time() - cpu_started) / len(commits)  # the driver's CPU, shared by the run
            for n, commit in enumerate(commits):
                if watchdog is not None:
                    watchdog.progress()
                analyzed_s = analyzer_s if n == 0 else 0.0  # the analyzer ran once, before the run
                record_step_time(spec.side_dir, commit.rollout_id, commit.step_s + analyzed_s, analyzer_s=analyzed_s,
                                 cpu_s=cpu_s)
                log.info("target rollout %d committed: loss=%.6f alive=%s", commit.rollout_id,
                         commit.metrics.get("train/loss", float("nan")), group.alive_indices())
                # Nothing of this runs after a run's rollouts but its last (``next_run``).
                _group_actions(spec, group, commit.rollout_id)
                if engines is not None:  # before the save: the checkpoint's event snapshot holds this update
                    _update_weights(spec, group, engines, events, commit.rollout_id, group_names)
                if spec.should_save(commit.rollout_id):
                    group.execute_first_alive("save", commit.rollout_id)
        if task is not None and engines is not None and rollouts:
            _evaluate(spec, engines, task, events, rollouts.stop)
        _fail_fast(analyzer)
    finally:
        if side_engines is not None:
            starting.exception()  # let a start in flight finish before stopping what it started
            side_engines.stop()
        if watchdog is not None:
            watchdog.stop()
        if plane is not None:
            spec.side_dir.control_file.unlink(missing_ok=True)  # tells the harness to stop injecting
            plane.stop()
        group.shutdown()
        hosts.shutdown()
        ray.shutdown()
