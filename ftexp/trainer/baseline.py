"""The baseline: plain data parallelism in one torch.distributed gloo world.

``num_cells × ranks-per-replica`` processes form one world. Data-parallel replica d trains strided
shard d of every rollout; with the torch engine (one rank per replica) the gradients are
SUM-reduced over the world here (a fixed-order fold in deterministic mode), with megatron its DDP
reduces them over its data-parallel groups itself. Nothing here tolerates faults: this is the
reference the fault-tolerant target must reproduce. The ranks of replica 0 write the dumps and
checkpoints (one file per rank), rank 0 the metrics. With live rollout engines, rank 0 generates
every rollout through them and replica 0 pushes its weights to them after every step. On one node
the parent process starts the engines (Ray actors of a private Ray instance) and the router; in a
multi-node job each rollout node's task starts its own engines that way and the head's parent
fronts them all with the router (``ftexp.trainer.rollout_engines``).

Witness ids: there is no driver and no retry, so every rank runs its own copy of the allocator
from the same resumed counter (read once by the parent, after the event restore) and allocates
the same ids; rank 0 logs the allocations, which is what the next phase resumes from.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import multiprocessing as mp
import sys
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial

import ray
import torch
import torch.distributed as dist

from ftexp.audit.events import EventLogger, ProcessIdentity
from ftexp.audit.witness import WitnessIdAllocator, allocation_event
from ftexp.engines.collectives import sum_across
from ftexp.engines.registry import get_engine
from ftexp.faults.nodes import NodeFiles
from ftexp.forkserver import forkserver
from ftexp.job import JobSpec
from ftexp.rollout.recorded import load_rollout
from ftexp.rundir import rollout_path
from ftexp.trainer.checkpoint import (complete_checkpoint, load_rank_state, resume_event, save_rank_state,
                                      start_event_log)
from ftexp.trainer.local_ray import start_local_ray
from ftexp.trainer.rollout_engines import (EngineAddresses, SideEngines, engine_preload, publish_engines,
                                           record_update, wait_for_engines, write_rollout)
from ftexp.trainer.step import (SectionTimer, record_metrics, record_sections, record_step_time, settle_heap,
                                train_step)
from ftexp.trainer.weight_order import WeightPush
from ftexp.trainer.weight_push import WeightPusher
from ftexp.store import LoopbackStore

log = logging.getLogger(__name__)
NODE_DONE_GRACE_S = 60.0


def _rank_main(spec: JobSpec, rank: int, world_size: int, store_port: int, witness_counter: int,
               store_host: str = "127.0.0.1") -> None:
    torch.set_num_threads(spec.trainer.threads_per_rank)
    torch.use_deterministic_algorithms(spec.deterministic)
    store = dist.TCPStore(store_host, store_port, is_master=False, timeout=dt.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                            timeout=dt.timedelta(seconds=spec.trainer.world_timeout_s))
    events = EventLogger(spec.side_dir.events, ProcessIdentity(component="dp", rank_within_cell=rank))
    replica = get_engine(spec.trainer.engine).build_replica(spec.trainer, spec.mode, seed=spec.seed,
                                                              deterministic=spec.deterministic)
    dp_rank, dp_size = replica.data_parallel
    if spec.load_dir is not None:
        replica.load_state_dict(load_rank_state(spec.load_dir, spec.start_rollout_id() - 1, replica.coords))
        loaded = [torch.zeros(1, dtype=torch.int64) for _ in range(world_size)]
        dist.all_gather(loaded, torch.tensor([replica.last_rollout_id]))
        if rank == 0:  # what was restored, for the verifier's absolute resume checks
            events.log(resume_event(spec, witness_counter, [int(t) for t in loaded]))
    allocator = None
    if spec.trainer.witness_on:
        allocator = WitnessIdAllocator(spec.trainer.witness_buffer_size)
        allocator.resume(witness_counter)

    timer = SectionTimer()  # this rank's step breakdown, as the target's ranks record theirs

    def reduce(flat: torch.Tensor) -> bool:
        if not replica.reduces_data_parallel:
            with timer.section("reduce_s"):
                sum_across(None, flat, world_size=world_size, deterministic=spec.deterministic, torchft=False)
        return True

    def dump(leaf) -> None:
        with timer.section("dump_s"):
            replica.dump(leaf)

    engines = wait_for_engines(store, spec.trainer.rollout.engine_start_timeout_s) if spec.live_rollout else None
    pusher = WeightPusher() if engines is not None else None

    def update_weights(rollout_id: int | None) -> None:
        """Replica 0 pushes its weights to the engines: every rank takes part in the export (experts
        may sit on any DP rank), replica 0's first rank sends."""
        order = WeightPush(rollout_id=rollout_id, group_name=f"baseline-{spec.phase}", engine_urls=engines.engine_urls)
        pushed = pusher.push(replica, order)
        if pushed is not None:
            record_update(events, engines, rollout_id, pushed)
        dist.barrier()  # no rank generates from the engines before they hold the new weights

    if engines is not None:  # the initial sync: the engines start from random weights
        update_weights(None)
    settle_heap()
    for rollout_id in spec.rollout_ids():
        if engines is not None:
            if rank == 0:
                write_rollout(spec, engines, rollout_id, events)
            dist.barrier()
        started = time.monotonic()  # like the target's step, which loads the rollout in its ranks
        cpu_started = time.process_time()
        timer.seconds.clear()
        rollout = load_rollout(rollout_path(spec.data_dir, rollout_id), expected_rollout_id=rollout_id)
        on_commit = (lambda: dump(spec.side_dir.dump_leaf(rollout_id))) if dp_rank == 0 else (lambda: None)
        witness = allocator.allocate(len(rollout["samples"])) if allocator is not None else None
        if witness is not None and rank == 0:
            events.log(allocation_event(rollout_id, 0, witness, allocator.counter))
        _, metrics = train_step(replica, rollout, rollout_id, 0, shard_rank=dp_rank, shard_size=dp_size,
                                witness=witness, events=events, reduce=reduce, on_commit=on_commit, timer=timer)
        if rank == 0:  # as the target's first cell does inside its train call
            record_metrics(spec.side_dir, events, rollout_id, 0, metrics)
        record_sections(spec.side_dir, rollout_id, 0, None, rank,
                        dict(timer.breakdown(time.monotonic() - started), cpu_s=time.process_time() - cpu_started))
        dist.barrier()  # every rank committed: the step's end (``record_step_time`` says what both sides time)
        if rank == 0:
            record_step_time(spec.side_dir, rollout_id, time.monotonic() - started)
            log.info("baseline rollout %d committed: loss=%.6f", rollout_id, metrics["train/loss"])
        if engines is not None:  # before the save: the checkpoint's event snapshot holds this update
            update_weights(rollout_id)
        if spec.should_save(rollout_id):
            if dp_rank == 0:
                save_rank_state(replica, spec.side_dir.ckpt, rollout_id)
            dist.barrier()  # every rank's checkpoint file is written before rank 0 declares it complete
            if rank == 0:
                complete_checkpoint(spec.side_dir.ckpt, rollout_id, spec.side_dir.events)
    if pusher is not None:
        pusher.close()
    dist.destroy_process_group()


