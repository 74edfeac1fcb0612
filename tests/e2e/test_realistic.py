"""scenario=realistic end to end: GRPO on arith under random faults keeps learning; a recovery bug does not.

Both runs are the same CI-sized experiment (seed 2, REALISTIC_SMALL). The injector's first fault
lands as soon as training starts, so the first heal comes within the first rollouts. Seed 2's
injector then draws its second fault 0.09 mean intervals (under 3 s) later; it waits until the first
heal leaves two cells alive, and lands then. So the two injections and two heals the scenario
requires come early in the run, however fast the machine trains (the third is drawn ~50 s later).
The one warm spare, rebuilt after each heal, is mostly ready for the next. With correct recovery the
eval accuracy climbs past the threshold; with the engines never updated after the first heal (the
audit off, so only the accuracy can tell), it stays where the heal froze it.
The two runs share a warm-up cache: the second loads the warmed-up state the first computed."""

import pytest

from ftexp_runner import report_checks, run_ftexp

pytestmark = pytest.mark.e2e
# 20 rollouts, an eval every 5; the threshold lies between where the engines stand at the first heal (the
# stale-engines control keeps them there) and the best the run under faults reaches. Measured with MKL and ATen
# on their AVX2 paths (2026-12-04): 0.505 before rollout 0, then 0.650, 0.625, 0.660, 0.705, with or without
# faults; the engines left stale after the first heal held 0.510. A margin of 0.075 over and 0.12 under.
THRESHOLD = 0.63
# A mean of 30 s between faults (time unit 3 s at crash probability 0.1): the two early ones, then the third.
REALISTIC_SMALL = ("scenario=realistic", "seed=2", "scenario.soak.crash_probability=0.1", "scenario.soak.time_unit_s=3",
                   "scenario.soak.first_after_s=0", f"scenario.metric_threshold={THRESHOLD}", "scenario.num_steps=20")


@pytest.fixture(scope="module")
def warmup_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("warmup_cache")


def _run(tmp_path, warmup_cache, name, *overrides):
    run_dir = tmp_path / name
    result = run_ftexp(*REALISTIC_SMALL, *overrides, f"task.warmup.cache_dir={warmup_cache}", f"hydra.run.dir={run_dir}",
                       cwd=tmp_path, timeout=1500)
    return run_dir, result


def test_realistic_learns_under_faults(tmp_path, warmup_cache):
    run_dir, result = _run(tmp_path, warmup_cache, "realistic")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    checks = report_checks(run_dir)
    assert all(c["passed"] for c in checks.values()), {n: c["summary"] for n, c in checks.items() if not c["passed"]}
    accuracy = checks["accuracy"]["details"]
    assert [step for step, _ in accuracy["curve"]] == [0, 5, 10, 15, 20]
    assert accuracy["best"] >= THRESHOLD > accuracy["start"] and accuracy["best"] > accuracy["start"] + 0.05
    assert len(checks["injections"]["details"]["recoveries"]) >= 2 and len(checks["heals"]["details"]["heals"]) >= 2
    report = (run_dir / "report.md").read_text()
    assert f"start {accuracy['start']:.3f}" in report and f"best {accuracy['best']:.3f}" in report
    assert (run_dir / "curves.png").stat().st_size > 0
    # One warm-up for the run: the first cell computed it, the other loaded it (and the cache kept it).
    log = (run_dir / "target" / "train.log").read_text()
    assert "cell0/rank0 ftexp.tasks.warmup: warm-up: 300 supervised steps" in log
    assert "cell1/rank0 ftexp.tasks.warmup: warm-up: loaded the first cell's state" in log


def test_engines_stale_after_the_first_heal_keep_accuracy_below_the_threshold(tmp_path, warmup_cache):
    cached = any(warmup_cache.iterdir())  # the first test's run filled it (unless this test runs alone)
    run_dir, result = _run(tmp_path, warmup_cache, "stale_engines", "trainer.negative_control=skip_engine_update_after_heal",
                           "trainer.audit=false")
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    checks = report_checks(run_dir)
    accuracy = checks["accuracy"]
    assert not accuracy["passed"] and "never reached" in accuracy["summary"], accuracy["summary"]
    assert len(accuracy["details"]["curve"]) == 5  # the run trained to the end: it is the accuracy that failed
    assert checks["target_commits"]["passed"]
    assert not checks["target_engine_updates"]["passed"]
    assert "does not hold the trainer's weights" in checks["target_engine_updates"]["summary"]
    if cached:
        log = (run_dir / "target" / "train.log").read_text()
        assert "warm-up: loaded from the cache" in log and "supervised steps" not in log
