"""Structured configs: the schema behind every Hydra config group.

Hydra composes ``conf/config.yaml`` + the chosen ``mode/``, ``scenario/``, ``threshold/``,
``trainer/``, ``launcher/``, ``tracking/`` and ``task/`` files onto these dataclasses, so a typo'd key or a
value of the wrong type fails at compose time. This module is schema only: checks that span
groups (can this engine run this mode? do the predicates parse?) live in ``ftexp.validate``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Optional

from ftexp.errors import InputError
from ftexp.faults.plan import NegativeControl, TestAction
from ftexp.missing import MISSING


class Stage(enum.Enum):
    run = "run"            # prepare → baseline/target per phase → compare
    prepare = "prepare"    # record the rollout data only
    baseline = "baseline"  # one side only (debugging); honours `phase=`
    target = "target"
    compare = "compare"    # re-verify an existing run_dir, no training
    collect = "collect"    # wait for a run submitted with launcher.wait=false, then report its verdict


@dataclass
class ModelConfig:
    """The torch engine's TinyGPT, which is also the policy that records the rollouts."""

    vocab_size: int = 64
    d_model: int = 32
    n_layers: int = 2
    n_heads: int = 2
    max_seq_len: int = 48
    seed: int = 0                 # the initial weights; conf/config.yaml makes it the experiment's `seed`

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise InputError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")


class RolloutBackend(enum.Enum):
    """What serves generation in a mode with live rollout engines (``mode.rollout_num_engines > 0``)."""

    cpu = "cpu"        # our own sglang-protocol server per engine, a Ray actor (tests, laptops)
    sglang = "sglang"  # real sglang servers on GPUs


@dataclass
class RolloutConfig:
    rollout_batch_size: int = 32  # prompts per rollout
    n_samples_per_prompt: int = 8
    prompt_len: int = 8
    response_len: int = 16
    temperature: float = 1.0      # the recorded rollouts' sampling temperature
    seed: int = 1234              # prompts and sampling seeds; conf/config.yaml makes it the experiment's `seed`
    # Live engines: GRPO groups sampled from the current policy through the sglang router.
    backend: RolloutBackend = RolloutBackend.cpu
    engine_temperature: float = 0.8
    engine_top_p: float = 1.0
    engine_start_timeout_s: float = 300.0  # 4 engines + the trainer starting on 2 loaded cores

    @property
    def samples(self) -> int:
        """Samples per rollout: each prompt's group of answers."""
        return self.rollout_batch_size * self.n_samples_per_prompt


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
    nodes: int = 1                    # train nodes; a multi-node job adds rollout nodes for live engines
    train_gpus_per_node: int = 0      # 0: a CPU mode
    # Ranks a node holds on CPU (multi-node placement); 0: the ranks spread evenly over the job's nodes.
    train_cpus_per_node: int = 0
    rollout_num_engines: int = 0      # > 0: real rollout engines instead of recorded data
    rollout_gpus_per_engine: int = 0
    # Set: after the scripted heal the target trains on the baseline's recorded rollouts (still
    # generating live), if its own generation matches them by more than this mean token ratio.
    rollout_inject_min_match_ratio: Optional[float] = None
    colocate: bool = False
    ft_components: list[str] = field(default_factory=lambda: ["train"])
    model_preset: str = "tiny_dense"  # CPU-scale stand-in for reference_model
    # The policy as a local HF checkpoint directory (Qwen3 / Qwen3-MoE: config.json, safetensors weights,
    # tokenizer.json; read, never downloaded). Set, it replaces model_preset: the megatron engine builds
    # the model from its config.json and loads its weights, the live rollout engines serve it and tasks
    # tokenize with its tokenizer (ftexp.engines.megatron.hf_import).
    hf_checkpoint: Optional[str] = None
    reference_model: str = ""         # the model the seed runs on GPUs
    engines: list[Engine] = field(default_factory=lambda: [Engine.torch])  # able to run it; the first is the default

    @property
    def ranks_per_cell(self) -> int:
        return self.tp * self.pp * self.cp


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
    """The control plane of the target driver: HTTP API, heartbeats, mini controller."""

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
    """Random fault injection against the control server, for non-comparison scenarios."""

    crash_probability: float = 0.5
    # Mean seconds between injections = time_unit_s / crash_probability (the reference uses 60 s).
    time_unit_s: float = 60.0
    modes: list[str] = field(default_factory=lambda: ["sigkill", "exit", "segfault"])
    first_mode: Optional[str] = None      # force the first injection's mode (e.g. deadlock)
    first_after_s: Optional[float] = None  # force the first injection's time (s after the control server is up)
    poll_interval_s: float = 2.0
    min_injections: int = 2
    min_heals: int = 2
    simulated_rollout_s: float = 0.0      # stands in for generation time, so faults land mid-run
    step_deadline_s: float = 600.0        # no commit for this long = a hang: fail with a diagnosis


