"""Chaos soak: random real crashes (and a deadlock) through the control server; no hang, many heals."""

import json

import pytest

from ftexp_runner import run_ftexp

pytestmark = pytest.mark.e2e


def _report(run_dir):
    return json.loads((run_dir / "report.json").read_text())


def test_ft_random_survives_injected_faults(tmp_path):
    run_dir = tmp_path / "soak"
    result = run_ftexp("mode=dp4", "scenario=ft_random", "scenario.num_steps=16", "seed=1", f"hydra.run.dir={run_dir}",
                       cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    checks = {c["name"]: c for c in _report(run_dir)["checks"]}
    recoveries = checks["injections"]["details"]["recoveries"]
    assert len(recoveries) >= 2 and recoveries[0]["mode"] == "deadlock"
    assert recoveries[0]["recovery_s"] is not None, "the deadlocked cell was detected, replaced and healed"
    assert 0 < recoveries[0]["detection_s"] <= recoveries[0]["recovery_s"]
    # Each healed injection's timeline is in order: detected, relaunch requested, allocated, healed.
    for row in recoveries:
        if row["recovery_s"] is not None:
            steps = [row["detection_s"], row["relaunch_requested_s"], row["allocated_s"], row["recovery_s"]]
            assert None not in steps and steps == sorted(steps), row
    assert set(checks["injections"]["details"]["by_kind"]) == {r["mode"] for r in recoveries}
    assert len(checks["heals"]["details"]["heals"]) >= 2
    assert checks["target_event_analyzer"]["passed"]
    # the control server's port was picked freely and recorded in the events
    events = (run_dir / "target" / "events" / "main.jsonl").read_text()
    assert '"type":"control_server_started"' in events and '"host":"127.0.0.1"' in events


def test_undetected_deadlock_is_a_diagnosed_hang(tmp_path):
    """Without the controller nobody replaces a frozen cell: the step deadline must fail the run and say why."""
    run_dir = tmp_path / "hang"
    result = run_ftexp("mode=dp2", "scenario=ft_random", "scenario.num_steps=6", "scenario.control.controller=false",
                       "scenario.soak.modes=[deadlock]", "scenario.soak.step_deadline_s=40", f"hydra.run.dir={run_dir}",
                       cwd=tmp_path)
    assert result.returncode == 1
    training = next(c for c in _report(run_dir)["checks"] if c["name"] == "training")
    text = json.dumps(training)
    assert "HANG" in text and "train" in text, text[:2000]
