"""Typed events: the run's audit trail.

Every process of a training job (the driver, each cell's actors, each plain-DP rank) appends
JSON lines to its own file ``<events_dir>/<process>.jsonl``. Each line is one event with a
``type`` discriminator, the emitting process (``source``) and a UTC ``timestamp``. The
verifier reads these files back to prove what happened: which steps committed, which cells
were shrunk out or healed, which samples each committed step trained (witness ids), which metrics
were logged.

Writing re-opens the file in append mode for every event, so the directory can be swapped
(checkpoint restore) between two events without a stale handle.
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime as _dt
import json
import logging
import threading
import time
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from ftexp.errors import RunDirError, file_error

log = logging.getLogger(__name__)


class ProcessIdentity(BaseModel):
    """Who wrote an event: ``main`` (driver), ``actor`` (a cell's rank) or ``dp`` (a plain-DP rank)."""

    model_config = ConfigDict(extra="forbid")
    component: Literal["main", "actor", "dp"]
    cell_index: int | None = None
    rank_within_cell: int | None = None

    @property
    def process_name(self) -> str:
        if self.component == "actor":
            return f"actor_cell{self.cell_index}_rank{self.rank_within_cell}"
        if self.component == "dp":
            return f"dp_rank{self.rank_within_cell}"
        return "main"


class _Event(BaseModel):
    # NaN/inf metrics must survive the round trip (pydantic would write them as null).
    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="constants")
    timestamp: _dt.datetime = Field(default_factory=lambda: _dt.datetime.now(_dt.timezone.utc))
    source: ProcessIdentity = Field(default_factory=lambda: ProcessIdentity(component="main"))


class MetricEvent(_Event):
    type: Literal["metric"] = "metric"
    rollout_id: int | None = None
    attempt: int | None = None
    metrics: dict[str, Any]


class CellReconfigureEvent(_Event):
    type: Literal["cell_reconfigure"] = "cell_reconfigure"
    rollout_id: int
    quorum_id: int
    src_cell_index: int | None
    healed_cell_indices: list[int]
    alive_cell_indices_after: list[int]
    # Heal timings (seconds) and bytes, for the report; empty for a pure shrink.
    timings: dict[str, float] = Field(default_factory=dict)
    bytes_transferred: int = 0
    transfer_connections: int = 0  # the connections those bytes took: one per rank of each healed cell
    spare_cell_indices: list[int] = Field(default_factory=list)  # healed cells that took a warm spare's ranks


class TrainGroupStepEndEvent(_Event):
    type: Literal["train_group_step_end"] = "train_group_step_end"
    rollout_id: int
    attempt: int = 0
    # cell_index -> "error" | per-actor outcomes ("normal" | "discarded_should_retry")
    cell_outcomes: dict[int, Union[Literal["error"], list[Literal["normal", "discarded_should_retry"]]]]


class TrainEngineLocalWeightChecksumEvent(_Event):
    type: Literal["train_engine_local_weight_checksum"] = "train_engine_local_weight_checksum"
    rollout_id: int
    attempt: int = 0
    # {"param_hashes": {name: sha256}, "optimizer_hashes": {...}, ...}
    state: dict[str, Any]


class InferenceEngineWeightChecksumEvent(_Event):
    """The rollout engines' weights after an ``update_weights`` (one dict per engine, HF tensor name -> hash).

    ``rollout_id`` is None for the initial sync, before the first rollout is generated.
    """

    type: Literal["inference_engine_weight_checksum"] = "inference_engine_weight_checksum"
    rollout_id: Optional[int]
    engine_checksums: list[dict[str, str]]
    # The same hashes of the weights the trainer pushed (its HF export), so an engine that kept
    # stale weights differs from them even when all engines agree with each other.
    trainer_checksums: Optional[dict[str, str]] = None


class RolloutInjectedEvent(_Event):
    """A live rollout was replaced by another run's recorded one after the match guard passed."""

    type: Literal["rollout_injected"] = "rollout_injected"
    rollout_id: int
    num_samples: int
    match_ratio: float          # mean response-token match ratio, live vs recorded
    min_match_ratio: float      # the guard's threshold (strictly above)


class WitnessAllocateIdEvent(_Event):
    type: Literal["witness_allocate_id"] = "witness_allocate_id"
    rollout_id: int
    attempt: int
    witness_id_to_sample_index: dict[int, int]
    counter_after: int


