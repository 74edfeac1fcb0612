"""Real end-to-end scenario runs on the CPU (Ray actors, gloo/torchft groups, submitit jobs).

Each scenario runs once per mode; the negative controls then edit a copy of a finished run and
re-run ``stage=compare``, or re-run training with a deliberate healing or retry bug, and must turn
the verdict red with a message naming the cause. The with_failure run on dp2 trains under a
socket probe: every socket of its processes (Ray, gloo, the TCPStore, submitit) stays on 127.0.0.1.
"""

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from ftexp.audit.events import FaultInjectedEvent, TrainGroupStepEndEvent, read_events
from ftexp_runner import run_ftexp
from loopback_probe import WatchedRun, run_watching_sockets

pytestmark = pytest.mark.e2e


def _run(tmp_root: Path, name: str, *overrides: str) -> tuple[Path, object]:
    run_dir = tmp_root / name
    result = run_ftexp(*overrides, f"hydra.run.dir={run_dir}", cwd=tmp_root)
    return run_dir, result


def _report(run_dir: Path) -> dict:
    return json.loads((run_dir / "report.json").read_text())


def _check(report: dict, name: str) -> dict:
    return next(c for c in report["checks"] if c["name"] == name)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return tmp_path_factory.mktemp("runs")


# dp4 runs with_failure_cell0 (cell 0 crashes: a 3-of-4 shrink whose survivors' alive ranks are not
# their cell indices, the group's dumps move to cell 1, which heals cell 0; then a middle cell crashes)
# and deterministic (the pairwise tree over 4 cells: on 2, a + b == b + a hides any reduction order).
# dp2 runs the last cell's crash with two rollouts after the heal. dp4's no_failure and dp2's
# deterministic add little and are left out of the default run.
SCENARIOS = [("no_failure", "dp2"), ("with_failure", "dp2"), ("with_failure_cell0", "dp4"), ("deterministic", "dp4")]
# dp4's two heals take warm spares (the second one the replacement of the first); dp2's heal starts new ranks.
SPARE_CELLS = {("with_failure_cell0", "dp4"): 1}
# The run whose every socket (Ray, gloo, the TCPStore, submitit, the heal's transfer) is watched while it trains.
WATCHED = ("with_failure", "dp2")


def _shrink(rollout_id: int, alive: list[int]) -> dict:
    return {"rollout_id": rollout_id, "src_cell_index": None, "healed_cell_indices": [], "alive_cell_indices_after": alive}


def _heal(rollout_id: int, source: int, healed: int, alive: list[int]) -> dict:
    return {"rollout_id": rollout_id, "src_cell_index": source, "healed_cell_indices": [healed],
            "alive_cell_indices_after": alive}


# Positive proof, written out by hand (the verifier derives the same from the plan): each crash fired,
# the quorum shrank, and the heal restored every cell from the lowest-index survivor.
CRASH_RECONFIGURES = {
    "with_failure": [_shrink(2, [0]), _heal(3, 0, 1, [0, 1])],
    "with_failure_cell0": [_shrink(2, [1, 2, 3]), _heal(3, 1, 0, [0, 1, 2, 3]),
                           _shrink(4, [0, 2, 3]), _heal(5, 0, 1, [0, 1, 2, 3])],
}
# Per scenario: cell -> the rollouts of phase_b it dumps to its own root: it commits them in a new quorum (the
# phase's first rollout, a shrink, a heal), another cell is first.
CELL_DUMPS = {
    "with_failure": {1: [1, 3]},
    "with_failure_cell0": {1: [1, 3, 5], 2: [1, 2, 3, 4, 5], 3: [1, 2, 3, 4, 5]},
    "deterministic": {1: [3, 4], 2: [3, 4], 3: [3, 4]},
}
_passed: dict[tuple[str, str], Path] = {}
_watched: dict[tuple[str, str], WatchedRun] = {}


