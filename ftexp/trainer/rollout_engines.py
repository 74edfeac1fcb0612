"""A side's live rollout engines: start them, generate each rollout through them, push weights to them.

Modes with ``rollout_num_engines > 0`` train on-policy. Each side (baseline and target) runs its own
engines and router, owned by the side's parent process (the target's driver, the baseline's launcher):

1. ``SideEngines.start``: the policy's HF config and tokenizer go to ``<side>/engines/model`` — or,
   for a policy given as an HF checkpoint (``mode.hf_checkpoint``), the checkpoint's own directory
   is the model dir; the engines (one Ray actor each on CPU, sglang servers on GPUs) start from it,
   the sglang router in front of them. The engines' weights are random (the checkpoint's on CPU)
   until the first push.
2. ``write_rollout`` (the driver, or the baseline's rank 0): one rollout generated through the router
   from the current weights, written to the side's ``rollout_data/<id>.pt`` that every rank trains
   on — after the match guard, the injected recorded rollout instead.
3. ``WeightPusher.push`` (``ftexp.trainer.weight_push``; every rank of the replica that holds the weights:
   the target's first alive cell, the baseline's replica 0): the replica's weights in HF layout,
   broadcast by its first rank to all engines over a weight-update group; a new group whenever the
   sender changes (a crash or a heal moved the first alive cell). Before the first rollout (the
   initial sync) and after every commit.
4. ``record_update``: the engines' weight checksums, one ``InferenceEngineWeightChecksumEvent``, with
   the checksums of what the trainer holds, so an engine left with stale weights shows.
5. ``evaluate_task`` (with a task): the engines answer the task's eval set greedily; the accuracy
   is the metric ``eval/<task>``.

Multi-node jobs put the engines on rollout nodes of their own (``ftexp.placement``); the router
stays on the head (node 0), beside the process that generates through it. The target's driver pins
each engine actor to its rollout node in the job's Ray cluster and logs where each one runs (an
``EnginePlacementEvent``). The baseline has no cluster: each rollout node's task starts its node's
engines in a private Ray instance (``ftexp.trainer.baseline``) and publishes their URLs in the side's
``cluster/`` files; the head starts the router over all of them (``SideEngines.start_router``).
Engines serve on their node's address and the weight sender listens on its own toward them, so the
weight-update group spans the nodes (all of it on 127.0.0.1 on a loopback cluster).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import ray
from torch.distributed import Store

from ftexp.audit.events import (EnginePlacementEvent, EventLogger, InferenceEngineWeightChecksumEvent,
                                RolloutInjectedEvent)
from ftexp.config import RolloutBackend
from ftexp.engines.registry import get_engine
from ftexp.job import JobSpec
from ftexp.placement import node_resource
from ftexp.rollout.client import EngineClient
from ftexp.rollout.engine import ENGINE_PRELOAD, EngineGroup, EngineGroupConfig
from ftexp.rollout.live import check_injection, evaluate, generate_live_rollout
from ftexp.rollout.recorded import load_rollout, save_rollout
from ftexp.rollout.processes import free_port
from ftexp.rollout.router import Router
from ftexp.rollout.server_config import ServerConfig
from ftexp.rollout.sglang_launcher import SglangServer, SglangServerSpec
from ftexp.rollout.tokenizer import write_ascii_tokenizer
from ftexp.rollout.weight_sync import engine_checksums
from ftexp.rundir import rollout_path
from ftexp.tasks.base import Task, policy_tokenizer
from ftexp.trainer.nodes import node_of_this_process
from ftexp.trainer.weight_push import ENGINE_GROUP_TIMEOUT_S

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineAddresses:
    """What a process needs to use a side's engines: picklable, handed to ranks and actors."""

    router_url: str
    engine_urls: tuple[str, ...]


def engine_preload(spec: JobSpec) -> tuple[str, ...]:
    """What a node's fork server imports for the side's engines: our CPU engines' modules, when it runs them."""
    return ENGINE_PRELOAD if spec.live_rollout and spec.trainer.rollout.backend == RolloutBackend.cpu else ()


