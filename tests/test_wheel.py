"""The wheel is complete on its own: every module, and the Hydra config that lives at the repo root
(``conf/``, shipped as the package ``ftexp.conf``).

The wheel is built from a copy of the checkout without build isolation and installed with
``--no-deps`` into a fresh venv in tmp_path; nothing is downloaded. The fresh venv borrows this
venv's dependencies through a ``.pth`` line, written only after the install so that pip never sees
the editable ftexp. A ``.pth`` line only adds the directory to sys.path (the ``.pth`` files inside it,
among them the editable finder, are not processed), so ftexp comes from the wheel. Then, from a cwd
outside the checkout, the config is composed both ways the CLI composes it.
"""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODE = "dp2_cp2_tp2_ep2"

# Uses the same API as ftexp.cli._precompose, and says where the modules and the config files came from.
COMPOSE = f"""
import importlib.resources, json
import ftexp, ftexp.cli
from hydra import compose, initialize_config_module
ftexp.cli.register_configs()
with initialize_config_module(config_module=ftexp.cli.CONFIG_MODULE, version_base="1.3"):
    cfg = compose(config_name="config", overrides=["mode={MODE}", "scenario=no_failure", "stage=prepare"])
exp = ftexp.cli.to_config(cfg)
conf = importlib.resources.files(ftexp.cli.CONFIG_MODULE)
print(json.dumps({{"ftexp": ftexp.__file__, "mode_yaml": str(conf / "mode" / "{MODE}.yaml"),
                  "mode": exp.mode.name, "scenario": exp.scenario.name, "stage": str(exp.stage.value)}}))
"""


def _run(cmd: list, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    result = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"{cmd}\n{result.stdout}\n{result.stderr}"
    return result


def _build_wheel(tmp_path: Path) -> Path:
    # From a copy: setuptools writes build/ and *.egg-info beside pyproject.toml, and a stale build/lib
    # in the checkout could put modules into the wheel that the checkout no longer has.
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", ".venv", "outputs", "multirun", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache"))
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
          "-w", tmp_path / "dist", src], cwd=tmp_path)
    (wheel,) = (tmp_path / "dist").glob("ftexp-*.whl")
    return wheel


def test_wheel_ships_modules_and_config_and_composes_outside_the_checkout(tmp_path):
    wheel = _build_wheel(tmp_path)

    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {f"ftexp/{p.relative_to(ROOT / 'ftexp').as_posix()}" for p in (ROOT / "ftexp").rglob("*.py")}
    expected |= {f"ftexp/conf/{p.relative_to(ROOT / 'conf').as_posix()}"
                 for pattern in ("*.py", "*.yaml") for p in (ROOT / "conf").rglob(pattern)}
    expected = {n for n in expected if "__pycache__" not in n}
    assert f"ftexp/conf/mode/{MODE}.yaml" in expected
    missing = sorted(expected - names)
    assert not missing, f"not in the wheel (missing from pyproject's packages or package-data?): {missing}"

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=tmp_path)
    python = venv / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", wheel], cwd=tmp_path)
    site = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=tmp_path)
                .stdout.strip())
    (site / "_ftexp_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")

    out = tmp_path / "elsewhere"
    out.mkdir()
    composed = json.loads(_run([python, "-c", COMPOSE], cwd=out).stdout.strip().splitlines()[-1])
    assert Path(composed["ftexp"]).is_relative_to(site), composed
    assert Path(composed["mode_yaml"]).is_relative_to(site) and Path(composed["mode_yaml"]).is_file(), composed
    assert (composed["mode"], composed["scenario"], composed["stage"]) == (MODE, "no_failure", "prepare")

    # hydra.main's config_path, through the CLI: --cfg job prints the composed config and runs nothing.
    cli = _run([python, "-m", "ftexp", f"mode={MODE}", "scenario=no_failure", "stage=prepare", "--cfg", "job"], cwd=out)
    assert f"name: {MODE}" in cli.stdout, cli.stdout
    assert not any(out.iterdir()), "--cfg job should write nothing"