def _passing_run(runs: Path, scenario: str, mode: str) -> Path:
    """The run of ``scenario`` on ``mode``, trained on first use and shared by every test of the module.

    Any test may run first or alone: the run is made here, and a run that does not pass fails the
    test that asked for it (never a skip).
    """
    key = (scenario, mode)
    if key not in _passed:
        name = f"{scenario}_{mode}"
        overrides = (f"mode={mode}", f"scenario={scenario}", f"trainer.spare_cells={SPARE_CELLS.get(key, 0)}")
        if key == WATCHED:
            _watched[key] = run_watching_sockets([*overrides, f"hydra.run.dir={runs / name}"], runs, runs / f"{name}.out")
            run_dir, result = runs / name, _watched[key].result
        else:
            run_dir, result = _run(runs, name, *overrides)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        _passed[key] = run_dir
    return _passed[key]


@pytest.mark.parametrize("scenario, mode", SCENARIOS)
def test_scenario_passes(runs, scenario, mode):
    run_dir = _passing_run(runs, scenario, mode)
    assert (run_dir / "report.md").read_text().startswith("# ftexp verdict: PASSED")
    assert (run_dir / "curves.png").stat().st_size > 0
    report = _report(run_dir)
    if scenario in CRASH_RECONFIGURES:
        actual = _check(report, "phase_b/target_reconfigures")["details"]["actual"]
        assert actual == CRASH_RECONFIGURES[scenario]
        assert _check(report, "phase_b/faults_injected")["passed"]
        recoveries = _check(report, "phase_b/recovery")["details"]["recoveries"]
        assert all(r["bytes"] > 0 for r in recoveries[1::2]) and all(r["detection_s"] is not None for r in recoveries[::2])
        assert all(r["spare"] == bool(SPARE_CELLS.get((scenario, mode))) for r in recoveries[1::2])
        # The witness rule checked every commit, including the retry of the crashed rollout with fresh ids.
        analyzer = _check(report, "phase_b/target_event_analyzer")
        assert analyzer["passed"] and analyzer["details"]["issues"] == []
        assert analyzer["details"]["witness_snapshot_events"] > 0
        assert analyzer["details"]["witness_allocation_attempts"]["2"] == [0, 1]
    if scenario == "deterministic":  # phase_a's heal of the last cell (restored) and phase_b's of cell 0 from cell 1
        assert _check(report, "phase_b/target_reconfigures")["details"]["actual"] == [
            _heal(2, 0, 3, [0, 1, 2, 3]), _heal(4, 1, 0, [0, 1, 2, 3])]
    if scenario in CELL_DUMPS:  # every other alive cell's own dumps were compared too, in each new quorum
        for cell, rollouts in CELL_DUMPS[scenario].items():
            assert _check(report, f"phase_b/dumps/cell{cell}")["details"]["leaves"] == [f"fwd_bwd/rollout_{r}" for r in rollouts]
        # Each side resumed from phase_a's checkpoint with its history and witness counter, on its own.
        for side in ("baseline", "target"):
            assert _check(report, f"phase_b/{side}_resume")["passed"]


def test_a_failure_run_uses_only_loopback(runs):
    _passing_run(runs, *WATCHED)
    watched = _watched[WATCHED]
    assert watched.sockets_seen > 0, "the probe saw no socket of the run at all"
    assert not watched.foreign, "\n".join(watched.foreign[:20])


def _copy_of(runs: Path, key: tuple[str, str], tmp_path: Path) -> Path:
    dst = tmp_path / "copy"
    shutil.copytree(_passing_run(runs, *key), dst)
    return dst


def _compare(run_dir: Path, scenario: str, mode: str):
    return run_ftexp(f"mode={mode}", f"scenario={scenario}", "stage=compare", f"run_dir={run_dir}",
                     cwd=run_dir.parent)


def test_compare_reproduces_verdict_without_training(runs, tmp_path):
    run_dir = _copy_of(runs, ("no_failure", "dp2"), tmp_path)
    before = _report(run_dir)
    (run_dir / "report.json").unlink()
    result = _compare(run_dir, "no_failure", "dp2")
    assert result.returncode == 0, result.stderr
    after = _report(run_dir)
    assert [c["name"] for c in after["checks"]] == [c["name"] for c in before["checks"]]
    assert after["passed"]


def _target_grad(run_dir: Path, phase: str = "") -> Path:
    leaf = run_dir / "target" / phase / "dumps" / "fwd_bwd" / "rollout_1"
    return next(leaf.glob("*name=grad__layers.0.mlp.fc1.weight___*.pt"))