class SideEngines:
    """The engines and router of one side, owned by the process that starts them.

    ``events``: where the target logs each engine's placement when its engines are pinned to rollout nodes.
    """

    def __init__(self, spec: JobSpec, events: EventLogger | None = None):
        self.spec, self.events = spec, events
        self.engines: EngineGroup | None = None
        self.sglang_servers: list[SglangServer] = []
        self.router: Router | None = None

    def start(self) -> EngineAddresses:
        """Every engine of the side (on its rollout node, in a multi-node job's Ray cluster), then the router."""
        self.write_model_dir()
        placement = self.spec.placement
        engine_nodes = placement.engine_nodes if placement is not None else ()
        if self.spec.trainer.rollout.backend == RolloutBackend.cpu:
            urls = self.start_engines(self.spec.mode.rollout_num_engines, engine_nodes)
            if engine_nodes:
                self._log_placement(engine_nodes, urls)
        else:
            urls = self._start_sglang(self.model_dir)
        return self.start_router(urls)

    @property
    def model_dir(self) -> Path:
        """The directory the engines serve and the router tokenizes with: an HF checkpoint's, or the side's own."""
        if self.spec.mode.hf_checkpoint:
            return Path(self.spec.mode.hf_checkpoint).resolve()
        return self.spec.side_dir.engine_model

    def write_model_dir(self) -> None:
        """The policy's HF config and tokenizer into the side's model dir (a checkpoint is served as it is)."""
        if self.spec.mode.hf_checkpoint:
            (self.spec.side_dir.root / "engines").mkdir(parents=True, exist_ok=True)  # for the logs
            return
        get_engine(self.spec.trainer.engine).write_hf_model_dir(self.spec.mode, self.model_dir)
        write_ascii_tokenizer(self.model_dir)

    def start_engines(self, count: int, nodes: tuple[int, ...] = ()) -> list[str]:
        """``count`` CPU engine actors, engine i pinned to node ``nodes[i]`` (none: anywhere); their URLs."""
        server = ServerConfig(model_path=str(self.model_dir), weight_group_timeout_s=ENGINE_GROUP_TIMEOUT_S)
        timeout_s = self.spec.trainer.rollout.engine_start_timeout_s
        self.engines = EngineGroup(server, EngineGroupConfig(count, start_timeout_s=timeout_s,
                                                             node_resources=tuple(node_resource(n) for n in nodes)))
        return self.engines.start()

    def start_router(self, urls: list[str]) -> EngineAddresses:
        """The sglang router on this node, over every engine's URL."""
        self.router = Router(log_path=self.spec.side_dir.root / "engines" / "router.log")
        router_url = self.router.start(urls, tokenizer_path=self.model_dir)
        log.info("%d rollout engines %s behind the sglang router %s", len(urls), urls, router_url)
        return EngineAddresses(router_url=router_url, engine_urls=tuple(urls))

    def _log_placement(self, planned: tuple[int, ...], urls: list[str]) -> None:
        """Ask each engine where it runs; one event per engine (and a complaint if it is not where planned)."""
        where = ray.get([a.__ray_call__.remote(node_of_this_process) for a in self.engines.actors], timeout=60)
        for index, ((node, ray_node_id), url) in enumerate(zip(where, urls)):
            if self.events is not None:
                self.events.log(EnginePlacementEvent(engine_index=index, node=node, planned_node=planned[index],
                                                     url=url, ray_node_id=ray_node_id))
            if node != planned[index]:
                log.error("rollout engine %d runs on node %d, planned %d", index, node, planned[index])
        log.info("rollout engines on nodes %s", [node for node, _ in where])

    def _start_sglang(self, model_dir: Path) -> list[str]:
        """One real sglang server per engine on its own GPUs; dummy weights until the first push."""
        gpus = max(1, self.spec.mode.rollout_gpus_per_engine)
        for index in range(self.spec.mode.rollout_num_engines):
            server = SglangServer(SglangServerSpec(model_path=str(model_dir), port=free_port(), base_gpu_id=index * gpus,
                                                   tp_size=gpus, extra_args=("--load-format", "dummy")),
                                  log_path=self.spec.side_dir.root / "engines" / f"sglang_{index}.log")
            self.sglang_servers.append(server)
            server.start(timeout_s=self.spec.trainer.rollout.engine_start_timeout_s)
        return [server.spec.url for server in self.sglang_servers]

    def stop(self) -> None:
        if self.router is not None:
            self.router.stop()
        if self.engines is not None:
            self.engines.stop()
        for server in self.sglang_servers:
            server.stop()