def _rank_entry(spec: JobSpec, rank: int, world_size: int, store_port: int, witness_counter: int,
                store_host: str = "127.0.0.1") -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                        format=f"[%(asctime)s] dp_rank{rank} %(name)s: %(message)s", datefmt="%H:%M:%S")
    _rank_main(spec, rank, world_size, store_port, witness_counter, store_host)


def _meet_head(spec: JobSpec, node: int, files: NodeFiles | None, host: str, join_timeout_s: float):
    """(store host, store port, witness counter, the store if this is the head). On a multi-node job task 0
    hosts the world's store and publishes it; every other task waits for that."""
    if node == 0:
        witness_counter = start_event_log(spec)
        store = LoopbackStore(host)
        if files is not None:
            files.publish("head", {"store": store.address, "witness_counter": witness_counter})
        return host, store.port, witness_counter, store
    head = files.wait_for("head", join_timeout_s, abandon=files.finished)
    if head is None:
        raise RuntimeError(f"baseline node{node}: the head (task 0) published no store within {join_timeout_s:g} s")
    store_host, port = head["store"].rsplit(":", 1)
    return store_host, int(port), head["witness_counter"], None


def run_baseline(spec: JobSpec, node: int = 0, files: NodeFiles | None = None, host: str = "127.0.0.1",
                 join_timeout_s: float = 180.0) -> None:
    """Run the baseline side to completion; raise if any rank fails.

    On a multi-node job (``spec.placement``) every node's task runs this with its ``node`` index and
    forks only the ranks placed on it (``Placement.baseline_ranks_on``); the world spans the nodes.
    """
    try:
        _run_baseline_ranks(spec, node, files, host, join_timeout_s)
    except BaseException as e:
        if files is not None:  # the other nodes' ranks are stuck on this node's: they stop at once
            files.mark_failed(node, f"{type(e).__name__}: {e}")
        raise
    finally:
        if files is not None and node == 0:
            files.finish()  # tells the other nodes' tasks, whose ranks are then done (or stuck on a dead peer)


def _run_baseline_ranks(spec: JobSpec, node: int, files: NodeFiles | None, host: str, join_timeout_s: float) -> None:
    side_engines = SideEngines(spec) if spec.live_rollout else None
    on_rollout_nodes = side_engines is not None and spec.placement is not None and bool(spec.placement.engine_nodes)
    if on_rollout_nodes and node == 0:
        side_engines.write_model_dir()  # before the head publishes itself: the rollout nodes' engines serve it
    store_host, store_port, witness_counter, store = _meet_head(spec, node, files, host, join_timeout_s)
    if on_rollout_nodes and node in spec.placement.rollout_nodes:
        _serve_engines(spec, side_engines, node, files, host)
        return
    starting = None
    with contextlib.ExitStack() as engines_ray:
        if side_engines is not None and node == 0:
            if on_rollout_nodes:  # the router here, over the engines the rollout nodes' tasks publish
                start = partial(_route_rollout_node_engines, spec, files, side_engines)
            else:  # engines are Ray actors: a private Ray instance for this side
                engines_ray.enter_context(_ray_for_engines(spec))
                start = side_engines.start
            # The engines start while the ranks import and build their models; every rank waits for
            # their addresses on the store before the initial weight sync.
            starting = ThreadPoolExecutor(1).submit(lambda: publish_engines(store.store, start()))
        try:
            _run_ranks(spec, node, files, store_host, store_port, witness_counter, starting)
        finally:
            if starting is not None:
                starting.exception()  # let a start in flight finish before stopping what it started
                side_engines.stop()