def test_perturbed_gradient_fails_naming_it(runs, tmp_path):
    run_dir = _copy_of(runs, ("no_failure", "dp2"), tmp_path)
    path = _target_grad(run_dir)
    dump = torch.load(path, weights_only=True)
    g = dump["value"]
    torch.manual_seed(0)
    dump["value"] = g * (1 + 0.02 * torch.randn_like(g))  # each element off by ~2%
    torch.save(dump, path)
    result = _compare(run_dir, "no_failure", "dp2")
    assert result.returncode == 1
    report = _report(run_dir)
    # rel ~ 2e-4 passes the seed's bf16-calibrated rel <= 0.0085; the fp32 rules catch it.
    assert _check(report, "dumps")["passed"]
    dumps = _check(report, "dumps_fp32")
    assert not dumps["passed"] and "grad__layers.0.mlp.fc1.weight" in json.dumps(dumps)


def test_deleted_tensor_or_leaf_fails(runs, tmp_path):
    run_dir = _copy_of(runs, ("no_failure", "dp2"), tmp_path)
    _target_grad(run_dir).unlink()
    assert _compare(run_dir, "no_failure", "dp2").returncode == 1
    assert "grad__layers.0.mlp.fc1.weight" in json.dumps(_check(_report(run_dir), "dumps"))
    shutil.rmtree(run_dir / "target" / "dumps" / "fwd_bwd" / "rollout_1")
    assert _compare(run_dir, "no_failure", "dp2").returncode == 1
    assert "rollout_1" in _check(_report(run_dir), "dumps")["summary"] + json.dumps(_check(_report(run_dir), "dumps"))


def test_corrupt_dump_is_bad_input(runs, tmp_path):
    run_dir = _copy_of(runs, ("no_failure", "dp2"), tmp_path)
    _target_grad(run_dir).write_bytes(b"not a torch file")
    result = _compare(run_dir, "no_failure", "dp2")
    assert result.returncode == 2 and "corrupt" in result.stderr


def _failed_checks(run_dir: Path) -> dict[str, dict]:
    return {c["name"]: c for c in _report(run_dir)["checks"] if not c["passed"]}


def _check_names(run_dir: Path) -> list[str]:
    return [c["name"] for c in _report(run_dir)["checks"]]


def test_scale_error_fails_the_seed_rules_naming_tensor_and_rule(runs, tmp_path):
    """One gradient 3% too small: rel ~4.6e-4 passes rel <= 0.0085; the stock norm_ratio bound (0.015)
    catches it without the CPU-only fp32 rules, i.e. with what a bf16 GPU run would have."""
    run_dir = _copy_of(runs, ("with_failure", "dp2"), tmp_path)
    path = _target_grad(run_dir, "phase_b")
    dump = torch.load(path, weights_only=True)
    dump["value"] = dump["value"] * 0.97
    torch.save(dump, path)
    result = run_ftexp("mode=dp2", "scenario=with_failure", "stage=compare", f"run_dir={run_dir}",
                       "threshold.fp32_dumps=[]", cwd=tmp_path)
    assert result.returncode == 1
    failed = _failed_checks(run_dir)
    assert "phase_b/dumps" in failed and not any(name.startswith("phase_b/metrics") for name in failed)
    assert not any("fp32" in name for name in _check_names(run_dir))  # the CPU-only rules were off
    [record] = failed["phase_b/dumps"]["details"]["not_passed"]
    assert (record["name"], record["leaf"], record["rule"]) == ("grad__layers.0.mlp.fc1.weight", "fwd_bwd/rollout_1", ".*")
    assert record["rel"] < 0.0085 and abs(record["norm_ratio"] - 0.03) < 1e-6
    summary = failed["phase_b/dumps"]["summary"]
    assert "grad__layers.0.mlp.fc1.weight" in summary and "norm_ratio <= 0.015" in summary