@dataclass
class ScenarioConfig:
    name: str = MISSING
    # The module of ftexp.scenarios that says what kind of run this is (comparison or soak) and
    # what it must prove; several yaml files may share one module with different plans.
    module: str = MISSING
    num_rollout: int = MISSING            # exclusive end rollout id
    num_steps: Optional[int] = None       # soak scenarios: rollouts to train (num_rollout follows it)
    deterministic: bool = False           # fixed-order reductions + deterministic kernels
    phases: list[PhaseConfig] = field(default_factory=lambda: [PhaseConfig()])
    control: ControlConfig = field(default_factory=ControlConfig)
    soak: SoakConfig = field(default_factory=SoakConfig)
    # Accuracy scenarios: the run passes only if some eval of the task reaches this accuracy.
    metric_threshold: Optional[float] = None


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


@dataclass
class MegatronConfig:
    """Settings of the megatron engine (its model comes from the mode's ``model_preset`` or ``hf_checkpoint``)."""

    micro_batch_size: int = 32            # samples per microbatch of Megatron's schedule (the nearest divisor of a shard)


class ChecksumKind(enum.Enum):
    """How the per-step weight checksums hash a tensor (equality is all the rules need)."""

    xxh3_128 = "xxh3_128"  # fast, non-cryptographic
    sha256 = "sha256"


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
    # Collectives inside one replica's world (a cell's TP/CP/PP/EP ranks, or the baseline's world).
    # Generous: a cell whose rank died is killed by the driver as soon as Ray reports the death,
    # so this only bounds start-up and true hangs.
    world_timeout_s: float = 300.0
    # Cross-cell gloo timeout. Short on CPU: a survivor may wait this long for a dead peer.
    cross_cell_timeout_s: float = 10.0
    max_attempts: int = 30                # group-level attempts of one train call (one rollout, or a run of them)
    # Consecutive rollouts with nothing to run between them (no engines, save or test action) train in
    # one call per rank, up to this many: Ray's cost of a call and the round trip through the driver are
    # paid once per run instead of once per rollout. The audit's analyzer checks a run's events before
    # the next call. 1: a call per rollout (the analyzer then stops a broken run at the next rollout).
    rollouts_per_call: int = 8
    retry_backoff_s: float = 0.5          # doubles per attempt, capped at retry_backoff_max_s
    retry_backoff_max_s: float = 60.0
    threads_per_rank: int = 1             # also keeps CPU kernels bitwise reproducible
    # The baseline's ranks fork from one server that imported the trainer once, as the target's ranks fork
    # from their node's fork server. true: each starts as a fresh process and imports on its own, as
    # torchrun's ranks do; shared imported pages make forked ranks' small-model steps faster.
    fresh_baseline_ranks: bool = False
    negative_control: Optional[NegativeControl] = None
    # Witness ids prove every sample was trained exactly once; two Embedding(B, 1) in the model.
    # None: on where the engine has witnesses (torch), off where it has none yet (megatron);
    # ftexp.validate resolves it with the engine.
    enable_witness: Optional[bool] = None
    witness_buffer_size: int = 1048576    # ids live in a ring of this size; >= samples per rollout
    # The per-step audit: witness ids, the weight checksums of every rank after every commit, and
    # every non-first cell's own dumps. false is what a production run would use; the report then
    # says those checks were not run.
    audit: bool = True
    checksum: ChecksumKind = ChecksumKind.xxh3_128
    # Warm spares: this many cells' worth of ranks kept started, imported and built (model allocated)
    # ahead of any failure, so a restarted cell heals by configure + transfer + load only; a used
    # spare is replaced in the background. Each costs one replica's processes and memory.
    spare_cells: int = 0

    @property
    def witness_on(self) -> bool:
        return bool(self.enable_witness)


