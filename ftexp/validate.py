"""Cross-group checks that a schema cannot express, run once on the composed config before launch.

``validate`` also resolves the settings whose default depends on another group (the engine
follows the mode, the witness follows the engine). Every failure is an ``InputError``: one line,
exit 2, nothing launched.
"""

from __future__ import annotations

import os
from pathlib import Path

from ftexp.config import ExperimentConfig, Stage, TaskName
from ftexp.engines.megatron import model_preset
from ftexp.engines.registry import MODEL_FEATURES, get_engine
from ftexp.errors import InputError
from ftexp.rollout.tokenizer import VOCAB_SIZE as TOKENIZER_VOCAB_SIZE
from ftexp.rundir import TARGET
from ftexp.scenarios import Scenario, load_scenario
from ftexp.tasks import build_task
from ftexp.tasks.base import longest_prompt, policy_tokenizer
from ftexp.verify.dumps import compile_pattern, parse_rules


def resolve_defaults(cfg: ExperimentConfig) -> None:
    """The engine follows the mode (its first engine); the witness follows the engine and the audit switch;
    a relative ``mode.hf_checkpoint`` is the user's working directory's, for every process of the run."""
    if cfg.mode.hf_checkpoint:
        cfg.mode.hf_checkpoint = str(Path(cfg.mode.hf_checkpoint).resolve())
    if cfg.trainer.engine is None:
        cfg.trainer.engine = cfg.mode.engines[0]
    if cfg.trainer.enable_witness is None:
        cfg.trainer.enable_witness = cfg.trainer.audit and get_engine(cfg.trainer.engine).witness_by_default
    if cfg.trainer.enable_witness and not cfg.trainer.audit:
        raise InputError("trainer.enable_witness=true needs trainer.audit=true (the witness is part of the audit)")


def validate_timeouts(cfg: ExperimentConfig, soak: bool) -> None:
    """Cross-cell PG timeout < heartbeat detection < step deadline, or faults are misdiagnosed.

    A peer blocked on a dead cell must fail its collective (and discard) before heartbeats could
    declare it dead too; and a real hang must be detected by heartbeats well before the step
    deadline gives up on the whole run.
    """
    control, deadline, pg = cfg.scenario.control, cfg.scenario.soak.step_deadline_s, cfg.trainer.cross_cell_timeout_s
    if not control.enabled:
        return
    if not pg < control.detection_s:
        raise InputError(f"timeouts: trainer.cross_cell_timeout_s={pg:g} must be < heartbeat detection "
                         f"(failure_threshold x (interval + timeout) = {control.detection_s:g} s)")
    if soak and not control.detection_s + control.heartbeat_first_wait_s < deadline:
        raise InputError(f"timeouts: heartbeat first wait + detection ({control.heartbeat_first_wait_s + control.detection_s:g} s)"
                         f" must be < scenario.soak.step_deadline_s={deadline:g}")


def validate_phases(cfg: ExperimentConfig) -> None:
    scenario = cfg.scenario
    if not scenario.phases:
        raise InputError(f"scenario {scenario.name} has no phases")
    names = [p.name for p in scenario.phases]
    if len(set(names)) != len(names):
        raise InputError(f"scenario {scenario.name}: duplicate phase names {names}")
    for i, phase in enumerate(scenario.phases):
        if phase.load_from is not None and phase.load_from not in names[:i]:
            raise InputError(f"phase {phase.name!r} loads from {phase.load_from!r}, which is not an earlier phase")
        for action in phase.target_actions:
            if not -cfg.mode.num_cells <= action.cell_index < cfg.mode.num_cells:
                raise InputError(f"phase {phase.name!r}: test action {action.action.value} at rollout {action.at_rollout} "
                                 f"names cell {action.cell_index}, but mode {cfg.mode.name} has {cfg.mode.num_cells} cells")
    if cfg.phase is not None and cfg.phase not in names:
        raise InputError(f"unknown phase {cfg.phase!r} for scenario {scenario.name} (phases: {names})")