def test_tensor_inventory_names_a_tensor_renamed_in_the_target_or_lost_from_both_sides(runs, tmp_path):
    run_dir = _copy_of(runs, ("no_failure", "dp2"), tmp_path)
    path = _target_grad(run_dir)
    renamed = path.with_name(path.name.replace("mlp.fc1.weight", "mlp.fc1.weight_v2"))
    path.rename(renamed)
    assert _compare(run_dir, "no_failure", "dp2").returncode == 1
    inventory = _check(_report(run_dir), "tensor_inventory")
    assert not inventory["passed"]
    assert inventory["summary"].endswith("first: fwd_bwd/rollout_1: grad__layers.0.mlp.fc1.weight "
                                         "[cp=0, ep=0, pp=0, step=0, tp=0] in baseline, missing in target")
    assert "grad__layers.0.mlp.fc1.weight_v2 [cp=0, ep=0, pp=0, step=0, tp=0] in target, missing in baseline" in \
        json.dumps(inventory["details"]["issues"])

    # Lost from both sides of one rollout: nothing left for the value comparison to notice.
    renamed.unlink()
    next((run_dir / "baseline" / "dumps" / "fwd_bwd" / "rollout_1").glob("*name=grad__layers.0.mlp.fc1.weight___*.pt")).unlink()
    assert _compare(run_dir, "no_failure", "dp2").returncode == 1
    failed = _failed_checks(run_dir)
    assert "tensor_inventory" in failed and "dumps" not in failed  # the group's value comparison sees nothing
    assert failed["tensor_inventory"]["summary"].endswith(
        "first: baseline: grad__layers.0.mlp.fc1.weight [cp=0, ep=0, pp=0, step=0, tp=0] in fwd_bwd/rollout_0, "
        "missing in fwd_bwd/rollout_1")


def test_dead_threshold_rule_is_flagged(runs, tmp_path):
    """A typo'd pattern judges nothing; the dumps check fails naming the rule although every tensor passed."""
    run_dir = _copy_of(runs, ("no_failure", "dp2"), tmp_path)
    result = run_ftexp("mode=dp2", "scenario=no_failure", "stage=compare", f"run_dir={run_dir}",
                       "threshold.dumps=[['grad__.*[.]atn[.].*','rel <= 0'],['.*','rel <= 0.0085 and norm_ratio <= 0.015']]",
                       cwd=tmp_path)
    assert result.returncode == 1
    failed = _failed_checks(run_dir)
    assert "dumps" in failed and "tensor_inventory" not in failed
    assert failed["dumps"]["details"]["counts"]["passed"] == 116
    [issue] = failed["dumps"]["details"]["issues"]
    assert issue.startswith("threshold rule #0 'grad__.*[.]atn[.].*' -> 'rel <= 0' is the first match of no tensor")


def test_removed_heal_event_fails(runs, tmp_path):
    run_dir = _copy_of(runs, ("with_failure", "dp2"), tmp_path)
    main_log = run_dir / "target" / "phase_b" / "events" / "main.jsonl"
    lines = [ln for ln in main_log.read_text().splitlines() if '"healed_cell_indices":[1]' not in ln]
    main_log.write_text("\n".join(lines) + "\n")
    assert _compare(run_dir, "with_failure", "dp2").returncode == 1
    assert not _check(_report(run_dir), "phase_b/target_reconfigures")["passed"]


def test_missing_fault_event_fails(runs, tmp_path):
    run_dir = _copy_of(runs, ("with_failure", "dp2"), tmp_path)
    for path in (run_dir / "target" / "phase_b" / "events").glob("*.jsonl"):
        path.write_text("".join(ln + "\n" for ln in path.read_text().splitlines() if '"fault_injected"' not in ln))
    assert _compare(run_dir, "with_failure", "dp2").returncode == 1
    assert not _check(_report(run_dir), "phase_b/faults_injected")["passed"]


def test_last_bit_flip_fails_deterministic(runs, tmp_path):
    run_dir = _copy_of(runs, ("deterministic", "dp4"), tmp_path)
    leaf = run_dir / "target" / "phase_b" / "dumps" / "fwd_bwd" / "rollout_5"
    path = next(leaf.glob("*name=weight__lm_head.weight___*.pt"))
    dump = torch.load(path, weights_only=True)
    w = dump["value"].clone()
    w.view(-1)[7] = torch.nextafter(w.view(-1)[7], torch.tensor(float("inf")))
    dump["value"] = w
    torch.save(dump, path)
    assert _compare(run_dir, "deterministic", "dp4").returncode == 1
    assert "weight__lm_head.weight" in json.dumps(_check(_report(run_dir), "phase_b/dumps"))