class WitnessSnapshotParamEvent(_Event):
    """After a committed step: which rows of one witness instance are non-zero."""

    type: Literal["witness_snapshot_param"] = "witness_snapshot_param"
    rollout_id: int
    attempt: int
    instance_id: str
    # The non-zero rows and the slots this step zeroed, as half-open [start, stop) ranges. The
    # reference logs both as lists of ids: ~1M stale ints per event at its default buffer size, and
    # non-zero ids that grow by a rollout's samples with every commit (a 200-rollout soak's run dir
    # grew 2.3x per rollout). Non-zero rows form a few runs (a rollout's ids are consecutive, broken
    # only by zero-advantage samples), so as ranges the event stays small.
    nonzero_witness_id_ranges: list[tuple[int, int]]
    stale_id_ranges: list[tuple[int, int]]


class TrainAdvantageComputationEvent(_Event):
    """Per local sample and response token: the advantage and the sample's witness id.

    A sample whose advantages are all exactly 0 gets no gradient, so its witness rows stay 0; the
    analyzer excuses it. An empty list (no local token) is not such a sample.
    """

    type: Literal["train_advantage_computation"] = "train_advantage_computation"
    rollout_id: int
    attempt: int
    advantages: list[list[float]]
    witness_ids: list[list[int]]


class CellLifecycleEvent(_Event):
    """A step of a cell's way out of the quorum and back, as the driver saw it (the soak's timeline).

    ``failed``: a call on the cell raised (its process died, or it errored) — the driver's detection;
    ``stopped`` / ``start_requested``: the cell was suspended / resumed (by the control plane or a
    test action, named in ``by``). The rest of the way back is the reconfigure event that heals it.
    """

    type: Literal["cell_lifecycle"] = "cell_lifecycle"
    cell_index: int
    transition: Literal["failed", "stopped", "start_requested"]
    by: str = ""                      # who asked: "control_plane", "test_action", or the failed call
    rollout_id: int | None = None
    attempt: int | None = None


class TrainResumeEvent(_Event):
    """A job resumed from a checkpoint: logged once, after its state and event log were restored.

    ``loaded_rollout_ids`` is what the loaded rank states say they last committed (one entry per
    loaded state file); ``witness_counter`` the witness counter the job continues from, read from
    the restored event log.
    """

    type: Literal["train_resume"] = "train_resume"
    checkpoint_rollout_id: int
    loaded_rollout_ids: list[int]
    first_rollout_id: int
    witness_counter: int


class ControlServerStartedEvent(_Event):
    """Where the run's control server listens (port 0 in the config means a free port was picked)."""

    type: Literal["control_server_started"] = "control_server_started"
    host: str
    port: int


class FaultInjectedEvent(_Event):
    """Positive proof that a planned fault fired (written by the process just before it dies)."""

    type: Literal["fault_injected"] = "fault_injected"
    rollout_id: int | None = None
    attempt: int | None = None
    action: str
    cell_index: int | None = None
    rank: int | None = None
    node_index: int | None = None     # a node fault: the node taken away (with every cell on it)


class CellPlacementEvent(_Event):
    """Where one incarnation of a cell runs (multi-node jobs): each rank's node, as the rank itself reports it."""

    type: Literal["cell_placement"] = "cell_placement"
    cell_index: int
    incarnation: int
    rank_nodes: list[int]             # [rank within cell] -> node index
    planned_rank_nodes: list[int]     # what the placement asked for
    ray_node_ids: list[str] = Field(default_factory=list)


class EnginePlacementEvent(_Event):
    """Where one rollout engine runs (multi-node jobs: on a rollout node), as the engine's process reports it."""

    type: Literal["engine_placement"] = "engine_placement"
    engine_index: int
    node: int                         # the node index the engine's process runs on
    planned_node: int                 # what the placement asked for
    url: str                          # where it serves (the router and the weight sender reach it there)
    ray_node_id: str | None = None


class NodeStateEvent(_Event):
    """A node of a multi-node job came back after a node fault (``rejoined``), with how long it took."""

    type: Literal["node_state"] = "node_state"
    node_index: int
    state: Literal["lost", "rejoined"]
    ray_node_id: str | None = None
    timings: dict[str, float] = Field(default_factory=dict)  # down_s (away), rejoin_s (asked back -> alive)


Event = Annotated[
    Union[
        MetricEvent,
        CellReconfigureEvent,
        TrainGroupStepEndEvent,
        TrainEngineLocalWeightChecksumEvent,
        InferenceEngineWeightChecksumEvent,
        RolloutInjectedEvent,
        WitnessAllocateIdEvent,
        WitnessSnapshotParamEvent,
        TrainAdvantageComputationEvent,
        FaultInjectedEvent,
        CellPlacementEvent,
        EnginePlacementEvent,
        NodeStateEvent,
        ControlServerStartedEvent,
        CellLifecycleEvent,
        TrainResumeEvent,
    ],
    Field(discriminator="type"),
]
_EVENT_ADAPTER: TypeAdapter[Event] = TypeAdapter(Event)