def validate_thresholds(cfg: ExperimentConfig) -> None:
    """Parse every rule with the verifier's own parser, so a bad rule fails here with its message; a
    rule's model feature must be one the scenarios know (a typo there would make the rule optional)."""
    th = cfg.threshold
    if not th.dumps:
        raise InputError(f"threshold {th.name}: empty dump rule list (end it with a '.*' catch-all)")
    for what, rules in (("dumps", th.dumps), ("fp32_dumps", th.fp32_dumps)):
        for rule in parse_rules([tuple(r) for r in rules]):
            if rule.feature is not None and rule.feature not in MODEL_FEATURES:
                raise InputError(f"threshold.{what}: rule {rule.regex!r} is for unknown model feature {rule.feature!r} "
                                 f"(known: {', '.join(MODEL_FEATURES)})")
    for what, pattern in (("exclude_pattern", th.exclude_pattern), ("allow_skipped_pattern", th.allow_skipped_pattern),
                          ("allow_failed_pattern", th.allow_failed_pattern)):
        if pattern is not None:
            compile_pattern(pattern, f"threshold.{what}")


def validate_live_rollout(cfg: ExperimentConfig) -> None:
    """Live engines run the policy in HF layout with the ASCII tokenizer (or an HF checkpoint's own, which
    fits its model); generation must fit the model."""
    rollout, engine = cfg.trainer.rollout, get_engine(cfg.trainer.engine)
    vocab = engine.vocab_size(cfg.mode)
    if not cfg.mode.hf_checkpoint and vocab != TOKENIZER_VOCAB_SIZE:
        raise InputError(f"mode {cfg.mode.name}: live rollout engines tokenize ASCII ({TOKENIZER_VOCAB_SIZE} tokens); "
                         f"the model's vocabulary has {vocab}")
    if rollout.engine_temperature <= 0 or not 0 < rollout.engine_top_p <= 1:
        raise InputError(f"trainer.rollout: engine_temperature must be > 0 and engine_top_p in (0, 1], got "
                         f"{rollout.engine_temperature} and {rollout.engine_top_p}")
    ratio = cfg.mode.rollout_inject_min_match_ratio
    if ratio is not None and not 0 <= ratio < 1:
        raise InputError(f"mode {cfg.mode.name}: rollout_inject_min_match_ratio must be in [0, 1), got {ratio}")


def validate_task(cfg: ExperimentConfig, scenario: Scenario) -> None:
    """A task trains on live rollouts, in a run without a baseline; its problems must fit the model.

    Building the task reads a gsm8k file here, so a missing or malformed one is bad input before launch.
    """
    task = cfg.task
    if not task.enabled:
        return
    if scenario.sides != (TARGET,):
        raise InputError(f"task={task.name.value}: scenario {cfg.scenario.name} compares a baseline with the target on the "
                         f"deterministic_random reward; a task needs an accuracy scenario (e.g. scenario=realistic)")
    if not cfg.mode.rollout_num_engines:
        raise InputError(f"task={task.name.value} trains on live rollouts: mode {cfg.mode.name} has no rollout engines")
    if task.data_path == "???" or (task.name.value == "gsm8k" and not task.data_path):
        raise InputError("task=gsm8k needs task.data_path=<a GSM8K .jsonl or .parquet file>")
    built = build_task(task)
    if task.name == TaskName.gsm8k and not cfg.mode.hf_checkpoint:  # the seed's recipe: a real model, never a preset
        raise InputError("task=gsm8k trains a policy loaded from an HF checkpoint: set mode.hf_checkpoint=<a local "
                         "Qwen3 / Qwen3-MoE directory: config.json, model.safetensors, tokenizer.json>")
    preset, tokenizer = model_preset(cfg.mode), policy_tokenizer(cfg.mode)
    prompt = max(longest_prompt(built.eval_problems(), tokenizer),
                 longest_prompt(built.train_problems(0, 64, cfg.seed), tokenizer))
    warmup = max((len(tokenizer.encode(p.prompt)) + len(tokenizer.encode(p.solution)) + 1
                  for p in built.warmup_problems(0, 64, cfg.seed)), default=0)
    if max(prompt + task.max_response_tokens, warmup if task.warmup.steps else 0) > preset.seq_length:
        raise InputError(f"task={task.name.value}: prompts of up to {prompt} tokens + task.max_response_tokens="
                         f"{task.max_response_tokens} (warm-up examples up to {warmup}) exceed the {preset.seq_length}-token "
                         f"context of mode {cfg.mode.name}'s model ({cfg.mode.hf_checkpoint or cfg.mode.model_preset})")
    cache = task.warmup.cache_dir
    if cache is not None and task.warmup.steps:
        _check_writable_dir(Path(cache), "task.warmup.cache_dir")