def test_with_the_audit_off_the_report_names_the_checks_it_did_not_run(runs, tmp_path):
    """``trainer.audit=false`` still compares dumps and metrics, and never passes the audit rules silently."""
    run_dir = _copy_of(runs, ("with_failure", "dp2"), tmp_path)
    result = run_ftexp("mode=dp2", "scenario=with_failure", "stage=compare", f"run_dir={run_dir}",
                       "trainer.audit=false", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    report = _report(run_dir)
    assert _check(report, "phase_b/dumps")["passed"] and _check(report, "phase_b/metrics[train/]")["passed"]
    for name in ("phase_b/target_event_analyzer", "phase_b/cell_dumps"):
        assert _check(report, name)["summary"].startswith("NOT RUN: trainer.audit=false"), name


def test_with_the_audit_off_runs_of_rollouts_keep_the_crash_and_heal_matching(tmp_path):
    """Audit off, the driver trains consecutive rollouts in one call per rank: rollouts 1 and 2 (a test action
    follows 2), then 3 alone (its refresh heals), then 4 and 5. The crash at rollout 2 ends the first run's attempt
    0 after rollout 1 committed; the shrink, the heal and the comparison come out as with the audit on."""
    run_dir, result = _run(tmp_path, "audit_off", "mode=dp2", "scenario=with_failure", "trainer.audit=false")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = _report(run_dir)
    assert report["passed"] and _check(report, "phase_b/dumps")["passed"]
    assert _check(report, "phase_b/target_reconfigures")["details"]["actual"] == CRASH_RECONFIGURES["with_failure"]
    events = read_events(run_dir / "target" / "phase_b" / "events")
    assert [(e.rollout_id, e.attempt) for e in events if isinstance(e, TrainGroupStepEndEvent)] == [
        (0, 0), (1, 0), (2, 1), (3, 0), (4, 0), (5, 0)]  # rollout 0: phase_a's, restored with its checkpoint
    assert [(e.rollout_id, e.attempt) for e in events if isinstance(e, FaultInjectedEvent)] == [(2, 0)]


def test_wrong_threshold_fails(runs, tmp_path):
    """The with_failure run is not bitwise (a degraded quorum reorders sums): a bitwise threshold must fail it."""
    run_dir = _copy_of(runs, ("with_failure", "dp2"), tmp_path)
    result = run_ftexp("mode=dp2", "scenario=with_failure", "stage=compare", f"run_dir={run_dir}",
                       "threshold.dumps=[['.*','rel <= 0']]", cwd=tmp_path)
    assert result.returncode == 1
    assert not _check(_report(run_dir), "phase_b/dumps")["passed"]


def _retrain(run_dir: Path, scenario: str, mode: str, stage: str, phase: str, control: str):
    """Re-train one side of one phase of a copy of a finished run, with a deliberate bug."""
    return run_ftexp(f"mode={mode}", f"scenario={scenario}", f"stage={stage}", f"phase={phase}", f"run_dir={run_dir}",
                     f"trainer.negative_control={control}", cwd=run_dir.parent)


@pytest.mark.parametrize("control, parts", [
    ("skip_heal_transfer", {"param_hashes", "optimizer_hashes", "rng_hashes"}),
    # The healed cell's fresh Adam moments then step its weights differently too.
    ("skip_optimizer_transfer", {"param_hashes", "optimizer_hashes"}),
    # Weights and moments are right; only the generators are the fresh process's, not the source's.
    ("skip_rng_transfer", {"rng_hashes"}),
])
def test_broken_healing_turns_verdict_red(runs, tmp_path, control, parts):
    """phase_a's target of the dp4 deterministic run heals the last cell at rollout 2: re-trained with a heal
    that drops part of the state, the checksum rule names exactly the parts that differ."""
    run_dir = _copy_of(runs, ("deterministic", "dp4"), tmp_path)
    result = _retrain(run_dir, "deterministic", "dp4", "target", "phase_a", control)
    assert result.returncode == 1, result.stdout[-2000:]
    failure = _check(_report(run_dir), "training")["summary"]
    assert "[cross_replica_weight_checksum] rollout 2: attempt 0: actor_cell0_rank0 and actor_cell3_rank0" in failure
    differing = re.search(r"differ in \d+ entries \(([^)]*)\)", failure).group(1)
    assert {part.split()[0] for part in differing.split(", ")} == parts, failure


def test_reduction_order_shows_on_four_cells(runs, tmp_path):
    """The target's cross-cell reduce folds ((c0 + c1) + c2) + c3 instead of the baseline's pairwise tree. The
    cells agree with each other (training passes), but not bitwise with the baseline: on 2 cells this
    bug could not show, as a + b == b + a."""
    run_dir = _copy_of(runs, ("deterministic", "dp4"), tmp_path)
    assert _retrain(run_dir, "deterministic", "dp4", "target", "phase_a", "ascending_cell_fold").returncode == 0
    assert _compare(run_dir, "deterministic", "dp4").returncode == 1
    failed = _failed_checks(run_dir)
    assert {"phase_a/dumps", "phase_a/dumps/cell1", "phase_a/dumps/cell2", "phase_a/dumps/cell3"} <= set(failed)
    # phase_b is the stock run's: its target resumed from a phase_a checkpoint that is no longer there.
    assert {name for name in failed if name.startswith("phase_b/")} <= {"phase_b/target_resume"}, list(failed)
    worst = failed["phase_a/dumps"]["details"]["not_passed"][0]
    assert worst["name"].startswith("grad__") and worst["leaf"] == "fwd_bwd/rollout_0" and worst["rule"] == ".*"


def test_logging_cell_must_follow_the_first_alive_cell(runs, tmp_path):
    """A bug that only a crash of cell 0 shows: cell 0 writes the group's dumps and metrics even while it is
    down, so rollout 2 (cells 1-3 alive) has none, and cell 1 dumped it as a non-first cell."""
    run_dir = _copy_of(runs, ("with_failure_cell0", "dp4"), tmp_path)
    assert _retrain(run_dir, "with_failure_cell0", "dp4", "target", "phase_b", "cell0_writes_group_logs").returncode == 0
    assert _compare(run_dir, "with_failure_cell0", "dp4").returncode == 1
    failed = _failed_checks(run_dir)
    assert "leaf fwd_bwd/rollout_2 missing in target" in failed["phase_b/dumps"]["summary"]
    assert failed["phase_b/cell_dump_leaves/cell1"]["details"]["actual"] == [f"fwd_bwd/rollout_{r}" for r in (1, 2, 3, 5)]
    assert "phase_b/metrics[train/]" in failed


def test_a_healed_cells_own_gradient_is_compared(runs, tmp_path):
    """Cell 1 of with_failure is healed at rollout 3; its own rollout-3 gradient, 2% off, turns the verdict red
    (the group's dumps, written by cell 0, and the checksum rule over other events cannot see it)."""
    run_dir = _copy_of(runs, ("with_failure", "dp2"), tmp_path)
    cell1 = run_dir / "target" / "phase_b" / "cell_dumps" / "cell1" / "fwd_bwd"
    # Its own root holds the rollouts that start a new quorum: the phase's first, and the heal's.
    assert sorted(p.name for p in cell1.iterdir()) == ["rollout_1", "rollout_3"]
    leaf = cell1 / "rollout_3"
    path = next(leaf.glob("*name=grad__layers.0.mlp.fc1.weight___*.pt"))
    dump = torch.load(path, weights_only=True)
    torch.manual_seed(0)
    dump["value"] = dump["value"] * (1 + 0.02 * torch.randn_like(dump["value"]))
    torch.save(dump, path)
    assert _compare(run_dir, "with_failure", "dp2").returncode == 1
    failed = _failed_checks(run_dir)
    assert list(failed) == ["phase_b/dumps_fp32/cell1"]
    [record] = failed["phase_b/dumps_fp32/cell1"]["details"]["not_passed"]
    assert (record["name"], record["leaf"]) == ("grad__layers.0.mlp.fc1.weight", "fwd_bwd/rollout_3")


def test_an_event_log_lost_on_resume_by_both_sides_fails_the_absolute_resume_checks(runs, tmp_path):
    """Both sides' phase_b without phase_a's event log: the baseline re-trained with the restore skipped (its
    witness counter restarts, phase_a's commits vanish), the target's restored part cut from its log. Their
    weights, gradients and metrics still agree with each other, so every check comparing the two sides passes;
    each side's own resume check names the loss (and the target's witness rows still hold phase_a's samples)."""
    run_dir = _copy_of(runs, ("with_failure", "dp2"), tmp_path)
    assert _retrain(run_dir, "with_failure", "dp2", "baseline", "phase_b", "skip_event_restore").returncode == 0
    snapshot = run_dir / "target" / "phase_a" / "ckpt" / "iter_0000000" / "debug_events"
    for restored in snapshot.glob("*.jsonl"):
        log = run_dir / "target" / "phase_b" / "events" / restored.name
        log.write_bytes(log.read_bytes().removeprefix(restored.read_bytes()))
    assert _compare(run_dir, "with_failure", "dp2").returncode == 1
    failed = _failed_checks(run_dir)
    assert set(failed) == {"phase_b/baseline_resume", "phase_b/target_resume", "phase_b/target_event_analyzer"}
    for side in ("baseline", "target"):
        assert "restored log lacks the commit events of rollouts [0]" in failed[f"phase_b/{side}_resume"]["details"]["issues"]
    assert "witness counter resumed at 0, the checkpoint's snapshot holds 256" in \
        failed["phase_b/baseline_resume"]["details"]["issues"]



def test_removed_witness_snapshot_fails(runs, tmp_path):
    run_dir = _copy_of(runs, ("with_failure", "dp2"), tmp_path)
    healed = run_dir / "target" / "phase_b" / "events" / "actor_cell1_rank0.jsonl"
    healed.write_text("".join(ln + "\n" for ln in healed.read_text().splitlines()
                              if not ('"witness_snapshot_param"' in ln and '"rollout_id":3' in ln)))
    assert _compare(run_dir, "with_failure", "dp2").returncode == 1
    analyzer = _check(_report(run_dir), "phase_b/target_event_analyzer")
    assert not analyzer["passed"] and "[witness] rollout 3: cell 1 committed but logged no witness snapshot" in analyzer["summary"]


def test_removed_checksum_of_a_healed_cell_fails(runs, tmp_path):
    """Cell 1, healed at rollout 3, without its checksum of that commit: the checksums left still agree, and the
    rule must name the one that is missing (else a heal that never logs one would pass unseen)."""
    run_dir = _copy_of(runs, ("with_failure", "dp2"), tmp_path)
    healed = run_dir / "target" / "phase_b" / "events" / "actor_cell1_rank0.jsonl"
    lines = healed.read_text().splitlines()
    kept = [ln for ln in lines if not ('"train_engine_local_weight_checksum"' in ln and '"rollout_id":3,' in ln)]
    assert len(kept) == len(lines) - 1
    healed.write_text("".join(ln + "\n" for ln in kept))
    assert _compare(run_dir, "with_failure", "dp2").returncode == 1
    analyzer = _check(_report(run_dir), "phase_b/target_event_analyzer")
    assert not analyzer["passed"] and ("[cross_replica_weight_checksum] rollout 3: attempt 0: cell 1 rank 0 committed "
                                       "but logged no weight checksum") in analyzer["summary"], analyzer["summary"]


@pytest.mark.parametrize("control, scenario, phase, rollout", [
    # Every cell steps attempt 0 yet reports it void: the retry trains the rollout's samples twice.
    ("double_apply_retry", "no_failure", "", 0),
    # The survivor of the crash steps on its local gradient although its reduce failed.
    ("leak_discarded_attempt", "with_failure", "phase_b", 2),
])
def test_samples_trained_twice_fail_the_witness_rule(runs, tmp_path, control, scenario, phase, rollout):
    """Only the witness sees these: all alive cells did the same, so their checksums agree."""
    run_dir = _copy_of(runs, (scenario, "dp2"), tmp_path)  # re-train the target only, from the finished run
    result = run_ftexp("mode=dp2", f"scenario={scenario}", "stage=target", f"run_dir={run_dir}",
                       *([f"phase={phase}"] if phase else []), f"trainer.negative_control={control}", cwd=tmp_path)
    assert result.returncode == 1, result.stdout[-2000:]
    failure = _check(_report(run_dir), "training")["summary"]
    assert f"[witness] rollout {rollout}: cell 0" in failure and "missing 0 ids [], extra " in failure, failure
    assert "cross_replica_weight_checksum" not in failure