ENGINES_KEY = "rollout_engines"


def publish_engines(store: Store, engines: EngineAddresses) -> None:
    """Hand the engines' addresses to processes that started before the engines were up."""
    store.set(ENGINES_KEY, json.dumps(dataclasses.asdict(engines)))


def wait_for_engines(store: Store, timeout_s: float) -> EngineAddresses:
    store.wait([ENGINES_KEY], dt.timedelta(seconds=timeout_s))
    fields = json.loads(store.get(ENGINES_KEY))
    return EngineAddresses(router_url=fields["router_url"], engine_urls=tuple(fields["engine_urls"]))


def write_rollout(spec: JobSpec, engines: EngineAddresses, rollout_id: int, events: EventLogger,
                  task: Task | None = None) -> None:
    """Generate rollout ``rollout_id`` from the engines' current weights into the side's rollout file
    (``task``: the prompts and rewards of ``spec.task``)."""
    vocab_size = get_engine(spec.trainer.engine).vocab_size(spec.mode)
    max_response_tokens = spec.task.max_response_tokens if task is not None else None
    with EngineClient(engines.router_url) as router:
        batch = generate_live_rollout(router, rollout_id, spec.trainer.rollout, vocab_size, task, max_response_tokens,
                                      tokenizer=policy_tokenizer(spec.mode))
    inject = spec.inject
    if inject is not None and rollout_id >= inject.start_rollout_id:
        recorded = load_rollout(rollout_path(inject.data_dir, rollout_id), expected_rollout_id=rollout_id)
        ratio = check_injection(batch, recorded, inject.min_match_ratio)
        events.log(RolloutInjectedEvent(rollout_id=rollout_id, match_ratio=ratio, num_samples=len(batch["samples"]),
                                        min_match_ratio=inject.min_match_ratio))
        log.info("rollout %d: the live generation matches the recorded rollout (mean token ratio %.3f > %g); "
                 "training on the recorded one", rollout_id, ratio, inject.min_match_ratio)
        batch = recorded
    save_rollout(batch, rollout_path(spec.data_dir, rollout_id))


class GroupNames:
    """Names the weight-update groups of a side: a new name whenever the sender or the engine set changes.

    A sender is a cell incarnation. The name counts the changes, so a sender that pushes again after
    another one did (cell 1, then a healed cell 0, then cell 1 again after cell 0 died) forms a new group
    rather than reusing its old one, which the engines dropped when the other sender's group formed.
    """

    def __init__(self, side: str):
        self.side, self.changes = side, 0
        self.last: tuple[int, int, int] | None = None

    def name(self, cell_index: int, incarnation: int, num_engines: int) -> str:
        if (cell_index, incarnation, num_engines) != self.last:
            self.changes += 1
            self.last = (cell_index, incarnation, num_engines)
        return f"{self.side}-{self.changes}-cell{cell_index}-{incarnation}-{num_engines}"


def record_update(events: EventLogger, engines: EngineAddresses, rollout_id: int | None,
                  trainer_checksums: dict[str, str] | None) -> None:
    """One event: every engine's weight checksums after an update, beside the trainer's."""
    events.log(InferenceEngineWeightChecksumEvent(rollout_id=rollout_id,
                                                  engine_checksums=engine_checksums(list(engines.engine_urls)),
                                                  trainer_checksums=trainer_checksums))


def evaluate_task(spec: JobSpec, engines: EngineAddresses, task: Task) -> float:
    """The eval accuracy of the policy the engines hold now."""
    with EngineClient(engines.router_url) as router:
        return evaluate(router, task, spec.task.max_response_tokens, policy_tokenizer(spec.mode))
