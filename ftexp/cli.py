"""``python -m ftexp``: the Hydra entry point.

Exit codes: 0 = the scenario's assertions held, 1 = an assertion failed (report.md says which),
2 = bad configuration or input (one line on stderr; the run dir's verdict says ERROR), 130 = stopped
by SIGINT or SIGTERM (one line saying what was stopped and cleaned up; the verdict says INTERRUPTED).
A ``-m`` sweep exits 1 when any of its points failed (sweep_summary.md says which).

Hydra reports composition errors (typo'd key, unknown mode) as multi-line text with exit code 1,
so the overrides are composed once up front with Hydra's compose API: any error there becomes one
line and exit code 2, and only a valid config reaches ``hydra.main``.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import sys
from pathlib import Path

import hydra
import torch
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict

from ftexp import pipeline
from ftexp.config import (ExperimentConfig, LauncherConfig, ModeConfig, ScenarioConfig, Stage, TaskConfig,
                          ThresholdConfig, TrackingConfig, TrainerConfig)
from ftexp.errors import InputError, Interrupted, interrupt_signal, one_line
from ftexp.tracking.sweep import sweep_exit_code
from ftexp.validate import validate

log = logging.getLogger("ftexp")
EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_INTERRUPTED = 0, 1, 2, 130
_validated: ExperimentConfig | None = None  # the single run's config, validated by _precompose
# The Hydra config root: conf/ at the repo root, installed as the package ftexp.conf
# (pyproject.toml maps it). Named as a module, not a path relative to this file, so the same
# name resolves in the wheel and in the editable install (setuptools' editable finder maps it).
CONFIG_MODULE = "ftexp.conf"


def register_configs() -> None:
    """Register the schema (``ftexp.config``) with Hydra, under the names ``conf/`` composes onto."""
    cs = ConfigStore.instance()
    cs.store(name="ftexp_schema", node=ExperimentConfig)
    for group, node in [("mode", ModeConfig), ("scenario", ScenarioConfig), ("threshold", ThresholdConfig),
                        ("trainer", TrainerConfig), ("launcher", LauncherConfig), ("tracking", TrackingConfig),
                        ("task", TaskConfig)]:
        cs.store(group=group, name=f"{group}_schema", node=node)


def _fail_bad_input(message: str) -> None:
    print(f"ftexp: error: {message}", file=sys.stderr)
    sys.exit(EXIT_BAD_INPUT)


def _exit_interrupted(exc: KeyboardInterrupt) -> None:
    message = str(exc) if isinstance(exc, Interrupted) else f"interrupted by {interrupt_signal(exc)}"
    print(f"ftexp: {message}", file=sys.stderr)
    sys.exit(EXIT_INTERRUPTED)


def _on_sigterm(signum, frame) -> None:
    """SIGTERM stops a run the way Ctrl-C does: the job is cancelled and the run dir says INTERRUPTED."""
    raise KeyboardInterrupt("SIGTERM")


def _check_writable(path: Path, what: str) -> None:
    """Refuse, with one line, a directory that cannot be created or written before Hydra tries to."""
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise InputError(f"{what} {path} cannot be created: {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise InputError(f"{what} {path} is not writable: permission denied on {existing}")


def _one_line(exc: BaseException) -> str:
    """Hydra/OmegaConf errors span several lines; keep what a user needs on one."""
    text = str(exc)
    missing = re.search(r"Could not find '(\w+)/([^']+)'", text)
    if missing:
        group, name = missing.groups()
        options = re.findall(r"^\t(\S+)$", text, flags=re.M)
        return f"unknown {group} '{name}'" + (f" (available: {', '.join(options)})" if options else "")
    def useful_lines(e: BaseException) -> list[str]:
        skip = ("full_key", "object_type", "reference_type")
        return [ln.strip() for ln in str(e).splitlines() if ln.strip() and not ln.strip().startswith(skip)]

    lines = useful_lines(exc)
    root = exc
    while root.__cause__ is not None:  # Hydra wraps the OmegaConf error that says what is wrong
        root = root.__cause__
    if root is not exc and useful_lines(root):
        lines = lines[:1] + useful_lines(root)[:1]
    return " — ".join(lines[:2]) or type(exc).__name__


def _precompose(overrides: list[str]) -> ExperimentConfig:
    """Compose the config once and validate it; exit 2 with one line on any error."""
    from hydra import compose, initialize_config_module

    try:
        with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
            cfg = compose(config_name="config", overrides=overrides, return_hydra_config=True)
        with open_dict(cfg):
            hydra_cfg = cfg.pop("hydra")
        exp = to_config(cfg)
        try:
            output_dir = Path(str(hydra_cfg.run.dir))
        except Exception:  # an interpolation only Hydra's own run can resolve: Hydra reports it
            output_dir = None
        if output_dir is not None:
            _check_writable(output_dir, "Hydra's output dir (hydra.run.dir)")
        return exp
    except InputError as e:
        _fail_bad_input(str(e))
    except Exception as e:  # Hydra/OmegaConf raise a zoo of types for bad overrides
        _fail_bad_input(_one_line(e))


def to_config(cfg: DictConfig) -> ExperimentConfig:
    """DictConfig → validated dataclass tree. Unknown top-level keys (``+key=value``) are refused."""
    known = set(ExperimentConfig.__dataclass_fields__) - {"defaults"} | {"hydra"}
    unknown = sorted(set(cfg.keys()) - known)
    if unknown:
        raise InputError(f"unknown config key(s): {', '.join(unknown)}")
    exp: ExperimentConfig = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    validate(exp)
    return exp


@hydra.main(config_path=f"pkg://{CONFIG_MODULE}", config_name="config", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> int | None:
    # A sweep point runs inside a launcher job: it returns its exit code (result.json records the
    # verdict for the sweep summary) instead of exiting the job's process.
    multirun = HydraConfig.get().mode == RunMode.MULTIRUN
    try:
        # A single run was composed and validated before Hydra started (``main``); sweep points
        # are composed by Hydra alone, so each is validated here.
        exp = _validated if _validated is not None else to_config(cfg)
        if exp.run_dir:
            run_dir = Path(exp.run_dir)
            if exp.stage in (Stage.compare, Stage.collect) and not run_dir.is_dir():
                raise InputError(f"run_dir {run_dir} does not exist")
        else:
            run_dir = Path(HydraConfig.get().runtime.output_dir)
        code = pipeline.run_stage(exp, run_dir)
    except InputError as e:
        if multirun:
            raise
        _fail_bad_input(str(e))
    except OSError as e:  # the pipeline names run-dir files itself; anything else is still one line
        if multirun:
            raise
        _fail_bad_input(f"{e.filename}: {e.strerror}" if e.filename else one_line(e))
    except KeyboardInterrupt as e:
        if multirun:
            raise
        _exit_interrupted(e)
    if multirun:
        return code
    sys.exit(code)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(name)s: %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # the soak injector polls the control API
    signal.signal(signal.SIGTERM, _on_sigterm)
    # The driver's own tensor work (recording rollouts, comparing dumps) is small. A second intra-op
    # thread would only spin against the training processes for the same cores: on a busy 2-core
    # machine that made recording 2 rollouts take 40 s instead of 1.
    torch.set_num_threads(1)
    try:
        register_configs()
        args = sys.argv[1:]
        hydra_flags = [a for a in args if a.startswith("-")]
        global _validated
        if not hydra_flags:  # plain overrides: check them before Hydra sets anything up
            _validated = _precompose([a for a in args if not a.startswith("hydra") or a.startswith("hydra.run.dir=")])
        _hydra_main()
    except KeyboardInterrupt as e:  # before or after a run (a run reports its own), or a sweep
        _exit_interrupted(e)
    if sweep_exit_code():
        sys.exit(EXIT_FAILED)


if __name__ == "__main__":
    main()