class TaskName(enum.Enum):
    """Where prompts and rewards come from (``ftexp.tasks``); ``none``: random prompts, ``deterministic_random`` reward."""

    none = "none"                  # the comparison scenarios: nothing to learn, only the machinery to compare
    arith = "arith"                # reasoning-gym chain_sum: learnable on a CPU in minutes
    gsm_symbolic = "gsm_symbolic"  # reasoning-gym's GSM8K-style word problems, generated
    gsm8k = "gsm8k"                # GSM8K from a local file (task.data_path)


@dataclass
class WarmupConfig:
    """A supervised warm-up on the task's warm-up split, at the start of a cold run, on every cell alike."""

    steps: int = 0                 # 0: none (GRPO from the initial weights)
    batch_size: int = 64           # problems per step
    lr: float = 1e-3               # the optimizer's learning rate during the warm-up (trainer.lr after it)
    # A directory kept across runs: each warmed-up state is stored there under a hash of everything it
    # depends on, and a run with the same settings loads it instead of warming up. None: no cache.
    cache_dir: Optional[str] = None


@dataclass
class TaskConfig:
    """A task with verifiable rewards for live rollouts, and its eval accuracy ``eval/<name>``."""

    name: TaskName = TaskName.none
    # The problems and their splits. Not the experiment's seed: every experiment of a sweep draws its
    # prompts from the same splits and reports accuracy on the same eval set.
    dataset_seed: int = 0
    eval_size: int = 200           # problems in the eval set
    eval_interval: int = 5         # evaluate before every eval_interval-th rollout, and after the last
    max_response_tokens: int = 8   # the engines stop at the end-of-answer token or here
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    terms: int = 3                 # arith: numbers per problem
    digits: int = 1                # arith: digits per number
    data_path: Optional[str] = None  # gsm8k: the .jsonl / .parquet data file
    eval_path: Optional[str] = None  # gsm8k: the test file (None: a held-out split of data_path)

    def __post_init__(self) -> None:
        if self.name != TaskName.none and (self.eval_size < 1 or self.eval_interval < 1 or self.max_response_tokens < 1):
            raise InputError(f"task {self.name.value}: eval_size, eval_interval and max_response_tokens must be >= 1")
        if self.warmup.steps < 0 or self.warmup.batch_size < 1 or self.warmup.lr <= 0:
            raise InputError(f"task.warmup: steps must be >= 0, batch_size >= 1 and lr > 0, got {self.warmup}")

    @property
    def enabled(self) -> bool:
        return self.name != TaskName.none


class LauncherKind(enum.Enum):
    local = "local"  # submitit LocalExecutor: jobs are processes on this machine
    slurm = "slurm"  # submitit SlurmExecutor: jobs are sbatch jobs


@dataclass
class RayClusterConfig:
    """The Ray cluster of a multi-node (``launcher.nodes > 1``) job: task 0 is the head, the others join."""

    # Every node on 127.0.0.1 (the local multi-node cluster, CI). None: loopback when the Slurm node's
    # NodeAddr is a loopback address, else the node's own address (its NodeAddr, or what Ray finds).
    loopback: Optional[bool] = None
    join_timeout_s: float = 180.0         # every node must have joined the head by then, or one clear error


@dataclass
class LauncherConfig:
    name: LauncherKind = LauncherKind.local
    timeout_min: int = 30
    poll_interval_s: float = 0.5
    wait: bool = True                     # false: submit the whole run as one job and return at once
    # Slurm only (sbatch options); additional_parameters holds any other sbatch option.
    partition: Optional[str] = None
    account: Optional[str] = None
    nodes: int = 1                        # > 1: one Ray cluster across the job's nodes, train + rollout (ftexp.placement)
    ray: RayClusterConfig = field(default_factory=RayClusterConfig)
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
        {"trainer": "builtin"},
        {"launcher": "local"},
        {"tracking": "none"},
        {"task": "none"},
        {"scenario": "no_failure"},
        "_self_",
    ])
    mode: ModeConfig = MISSING
    scenario: ScenarioConfig = MISSING
    threshold: ThresholdConfig = MISSING
    trainer: TrainerConfig = MISSING
    launcher: LauncherConfig = MISSING
    tracking: TrackingConfig = MISSING
    task: TaskConfig = MISSING
    stage: Stage = Stage.run
    phase: Optional[str] = None           # with stage=baseline|target: run only this phase
    run_dir: Optional[str] = None         # with stage=compare (or a side): reuse this run dir
    # Seeds every rank's RNGs and the soak injector, and (conf/config.yaml) the model's initial weights
    # and the recorded rollouts unless trainer.model.seed / trainer.rollout.seed are set.
    seed: int = 1