def _check_writable_dir(path: Path, setting: str) -> None:
    """``path`` is a directory this process can write, or one it can create."""
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        raise InputError(f"{setting}={path}: {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise InputError(f"{setting}={path}: {existing} is not writable")


def validate(cfg: ExperimentConfig) -> None:
    """Resolve the dependent defaults, then check everything that spans groups. Raises InputError."""
    resolve_defaults(cfg)
    mode = cfg.mode
    if cfg.trainer.engine not in mode.engines:
        raise InputError(
            f"mode {mode.name} needs {mode.tp=} {mode.pp=} {mode.cp=} {mode.ep=} ({mode.ranks_per_cell} ranks per cell);"
            f" engine={cfg.trainer.engine.value} cannot run it (it runs on: {', '.join(e.value for e in mode.engines)})"
        )
    get_engine(cfg.trainer.engine).validate(mode, cfg.trainer)
    if mode.hf_checkpoint:
        policy_tokenizer(mode)  # its tokenizer.json must load, task or not: the engines and the router use it
    if mode.num_cells < 1:
        raise InputError(f"mode {mode.name}: num_cells must be >= 1")
    samples = cfg.trainer.rollout.samples
    if samples % mode.num_cells:
        raise InputError(f"{samples} samples per rollout do not divide over {mode.num_cells} cells")
    if cfg.trainer.rollouts_per_call < 1:
        raise InputError(f"trainer.rollouts_per_call={cfg.trainer.rollouts_per_call}: a train call trains at least "
                         f"one rollout (>= 1)")
    if cfg.trainer.spare_cells < 0:
        raise InputError(f"trainer.spare_cells={cfg.trainer.spare_cells}: the number of warm spare cells must be >= 0")
    if cfg.trainer.spare_cells and cfg.launcher.nodes > 1:
        raise InputError(f"trainer.spare_cells={cfg.trainer.spare_cells} needs a one-node job (launcher.nodes=1): "
                         f"on several nodes every cell is pinned to its node, and spares are not placed "
                         f"(set trainer.spare_cells=0)")
    if cfg.trainer.witness_on and cfg.trainer.witness_buffer_size < samples:
        raise InputError(f"trainer.witness_buffer_size={cfg.trainer.witness_buffer_size} is smaller than the "
                         f"{samples} samples of a rollout: raise it (or set trainer.enable_witness=false)")
    if mode.rollout_num_engines:
        validate_live_rollout(cfg)
    validate_phases(cfg)
    scenario = load_scenario(cfg.scenario)
    validate_task(cfg, scenario)
    scenario.check_plan(cfg)
    validate_thresholds(cfg)
    validate_timeouts(cfg, soak=scenario.is_soak)
    if cfg.stage in (Stage.compare, Stage.collect) and not cfg.run_dir:
        raise InputError(f"stage={cfg.stage.value} needs run_dir=<an existing run directory>")
