"""scenario=realistic_gsm8k end to end on a tiny HF checkpoint: the policy is the checkpoint's, all the way.

A random 4-layer Qwen3 checkpoint (``hf_checkpoints``: its own per-character tokenizer with permuted
ids) trains 2 rollouts of the tests' GSM8K problems without faults, in the recipe's mode (2 cells of 2
CP ranks) with 2 CPU engines. The random model answers nothing right, so the accuracy check fails
(exit 1) and every other check must hold. What must show that the checkpoint, not a preset, is the
policy: the weights the cells push at the initial sync are the checkpoint's tensors (hash for hash),
the engines hold what the trainer pushed after every commit, and every prompt is a GSM8K question in
the checkpoint tokenizer's ids.
"""

import json
from pathlib import Path

import pytest
import torch
from hf_checkpoints import token_id, write_checkpoint

from ftexp.audit.checksums import tensor_hash
from ftexp.tasks.gsm import read_gsm8k
from ftexp_runner import report_checks, run_named

pytestmark = pytest.mark.e2e
FIXTURES = Path(__file__).parents[1] / "tasks" / "fixtures"
DATA, TEST = FIXTURES / "gsm8k_mini.jsonl", FIXTURES / "gsm8k_test_mini.jsonl"


def _events(side_dir: Path, kind: str) -> list[dict]:
    lines = [json.loads(ln) for f in sorted((side_dir / "events").glob("*.jsonl")) for ln in f.read_text().splitlines()]
    return [e for e in lines if e["type"] == kind]


def test_realistic_gsm8k_trains_the_checkpoints_policy(tmp_path):
    from safetensors.torch import load_file

    checkpoint = write_checkpoint(tmp_path / "qwen3")
    run_dir, result = run_named(
        tmp_path, "gsm8k", "scenario=realistic_gsm8k", f"mode.hf_checkpoint={checkpoint}", f"task.data_path={DATA}",
        f"task.eval_path={TEST}", "scenario.num_steps=2", "scenario.soak.crash_probability=0",
        "scenario.metric_threshold=0.5", "task.max_response_tokens=16", "trainer.rollout.rollout_batch_size=4",
        "trainer.rollout.n_samples_per_prompt=4", "mode.rollout_num_engines=2", timeout=900)
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    checks = report_checks(run_dir)
    assert {n for n, c in checks.items() if not c["passed"]} == {"accuracy"}, {n: c["summary"] for n, c in checks.items()}
    assert [step for step, _ in checks["accuracy"]["details"]["curve"]] == [0, 2]

    updates = _events(run_dir / "target", "inference_engine_weight_checksum")
    initial = next(e for e in updates if e["rollout_id"] is None)
    weights = load_file(str(checkpoint / "model.safetensors"))
    assert initial["trainer_checksums"] == {name: tensor_hash(t) for name, t in weights.items()}
    assert all(engine == e["trainer_checksums"] for e in updates for engine in e["engine_checksums"])
    assert sorted(e["rollout_id"] for e in updates if e["rollout_id"] is not None) == [0, 1]

    questions = {tuple(token_id(c) for c in p.prompt) for p in read_gsm8k(DATA)}
    for rollout_id in (0, 1):
        rollout = torch.load(run_dir / "target" / "rollout_data" / f"{rollout_id}.pt", weights_only=False)
        for sample in rollout["samples"]:
            prompt = tuple(sample["tokens"][:len(sample["tokens"]) - sample["response_length"]])
            assert prompt in questions, prompt[:20]