@contextlib.contextmanager
def _ray_for_engines(spec: JobSpec, node_ip: str = "127.0.0.1") -> Iterator[None]:
    """A private Ray instance for the side's engine actors on this node, with the fork server their processes
    start from (imports done)."""
    with forkserver(engine_preload(spec)):
        start_local_ray(num_cpus=2, node_ip=node_ip)
        try:
            yield
        finally:
            ray.shutdown()


def _serve_engines(spec: JobSpec, side_engines: SideEngines, node: int, files: NodeFiles, host: str) -> None:
    """A rollout node's task: its engines in a private Ray instance on the node's address, their URLs published for
    the head's router (``engines<node>``), serving until the head is done."""
    engines = spec.placement.engines_on(node)
    with _ray_for_engines(spec, host) if engines else contextlib.nullcontext():
        try:
            if engines:
                urls = side_engines.start_engines(len(engines))
                files.publish(f"engines{node}", {"engines": engines, "urls": urls})
                log.info("baseline node%d (a rollout node): engines %s at %s", node, engines, urls)
            while not files.finished():
                time.sleep(0.2)
        finally:
            side_engines.stop()


def _route_rollout_node_engines(spec: JobSpec, files: NodeFiles, side_engines: SideEngines) -> EngineAddresses:
    """The router on the head over every engine, in engine order, as the rollout nodes' tasks publish them."""
    timeout_s = spec.cluster.join_timeout_s + spec.trainer.rollout.engine_start_timeout_s
    urls = []
    for node in sorted(set(spec.placement.engine_nodes)):
        published = files.wait_for(f"engines{node}", timeout_s, abandon=lambda: node in files.failed_tasks())
        if published is None:
            raise RuntimeError(f"baseline: rollout node{node} published no engines within {timeout_s:g} s "
                               f"(its lines in train.log say why)")
        urls += published["urls"]
    return side_engines.start_router(urls)


def rank_start_context(fresh: bool, preload_modules: tuple[str, ...]) -> mp.context.BaseContext:
    """How the baseline's rank processes start.

    By default they fork from a server that imported the trainer (and megatron-core) once: 8 fresh
    imports of megatron cost ~50 CPU-seconds on 2 cores. torch's compiler too: a torch optimizer
    imports it when it is built (1.4 CPU-seconds a rank). The server forks before any rank creates
    threads or process groups, so each rank still starts clean (the target's ranks fork the same way,
    from their node's fork server). ``fresh``: each rank is a new interpreter that imports on its own.
    """
    if fresh:
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__, "torch._dynamo", *preload_modules])
    return ctx


def _run_ranks(spec: JobSpec, node: int, files: NodeFiles | None, store_host: str, store_port: int,
               witness_counter: int, engines_starting: Future | None) -> None:
    engine = get_engine(spec.trainer.engine)
    ctx = rank_start_context(spec.trainer.fresh_baseline_ranks, engine.preload_modules)
    world_size = spec.num_cells * engine.ranks_per_replica(spec.mode)
    ranks = range(world_size) if spec.placement is None else spec.placement.baseline_ranks_on(node)
    procs = [ctx.Process(target=_rank_entry, args=(spec, r, world_size, store_port, witness_counter, store_host),
                         name=f"dp_rank{r}") for r in ranks]
    for p in procs:
        p.start()
    # A dead rank leaves its peers blocked in a collective: stop them all as soon as one fails
    # (on a multi-node job: as soon as another node's task reports a failure, or the head is long done).
    done_since = None
    while any(p.is_alive() for p in procs):
        failed = [(p.name, p.exitcode) for p in procs if p.exitcode not in (None, 0)]
        if files is not None and not failed:
            failed = [(f"node{i}", why) for i, why in files.failed_tasks().items() if i != node]
            if node != 0 and files.finished():
                done_since = done_since or time.monotonic()
                if time.monotonic() - done_since > NODE_DONE_GRACE_S:
                    failed = [("node0", "the head finished while this node's ranks still ran")]
        if not failed and engines_starting is not None and engines_starting.done() and engines_starting.exception():
            failed = [("rollout engines", str(engines_starting.exception()))]
        if failed:
            for p in procs:
                p.terminate()
            raise RuntimeError(f"baseline ranks failed (name, exit code): {failed}")
        time.sleep(0.2)
    failed = [(p.name, p.exitcode) for p in procs if p.exitcode != 0]
    if failed:
        raise RuntimeError(f"baseline ranks failed (name, exit code): {failed}")