class EventLogger:
    """Appends events of one process to ``<events_dir>/<process_name>.jsonl``.

    ``context(**fields)`` scopes fields (e.g. rollout_id, attempt) that are filled into every
    event logged inside it that has such a field and did not set it explicitly.
    """

    def __init__(self, events_dir: str | Path, source: ProcessIdentity):
        self.events_dir = Path(events_dir)
        self.source = source
        self._lock = threading.Lock()
        self.write_s = 0.0  # seconds spent logging, for the benchmark's step breakdown
        self._context: contextvars.ContextVar[dict[str, Any]] = contextvars.ContextVar(
            f"ftexp_event_ctx_{id(self)}", default={}
        )

    @property
    def path(self) -> Path:
        return self.events_dir / f"{self.source.process_name}.jsonl"

    @contextlib.contextmanager
    def context(self, **fields: Any):
        token = self._context.set({**self._context.get(), **fields})
        try:
            yield
        finally:
            self._context.reset(token)

    def log(self, event: _Event) -> _Event:
        started = time.perf_counter()
        explicit = event.model_fields_set
        updates = {k: v for k, v in self._context.get().items() if k in type(event).model_fields and k not in explicit}
        if "source" not in explicit:
            updates["source"] = self.source
        event = event.model_copy(update=updates)
        line = event.model_dump_json()
        with self._lock:
            self.events_dir.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a") as f:
                f.write(line + "\n")
        self.write_s += time.perf_counter() - started
        return event


def parse_event(line: str) -> Event:
    return _EVENT_ADAPTER.validate_json(line)


# The verifier's checks each ask for the same few event dirs: parse each dir once while its files
# are unchanged (the key holds every file's size and modification time).
_CACHE_SIZE = 8
_cache: dict[tuple, list] = {}


def read_events(events_dir: str | Path, *, strict: bool = True) -> list[Event]:
    """All events under ``events_dir`` (``**/*.jsonl`` sorted by path, then line order).

    Parsed once per state of the files: a later call on unchanged files returns a copy of the
    same list.
    """
    root = Path(events_dir)
    try:
        stats = [(str(p), p.stat()) for p in sorted(root.glob("**/*.jsonl"))]
        key = (str(root.resolve()), strict, tuple((p, st.st_size, st.st_mtime_ns) for p, st in stats))
    except OSError:  # a file vanished meanwhile: read without the cache
        return _read_events(root, strict=strict)
    if key not in _cache:
        if len(_cache) >= _CACHE_SIZE:
            del _cache[next(iter(_cache))]
        _cache[key] = _read_events(root, strict=strict)
    return list(_cache[key])


def _read_events(events_dir: Path, *, strict: bool) -> list[Event]:
    """``read_events`` without the cache.

    ``strict`` (the verifier's default) raises RunDirError (a ValueError), one line naming the
    file and line, on an unparseable line or an unreadable file: a corrupt audit trail must not
    read as an empty or passing one. A missing directory yields ``[]``.
    """
    root = Path(events_dir)
    events: list[Event] = []
    if not root.is_dir():
        return events
    for path in sorted(root.glob("**/*.jsonl")):
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as e:  # not permitted, vanished, or not text at all
            if strict:
                raise file_error(path, e, "event log") from e
            log.warning("skipping unreadable event log %s: %s", path, e)
            continue
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                events.append(parse_event(line))
            except (ValidationError, json.JSONDecodeError) as e:
                if strict:
                    cause = e.errors()[0]["msg"] if isinstance(e, ValidationError) else str(e)
                    raise RunDirError(f"{path}:{lineno}: not a valid event: {cause}") from e
                log.warning("skipping unparseable event %s:%d", path, lineno)
    return events


class EventTail:
    """Reads an event dir incrementally: each call returns only the events appended since the last.

    Per file it remembers how many bytes it consumed and parses only whole new lines, so a long
    run's log is read once in total, not once per rollout. Files are visited in path order, like
    ``read_events``.
    """

    def __init__(self, events_dir: str | Path):
        self.root = Path(events_dir)
        self._offsets: dict[Path, int] = {}

    def read_new(self) -> list[Event]:
        events: list[Event] = []
        if not self.root.is_dir():
            return events
        for path in sorted(self.root.glob("**/*.jsonl")):
            offset = self._offsets.get(path, 0)
            with open(path, "rb") as f:
                f.seek(offset)
                chunk = f.read()
            complete = chunk[: chunk.rfind(b"\n") + 1]  # a line still being written waits for the next call
            self._offsets[path] = offset + len(complete)
            for line in complete.decode().splitlines():
                if line.strip():
                    events.append(parse_event(line))
        return events
