"""Structured configs: the schema behind every Hydra config group.

Hydra composes ``ftexp/conf/config.yaml`` + the chosen ``mode/``, ``scenario/``, ``threshold/``,
``trainer/``, ``launcher/`` and ``tracking/`` files onto these dataclasses, so a typo'd key or a
value of the wrong type fails at compose time. Checks that span groups (can this engine run this
mode? do the predicates parse?) live in :func:`validate`.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from ftexp.errors import InputError
from ftexp.trainer.model import ModelConfig
from ftexp.trainer.rollout_data import RolloutConfig


class Stage(enum.Enum):
    run = "run"            # prepare → baseline/target per phase → compare
    prepare = "prepare"    # record the rollout data only
    baseline = "baseline"  # one side only (debugging); honours `phase=`
    target = "target"
    compare = "compare"    # re-verify an existing run_dir, no training
    collect = "collect"    # wait for a run submitted with launcher.wait=false, then report its verdict


class Engine(enum.Enum):
    torch = "torch"        # builtin tiny GPT, one rank per cell
    megatron = "megatron"  # megatron-core GPT: TP/SP/PP/CP/EP cells of tp·pp·cp ranks


@dataclass
class ModeConfig:
    """A parallel layout from the seed table (or a CPU mode): what one experiment runs on."""

    name: str = MISSING
    description: str = ""
    num_cells: int = MISSING          # independent-DP cells in the target (= DP size of the baseline)
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1
    sequence_parallel: bool = False
    decoder_first_pipeline_num_layers: Optional[int] = None
    decoder_last_pipeline_num_layers: Optional[int] = None
    nodes: int = 1
    train_gpus_per_node: int = 0      # 0: a CPU mode
    rollout_num_engines: int = 0      # > 0: real rollout engines instead of recorded data
    rollout_gpus_per_engine: int = 0
    colocate: bool = False
    ft_components: list[str] = field(default_factory=lambda: ["train"])
    model_preset: str = "tiny_dense"  # CPU-scale stand-in for reference_model
    reference_model: str = ""         # the model the seed runs on GPUs
    engines: list[Engine] = field(default_factory=lambda: [Engine.torch])  # able to run it; the first is the default

    @property
    def ranks_per_cell(self) -> int:
        return self.tp * self.pp * self.cp


class TestActionKind(enum.Enum):
    crash_before_allreduce = "crash_before_allreduce"  # actor-level: exit hard before the reduce
    stop_cell_at_end = "stop_cell_at_end"              # group-level, after the rollout commits
    start_cell_at_end = "start_cell_at_end"


@dataclass
class TestAction:
    """One planned fault (spec §8.1). ``cell_index`` -1 means the last cell."""

    __test__ = False  # not a pytest class
    at_rollout: int = MISSING
    action: TestActionKind = MISSING
    cell_index: int = -1
    rank: int = 0
    attempt: int = 0


@dataclass
class PhaseConfig:
    """One training run per side. Multi-phase scenarios resume a later phase from an earlier one."""

    name: str = ""                        # "" for single-phase scenarios
    load_from: Optional[str] = None       # resume from this earlier phase's checkpoint
    save_interval: Optional[int] = None   # checkpoint every k rollouts (and at the last one)
    exit_after_rollouts: Optional[int] = None  # stop after K rollouts of this run
    target_actions: list[TestAction] = field(default_factory=list)


@dataclass
class ControlConfig:
    """The control plane of the target driver (spec §6–7): HTTP API, heartbeats, mini controller."""

    enabled: bool = False
    host: str = "127.0.0.1"
    port: int = 0                         # 0: pick a free port (recorded in the events and the log)
    heartbeat_interval_s: float = 10.0
    heartbeat_timeout_s: float = 10.0
    heartbeat_first_wait_s: float = 300.0
    heartbeat_failure_threshold: int = 3
    controller: bool = True               # the mini FT controller heals unhealthy/suspended cells
    controller_poll_interval_s: float = 10.0
    controller_resume_delay_s: float = 10.0

    @property
    def detection_s(self) -> float:
        """Worst case from a frozen cell to Healthy=False: threshold checks, each interval + timeout."""
        return self.heartbeat_failure_threshold * (self.heartbeat_interval_s + self.heartbeat_timeout_s)


@dataclass
class SoakConfig:
    """Random fault injection against the control server (spec §8.3), for non-comparison scenarios."""

    enabled: bool = False
    crash_probability: float = 0.5
    # Mean seconds between injections = time_unit_s / crash_probability (the reference uses 60 s).
    time_unit_s: float = 60.0
    modes: list[str] = field(default_factory=lambda: ["sigkill", "exit", "segfault"])
    first_mode: Optional[str] = None      # force the first injection's mode (e.g. deadlock)
    poll_interval_s: float = 2.0
    min_injections: int = 2
    min_heals: int = 2
    simulated_rollout_s: float = 0.0      # stands in for generation time, so faults land mid-run
    step_deadline_s: float = 600.0        # no commit for this long = a hang: fail with a diagnosis


@dataclass
class ScenarioConfig:
    name: str = MISSING
    num_rollout: int = MISSING            # exclusive end rollout id
    num_steps: Optional[int] = None       # soak scenarios: rollouts to train (num_rollout follows it)
    deterministic: bool = False           # fixed-order reductions + deterministic kernels
    phases: list[PhaseConfig] = field(default_factory=lambda: [PhaseConfig()])
    control: ControlConfig = field(default_factory=ControlConfig)
    soak: SoakConfig = field(default_factory=SoakConfig)


@dataclass
class MetricThreshold:
    prefixes: list[str] = MISSING
    rtol: float = MISSING
    atol: float = 0.0
    exclude: list[str] = field(default_factory=list)


@dataclass
class ThresholdConfig:
    """How close the target must be to the baseline. ``dumps`` is an ordered [regex, predicate] list."""

    name: str = MISSING
    dumps: list[list[str]] = MISSING      # the seed's rules (calibrated for bf16 GPU kernels)
    # Extra rules checked too when training in fp32 on CPU, where the measured noise is ~1e-11
    # (rel) — so a 2% gradient error, invisible to rel <= 0.0085, still turns the verdict red.
    fp32_dumps: list[list[str]] = field(default_factory=list)
    metrics: list[MetricThreshold] = MISSING
    exclude_pattern: Optional[str] = ".*witness.*"
    allow_skipped_pattern: Optional[str] = None
    allow_failed_pattern: Optional[str] = None


class NegativeControl(enum.Enum):
    """Deliberate healing and retry bugs, for tests proving the verdict turns red. Never on by default."""

    skip_heal_transfer = "skip_heal_transfer"          # healed cell keeps its fresh initial state
    skip_optimizer_transfer = "skip_optimizer_transfer"  # healed cell gets weights but no optimizer state
    # Every cell commits attempt 0 but reports it discarded, so the retry trains the samples twice (spec §17 R1).
    double_apply_retry = "double_apply_retry"
    # A rank whose cross-cell reduce failed steps on its local gradient anyway.
    leak_discarded_attempt = "leak_discarded_attempt"


@dataclass
class MegatronConfig:
    """Settings of the megatron engine (its model comes from the mode's ``model_preset``)."""

    micro_batch_size: int = 32            # samples per microbatch of Megatron's schedule
    # Collectives inside one cell (TP/CP/PP/EP). Generous: a cell whose rank died is killed by
    # the driver as soon as Ray reports the death, so this only bounds start-up and true hangs.
    cell_timeout_s: float = 300.0


@dataclass
class TrainerConfig:
    engine: Optional[Engine] = None       # None: the mode's first engine
    model: ModelConfig = field(default_factory=ModelConfig)  # the torch engine's model (and the rollout policy)
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    lr: float = 1e-3
    betas: list[float] = field(default_factory=lambda: [0.9, 0.98])
    weight_decay: float = 0.0
    adam_eps: float = 1e-8
    eps_clip: float = 0.2
    # Cross-cell gloo timeout. Short on CPU: a survivor may wait this long for a dead peer.
    cross_cell_timeout_s: float = 10.0
    max_attempts: int = 30                # group-level retries of one rollout
    retry_backoff_s: float = 0.5          # doubles per attempt, capped at retry_backoff_max_s
    retry_backoff_max_s: float = 60.0
    threads_per_rank: int = 1             # also keeps CPU kernels bitwise reproducible
    negative_control: Optional[NegativeControl] = None
    # Witness ids prove every sample was trained exactly once (spec §11); two Embedding(B, 1) in the model.
    # None: on where the engine has witnesses (torch), off where it has none yet (megatron).
    enable_witness: Optional[bool] = None
    witness_buffer_size: int = 1048576    # ids live in a ring of this size; >= samples per rollout

    @property
    def witness_on(self) -> bool:
        if self.enable_witness is not None:
            return self.enable_witness
        return self.engine != Engine.megatron


class LauncherKind(enum.Enum):
    local = "local"  # submitit LocalExecutor: jobs are processes on this machine
    slurm = "slurm"  # submitit SlurmExecutor: jobs are sbatch jobs


@dataclass
class LauncherConfig:
    name: LauncherKind = LauncherKind.local
    timeout_min: int = 30
    poll_interval_s: float = 0.5
    wait: bool = True                     # false: submit the whole run as one job and return at once
    # Slurm only (sbatch options); additional_parameters holds any other sbatch option.
    partition: Optional[str] = None
    account: Optional[str] = None
    nodes: int = 1
    cpus_per_task: Optional[int] = None
    gpus_per_node: Optional[int] = None
    additional_parameters: dict[str, Any] = field(default_factory=dict)


class TrackerKind(enum.Enum):
    none = "none"    # report.md + curves.png only
    wandb = "wandb"  # also baseline and target as two wandb runs in one group


@dataclass
class TrackingConfig:
    name: TrackerKind = TrackerKind.none
    project: str = "ftexp"
    entity: Optional[str] = None


@dataclass
class ExperimentConfig:
    defaults: list[Any] = field(default_factory=lambda: [
        {"mode": "dp2"},
        {"scenario": "no_failure"},
        {"trainer": "builtin"},
        {"launcher": "local"},
        {"tracking": "none"},
        "_self_",
    ])
    mode: ModeConfig = MISSING
    scenario: ScenarioConfig = MISSING
    threshold: ThresholdConfig = MISSING
    trainer: TrainerConfig = MISSING
    launcher: LauncherConfig = MISSING
    tracking: TrackingConfig = MISSING
    stage: Stage = Stage.run
    phase: Optional[str] = None           # with stage=baseline|target: run only this phase
    run_dir: Optional[str] = None         # with stage=compare (or a side): reuse this run dir
    seed: int = 1


def register_configs() -> None:
    cs = ConfigStore.instance()
    cs.store(name="ftexp_schema", node=ExperimentConfig)
    for group, node in [("mode", ModeConfig), ("scenario", ScenarioConfig), ("threshold", ThresholdConfig),
                        ("trainer", TrainerConfig), ("launcher", LauncherConfig), ("tracking", TrackingConfig)]:
        cs.store(group=group, name=f"{group}_schema", node=node)


def validate_timeouts(cfg: ExperimentConfig) -> None:
    """Cross-cell PG timeout < heartbeat detection < step deadline, or faults are misdiagnosed.

    A peer blocked on a dead cell must fail its collective (and discard) before heartbeats could
    declare it dead too; and a real hang must be detected by heartbeats well before the step
    deadline gives up on the whole run.
    """
    control, soak, pg = cfg.scenario.control, cfg.scenario.soak, cfg.trainer.cross_cell_timeout_s
    if not control.enabled:
        return
    if not pg < control.detection_s:
        raise InputError(f"timeouts: trainer.cross_cell_timeout_s={pg:g} must be < heartbeat detection "
                         f"(failure_threshold x (interval + timeout) = {control.detection_s:g} s)")
    if soak.enabled and not control.detection_s + control.heartbeat_first_wait_s < soak.step_deadline_s:
        raise InputError(f"timeouts: heartbeat first wait + detection ({control.heartbeat_first_wait_s + control.detection_s:g} s)"
                         f" must be < scenario.soak.step_deadline_s={soak.step_deadline_s:g}")


def resolve_defaults(cfg: ExperimentConfig) -> None:
    """Fill the settings whose default depends on another group: the engine follows the mode."""
    if cfg.trainer.engine is None:
        cfg.trainer.engine = cfg.mode.engines[0]


def validate_megatron_layout(mode: ModeConfig) -> None:
    """What megatron-core would assert on deep inside every rank, said once up front."""
    from ftexp.engines.megatron.presets import PRESETS

    preset = PRESETS.get(mode.model_preset)
    if preset is None:
        raise InputError(f"mode {mode.name}: unknown model_preset {mode.model_preset!r} (presets: {', '.join(PRESETS)})")
    if preset.num_attention_heads % mode.tp or preset.num_query_groups % mode.tp:
        raise InputError(f"mode {mode.name}: tp={mode.tp} must divide the preset's {preset.num_attention_heads} heads "
                         f"and {preset.num_query_groups} query groups")
    if mode.ep > 1 and (not preset.num_experts or preset.num_experts % mode.ep):
        raise InputError(f"mode {mode.name}: ep={mode.ep} must divide the preset's experts ({preset.num_experts or 0})")
    if mode.ep > 1 and mode.ranks_per_cell % (mode.ep * mode.etp * mode.pp):
        raise InputError(f"mode {mode.name}: ep·etp·pp = {mode.ep * mode.etp * mode.pp} must divide the "
                         f"{mode.ranks_per_cell} ranks of a cell")
    if preset.num_experts and mode.tp > 1 and not mode.sequence_parallel:
        raise InputError(f"mode {mode.name}: megatron-core needs sequence_parallel=true for MoE with tp > 1")
    if mode.pp > preset.num_layers:
        raise InputError(f"mode {mode.name}: pp={mode.pp} exceeds the preset's {preset.num_layers} layers")


def validate(cfg: ExperimentConfig) -> None:
    """Cross-group checks that a schema cannot express. Raises InputError (exit 2) before launch."""
    from ftexp.verify.predicate import parse_predicate

    resolve_defaults(cfg)
    mode, scenario = cfg.mode, cfg.scenario
    if cfg.trainer.engine not in mode.engines:
        raise InputError(
            f"mode {mode.name} needs {mode.tp=} {mode.pp=} {mode.cp=} {mode.ep=} ({mode.ranks_per_cell} ranks per cell);"
            f" engine={cfg.trainer.engine.value} cannot run it (it runs on: {', '.join(e.value for e in mode.engines)})"
        )
    if cfg.trainer.engine == Engine.megatron:
        validate_megatron_layout(mode)
        if cfg.trainer.enable_witness:  # explicitly on; unset means off for this engine
            raise InputError("the megatron engine has no witness parameters yet: set trainer.enable_witness=false")
        if cfg.trainer.megatron.micro_batch_size < 1:
            raise InputError("trainer.megatron.micro_batch_size must be >= 1")
    if mode.num_cells < 1:
        raise InputError(f"mode {mode.name}: num_cells must be >= 1")
    samples = cfg.trainer.rollout.rollout_batch_size * cfg.trainer.rollout.n_samples_per_prompt
    if samples % mode.num_cells:
        raise InputError(f"{samples} samples per rollout do not divide over {mode.num_cells} cells")
    if cfg.trainer.witness_on and cfg.trainer.witness_buffer_size < samples:
        raise InputError(f"trainer.witness_buffer_size={cfg.trainer.witness_buffer_size} is smaller than the "
                         f"{samples} samples of a rollout: raise it (or set trainer.enable_witness=false)")
    if not scenario.phases:
        raise InputError(f"scenario {scenario.name} has no phases")
    names = [p.name for p in scenario.phases]
    if len(set(names)) != len(names):
        raise InputError(f"scenario {scenario.name}: duplicate phase names {names}")
    for i, phase in enumerate(scenario.phases):
        if phase.load_from is not None and phase.load_from not in names[:i]:
            raise InputError(f"phase {phase.name!r} loads from {phase.load_from!r}, which is not an earlier phase")
    if cfg.phase is not None and cfg.phase not in names:
        raise InputError(f"unknown phase {cfg.phase!r} for scenario {scenario.name} (phases: {names})")
    if not cfg.threshold.dumps:
        raise InputError(f"threshold {cfg.threshold.name}: empty dump rule list (end it with a '.*' catch-all)")
    for rule in [*cfg.threshold.dumps, *cfg.threshold.fp32_dumps]:
        if len(rule) != 2:
            raise InputError(f"threshold.dumps entries are [regex, predicate] pairs, got {list(rule)}")
        try:
            re.compile(rule[0])
        except re.error as e:
            raise InputError(f"threshold.dumps: bad regex {rule[0]!r}: {e}") from None
        parse_predicate(rule[1])
    for pattern in (cfg.threshold.exclude_pattern, cfg.threshold.allow_skipped_pattern, cfg.threshold.allow_failed_pattern):
        if pattern is not None:
            try:
                re.compile(pattern)
            except re.error as e:
                raise InputError(f"threshold: bad regex {pattern!r}: {e}") from None
    validate_timeouts(cfg)
    if cfg.stage in (Stage.compare, Stage.collect) and not cfg.run_dir:
        raise InputError(f"stage={cfg.stage.value} needs run_dir=<an existing run directory>")
