"""realistic: GRPO on a task under random faults — fault recovery must not cost accuracy.

A soak (only the target trains) whose rollouts are generated live from the current policy on a
task with a verifiable reward (``task=...``), while the ``ft_random`` injector kills random cells
through the control server. It passes when:

* some eval of the task reached ``scenario.metric_threshold`` (calibrated from runs without faults:
  a recovery that loses or corrupts what was learned keeps the accuracy below it), and the start
  (the eval before rollout 0) did not: a threshold the warm-up already reaches proves nothing;
* every rollout committed, and every engine update left all engines with the trainer's weights;
* with ``soak.crash_probability > 0``, the soak's witnesses held (enough injections and heals) and,
  with the audit on, every analyzer rule (cells bitwise equal after every heal, witness ids);
  with ``crash_probability = 0`` no fault is injected and the witnesses are not required.

The report has the accuracy curve: where it started (after the warm-up), its best and its last eval.
"""

from __future__ import annotations

from pathlib import Path

from ftexp.config import ExperimentConfig
from ftexp.errors import InputError
from ftexp.rundir import TARGET, side_dir
from ftexp.scenarios import ft_random
from ftexp.scenarios.base import Kind
from ftexp.tasks.accuracy import side_accuracy
from ftexp.verify.engines import check_engine_updates
from ftexp.verify.report import CheckResult

KIND = Kind.soak
SOAK_WITNESSES = ("injections", "heals")


def check_plan(cfg: ExperimentConfig) -> None:
    ft_random.check_plan(cfg)
    name = cfg.scenario.name
    if not cfg.task.enabled:
        raise InputError(f"scenario {name} measures learning: it needs a task (e.g. task=arith)")
    if not cfg.mode.rollout_num_engines:
        raise InputError(f"scenario {name} trains on live rollouts: mode {cfg.mode.name} has no rollout engines "
                         f"(e.g. mode=dp2_cp2_real_rollout_dense)")
    threshold = cfg.scenario.metric_threshold
    if threshold is None:
        raise InputError(f"scenario {name}: set scenario.metric_threshold, the accuracy to reach (calibrate it: the "
                         f"best eval of runs with scenario.soak.crash_probability=0)")
    if not 0 < threshold <= 1:
        raise InputError(f"scenario {name}: scenario.metric_threshold must be an accuracy in (0, 1], got {threshold}")


def check_accuracy(target_root: Path, threshold: float) -> CheckResult:
    """Some eval after the start reached ``threshold`` (as the reference's checker: any, not the last).

    A threshold the start (the warm-up's eval, before any fault) already reaches fails: a run whose
    recovery froze or undid the learning would pass it too, so it proves nothing.
    """
    accuracy = side_accuracy(target_root)
    if accuracy is None:
        return CheckResult("accuracy", False, "no eval accuracy was recorded (eval/<task> metric)", {})
    step, best = accuracy.best
    details = {**accuracy.to_dict(), "threshold": threshold}
    passed = accuracy.start < threshold <= best
    if accuracy.start >= threshold:
        verdict = "already reached at the start: it cannot tell learning from none (calibrate it above the start)"
    else:
        verdict = "reached" if passed else "never reached"
    return CheckResult("accuracy", passed,
                       f"{accuracy.key}: start {accuracy.start:.3f} (before rollout {accuracy.curve[0][0]}), best "
                       f"{best:.3f} (before rollout {step}), final {accuracy.final:.3f}; threshold {threshold:g} — "
                       + verdict, details)


def verify(cfg: ExperimentConfig, run_dir: Path) -> list[CheckResult]:
    target = side_dir(run_dir, TARGET, "")
    soak_checks = ft_random.verify(cfg, run_dir)
    if cfg.scenario.soak.crash_probability == 0:
        soak_checks = [c if c.name not in SOAK_WITNESSES else
                       CheckResult(c.name, True, f"not required: scenario.soak.crash_probability=0 ({c.summary})",
                                   c.details) for c in soak_checks]
    rollouts = list(range(cfg.scenario.num_rollout))
    return [check_accuracy(target.root, cfg.scenario.metric_threshold), *soak_checks,
            check_engine_updates(target.events, rollouts, cfg.mode.rollout_num_engines, "target_engine_updates")]
