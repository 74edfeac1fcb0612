"""The benchmark's last table: each figure of a run against the bound fault tolerance is held to."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[2] / "bench"))

import step_time  # noqa: E402
from step_time import RunFailed, markdown, measure, repeated_heal_row, target_rows  # noqa: E402
from taking_turns import SideTurns  # noqa: E402


def _step(mode: str, run: str, ratio: float) -> dict:
    return {"mode": mode, "run": run, "verdict": "passed", "ratio": ratio, "ratio_range": f"{ratio:.3f}–{ratio + 0.1:.3f}"}


def _heal(mode: str, spare_cells: int, fault_to_commit_s: float, vs_loopback: float, connections: int,
          recovery_s: float = 0.5) -> dict:
    # The way back, in this plan: detection, the shrunk rollout, then the restarted cell's heal and first commit;
    # of it, the two rollouts' training and the recovery's own time.
    return {"mode": mode, "spare_cells": spare_cells, "verdict": "passed", "detection_s": 0.2,
            "shrink_first_commit_s": fault_to_commit_s / 2 - 0.2, "start_to_commit_s": fault_to_commit_s / 2,
            "fault_to_commit_s": fault_to_commit_s, "training_s": fault_to_commit_s - recovery_s,
            "recovery_s": recovery_s,
            "transfer_vs_loopback": vs_loopback, "transfer_vs_loopback_same_connections": vs_loopback + 0.1,
            "connections": connections}


def test_each_figure_is_held_to_its_engines_bound():
    rows = target_rows(
        [_step("dp2", "audit off", 1.04), _step("dp2_cp2_tp2_ep2", "audit off", 1.08), _step("dp4", "audit on", 1.26),
         _step("dp2_cp2_tp2_ep2", "audit on", 1.5), _step("dp2", "large, audit on", 1.02)],
        [_heal("dp2", 1, 2.5, 0.6, 1, recovery_s=2.1), _heal("dp2_cp2_tp2_ep2", 1, 6.0, 0.2, 4, recovery_s=1.5),
         _heal("dp2", 0, 9.0, 0.5, 1)])
    met = {r["figure"]: (r["target"], r["met"]) for r in rows}
    assert met == {
        "target ÷ baseline step, audit off, dp2": ("≤ 1.05", "yes"),
        "target ÷ baseline step, audit off, dp2_cp2_tp2_ep2": ("≤ 1.1", "yes"),  # megatron's looser bound
        "target ÷ baseline step, audit on, dp4": ("≤ 1.25", "no"),
        "target ÷ baseline step, large, audit on, dp2": ("≤ 1.03", "yes"),
        "crash → next commit, the shrunk quorum's (s), dp2": ("≤ 2", "yes"),
        "restart → commit with the cell back (s), one spare, dp2": ("≤ 2", "yes"),
        "crash → commit with the cell back, less its two rollouts' training (s), one spare, dp2": ("≤ 2", "no"),
        "crash → next commit, the shrunk quorum's (s), dp2_cp2_tp2_ep2": ("≤ 5", "yes"),
        "restart → commit with the cell back (s), one spare, dp2_cp2_tp2_ep2": ("≤ 5", "yes"),
        # the whole way (6 s) is two rollouts' training (4.5 s) and the recovery (1.5 s): the recovery is held
        "crash → commit with the cell back, less its two rollouts' training (s), one spare, dp2_cp2_tp2_ep2":
            ("≤ 5", "yes"),
        "heal transfer ÷ raw loopback copy, dp2, spare_cells=1": ("≥ 0.5", "yes"),
        "heal transfer ÷ raw loopback copy, dp2_cp2_tp2_ep2, spare_cells=1": ("≥ 0.5", "no"),
        "heal transfer ÷ raw loopback copy, dp2, spare_cells=0": ("≥ 0.5", "yes"),  # the bound itself is met
    }  # megatron with its audits on has no bound, and a heal without a spare no crash → commit bound
    measured = {r["figure"]: r["measured"] for r in rows}
    assert measured["crash → next commit, the shrunk quorum's (s), dp2_cp2_tp2_ep2"] == 3.0  # detection + the shrunk rollout
    spreads = {r["figure"]: r["spread"] for r in rows}
    assert spreads["heal transfer ÷ raw loopback copy, dp2_cp2_tp2_ep2, spare_cells=1"] == "0.300 on 4 connections"
    assert spreads["heal transfer ÷ raw loopback copy, dp2, spare_cells=1"] is None  # one connection: the plain yardstick
    assert spreads["target ÷ baseline step, audit off, dp2"] == "1.040–1.140"
    assert spreads["crash → commit with the cell back, less its two rollouts' training (s), one spare, "
                   "dp2_cp2_tp2_ep2"] == "whole way 6.000 s, of it training 4.500 s"


def test_a_figure_the_run_did_not_measure_is_not_marked():
    [row] = target_rows([], [{**_heal("dp2", 0, 9.0, 0.5, 1), "transfer_vs_loopback": None}])
    assert row["met"] == "-" and row["measured"] is None


def test_a_run_whose_verdict_failed_is_measured_but_named_so():
    failed = {**_step("dp2_cp2_pp2", "audit off", 1.07), "verdict": "failed: dumps, dumps_fp32"}
    [row] = target_rows([failed], [])
    assert row["figure"] == "target ÷ baseline step, audit off, dp2_cp2_pp2 (verdict failed: dumps, dumps_fp32)"
    assert (row["measured"], row["met"]) == (1.07, "yes")


def test_a_run_without_a_verdict_becomes_a_row_and_the_bench_goes_on():
    def crashed(mode: str) -> dict:
        raise RunFailed(f"{mode}: exit 1, no verdict: RuntimeError: boom")

    steps: list[dict] = []
    measure(steps, {"mode": "dp4_cp2", "run": "audit off"}, crashed, "dp4_cp2")
    measure(steps, {"mode": "dp2", "run": "audit off"}, lambda mode: _step(mode, "audit off", 1.01), "dp2")
    assert [s["verdict"] for s in steps] == ["none (dp4_cp2: exit 1, no verdict: RuntimeError: boom)", "passed"]
    met = {r["figure"]: r["met"] for r in target_rows(steps, [])}
    assert met == {"target ÷ baseline step, audit off, dp4_cp2 (verdict none (dp4_cp2: exit 1, no verdict: "
                   "RuntimeError: boom))": "-", "target ÷ baseline step, audit off, dp2": "yes"}
    table = markdown(steps, [], "today")
    assert "| dp4_cp2 | audit off | none (dp4_cp2: exit 1, no verdict: RuntimeError: boom) | - |" in table


def test_a_wide_models_heal_is_held_to_the_transfer_bound_only():
    wide = {**_heal("dp2_cp2_tp2_ep2", 1, 7.8, 0.63, 4), "model": "wide_moe_5layer"}
    rows = target_rows([], [_heal("dp2_cp2_tp2_ep2", 1, 4.5, 0.2, 4), wide])
    assert {r["figure"]: r["met"] for r in rows} == {
        "crash → next commit, the shrunk quorum's (s), dp2_cp2_tp2_ep2": "yes",
        "restart → commit with the cell back (s), one spare, dp2_cp2_tp2_ep2": "yes",
        "crash → commit with the cell back, less its two rollouts' training (s), one spare, dp2_cp2_tp2_ep2": "yes",
        "heal transfer ÷ raw loopback copy, dp2_cp2_tp2_ep2, spare_cells=1": "no",
        "heal transfer ÷ raw loopback copy, dp2_cp2_tp2_ep2 (wide_moe_5layer), spare_cells=1": "yes",
    }


def test_repeated_heals_give_the_median_run_by_transfer_rate_and_its_range(monkeypatch):
    rates = iter([0.9, None, 0.2, 0.4])  # one run's transfer went unmeasured: not ranked, still a run

    def heal_row(mode, spare_cells, model):
        rate = next(rates)
        return {**_heal(mode, spare_cells, 4.0, rate or 0.0, 4), "transfer_vs_loopback": rate}

    monkeypatch.setattr(step_time, "heal_row", heal_row)
    row = repeated_heal_row("dp2_cp2_tp2_ep2", 1, None, 4)
    assert row["transfer_vs_loopback"] == 0.4 and row["transfer_vs_loopback_range"] == "0.200–0.900"
    assert row["repeats"] == 4 and len(row["runs"]) == 4
    [figure] = [r for r in target_rows([], [row]) if r["figure"].startswith("heal transfer")]
    assert figure["spread"] == "0.200–0.900 over 4 runs; 0.500 on 4 connections" and figure["met"] == "no"
    assert "runs" not in markdown([], [row], "now").split("Crash → shrink")[1].splitlines()[2]  # not a column


def test_a_configurations_repeats_train_on_rollouts_recorded_once_and_keep_their_order(monkeypatch):
    trained_on, ratios = [], iter([1.05, 1.01, 1.03])

    def step_row(mode, label, overrides, target_first, rollouts, turn_s):
        trained_on.append((target_first, rollouts, sorted(p.name for p in rollouts.iterdir())))
        return {**_step(mode, label, next(ratios)), "cpu_ratio": 1.0, "target_s": 1.0, "baseline_s": 1.0}

    monkeypatch.setattr(step_time, "step_row", step_row)
    row = step_time.repeated_step_row("dp2", "audit on", ["scenario.num_rollout=2"], 3)
    assert [first for first, _, _ in trained_on] == [False, True, False]  # the sides take turns at training first
    assert len({path for _, path, _ in trained_on}) == 1  # one recording (a real stage=prepare) for every repeat
    assert all(names == ["0.pt", "1.pt"] for _, _, names in trained_on)
    assert not trained_on[0][1].exists()  # removed with the row
    assert row["ratio"] == 1.03 and row["ratio_range"] == "1.010–1.050"  # the median run, and the range
    assert [r["ratio"] for r in row["runs"]] == [1.05, 1.01, 1.03]  # in the order they ran: the host's drift shows


def test_taking_turns_a_step_counts_only_while_its_side_ran_and_only_whole_steps_are_broken_down(tmp_path):
    side = tmp_path / "target"
    side.mkdir()
    (side / "perf.jsonl").write_text("".join(json.dumps({"step": s, "step_time_s": t}) + "\n"
                                             for s, t in [(0, 5.0), (1, 1.0), (2, 3.5)]))
    (side / "step_sections.jsonl").write_text("".join(
        json.dumps({"step": s, "attempt": 0, "cell": 0, "rank": 0, "compute_s": c, "total_s": c}) + "\n"
        for s, c in [(1, 0.9), (2, 3.4)]))
    # Rollout 2's step ran 101.0-104.5 on the wall clock, and its side was stopped 101.5-104.0 of it.
    turns = SideTurns(side / "perf.jsonl", stopped=[(101.5, 104.0)], ends={0: 100.0, 1: 101.0, 2: 104.5})
    rows, broken_down = step_time.side_rows(side, turns)
    assert [(r["step"], r["step_time_s"], r["stopped_s"]) for r in rows] == [(1, 1.0, 0.0), (2, 1.0, 2.5)]
    # Its sections were timed on clocks that ran on while it was stopped: only rollout 1 is broken down.
    assert [(r["step"], r["compute_s"]) for r in broken_down] == [(1, 0.9)]


def test_a_rollouts_training_is_its_committed_attempts_slowest_rank(tmp_path):
    # Rollout 2: attempt 0 was cut short by a crash (both cells), attempt 1 committed on the survivor's two ranks.
    phase = tmp_path / "target" / "phase_b"
    phase.mkdir(parents=True)
    (phase / "step_sections.jsonl").write_text("".join(
        json.dumps({"step": step, "attempt": attempt, "cell": cell, "rank": rank, "total_s": total}) + "\n"
        for step, attempt, cell, rank, total in [(1, 0, 0, 0, 1.0), (2, 0, 0, 0, 9.0), (2, 0, 1, 0, 8.0),
                                                 (2, 1, 0, 0, 2.5), (2, 1, 0, 1, 2.75)]))
    sections = step_time.step_sections(tmp_path / "target")
    assert step_time.training_s(sections, 2) == 2.75
    assert step_time.training_s(sections, 1) == 1.0
    assert step_time.training_s(sections, 3) is None  # never trained: no figure, not zero
