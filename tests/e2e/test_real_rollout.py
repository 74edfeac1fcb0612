"""Live rollout engines end to end: the seed's real-rollout modes, on-policy, on the CPU, on loopback.

Each side starts 4 engines (our sglang-protocol server in Ray actors) behind the real sglang
router, generates every rollout from its current weights, and pushes its weights to the engines
after every commit. The runs must pass with engine checksum events on both sides; deterministic
runs must push bitwise-identical weights; the dense mode's with_failure run trains on the
baseline's rollouts after the heal, through the match guard. Negative controls plant the bugs a
weight-sync path can have and must turn the verdict red, naming the check.
"""

import shutil
from pathlib import Path

import pytest
import torch

from ftexp.config import RolloutBackend, RolloutConfig
from ftexp.engines.megatron.hf_export import to_hf
from ftexp.rollout.client import SamplingParams
from ftexp.rollout.live import sampling_seed
from ftexp.rollout.server import CpuEngine
from ftexp.rollout.server_config import ServerConfig
from loopback_probe import command_line, run_watching_sockets
from ftexp_runner import assert_passed, report_checks, run_ftexp, run_named

pytestmark = pytest.mark.e2e
# Smaller rollouts than the modes' default (32 prompts x 8): 8 prompts x 4 samples keep every run
# on 2 cores to a few minutes with the same machinery.
SMALL = ("trainer.rollout.rollout_batch_size=8", "trainer.rollout.n_samples_per_prompt=4")
# with_failure up to the heal's rollout: 0 | 1, 2 (crash, shrink), 3 (heal, injected)
SHORT = ("scenario.num_rollout=4",)
# Two engines where four add nothing but start-up (half of it): the no_failure run keeps the modes' four.
TWO_ENGINES = ("mode.rollout_num_engines=2",)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return tmp_path_factory.mktemp("real_rollout_runs")


def _dumped_weights(leaf: Path) -> dict[str, torch.Tensor]:
    """The full model a dump leaf holds (weights before that rollout's step), by megatron global name."""
    weights = {}
    for path in sorted(leaf.glob("*name=weight__*cp=0*.pt")):
        dump = torch.load(path, weights_only=False)
        weights[dump["meta"]["name"].removeprefix("weight__")] = dump["value"]
    return weights


def _run_on_loopback(root: Path, name: str, *overrides: str) -> Path:
    """A run whose sockets are watched while it lives (router and engines included): all on 127.0.0.0/8."""
    run_dir = root / name
    # The router renames itself (its command line reads "sglang::router" once it runs).
    watched = run_watching_sockets([*overrides, f"hydra.run.dir={run_dir}"], root, root / f"{name}.out",
                                   interval_s=0.5, counted=lambda pid: b"sglang" in command_line(pid))
    assert watched.result.returncode == 0, watched.result.stdout[-3000:]
    assert watched.sockets_seen > 0, "the probe saw no socket of the sglang router"
    assert not watched.foreign, "\n".join(watched.foreign[:20])
    return run_dir


def test_no_failure_trains_on_policy_on_loopback(runs):
    run_dir = _run_on_loopback(runs, "nf", "mode=dp2_cp2_real_rollout_dense", "scenario=no_failure", *SMALL)
    checks = report_checks(run_dir)
    assert all(c["passed"] for c in checks.values())
    for side in ("baseline", "target"):
        assert checks[f"{side}_engine_updates"]["details"]["updates"] == [None, 0, 1]
        # Rollout k was generated from the weights pushed after rollout k-1 (None: the initial sync).
        versions = [{s["weight_version"] for s in torch.load(run_dir / side / "rollout_data" / f"{k}.pt")["samples"]}
                    for k in (0, 1)]
        assert versions == [{"None"}, {"0"}]

    # The engines generated rollout 1 from exactly the trained weights: a fresh engine loaded with the
    # weights the target dumped before rollout 1's step reproduces its samples, token for token, and
    # the initial weights do not.
    rollout_1 = torch.load(run_dir / "target" / "rollout_data" / "1.pt")
    engine = CpuEngine(ServerConfig(model_path=str(run_dir / "target" / "engines" / "model")))
    samples = rollout_1["samples"][:6]

    def regenerate(leaf: str) -> list[list[int]]:
        engine.load_weights(to_hf(_dumped_weights(run_dir / "target" / "dumps" / "fwd_bwd" / leaf), "tiny_dense"), "x")
        out = []
        for s in samples:
            prompt = s["tokens"][:len(s["tokens"]) - s["response_length"]]
            params = SamplingParams(temperature=rollout_1["metadata"]["engine_temperature"],
                                    top_p=rollout_1["metadata"]["engine_top_p"], max_new_tokens=s["response_length"],
                                    ignore_eos=True, sampling_seed=_seed(rollout_1, s["index"]))
            out.append(engine.generate(prompt, params, return_logprob=False)["output_ids"])
        return out

    expected = [s["tokens"][len(s["tokens"]) - s["response_length"]:] for s in samples]
    assert regenerate("rollout_1") == expected
    assert regenerate("rollout_0") != expected


def _seed(rollout: dict, index: int) -> int:
    """The sample's sampling seed, from the settings the rollout file records."""
    meta = {k: v for k, v in rollout["metadata"].items() if k in RolloutConfig.__dataclass_fields__}
    return sampling_seed(RolloutConfig(**{**meta, "backend": RolloutBackend(meta["backend"])}), rollout["rollout_id"],
                         index)


def _target_again(run_dir: Path, tmp_path: Path, mode: str, scenario: str, control: str):
    """Re-train phase_b's target of a copy of ``run_dir`` with a planted bug; its verdict."""
    copy = tmp_path / control
    shutil.copytree(run_dir, copy)
    result = run_ftexp(f"mode={mode}", f"scenario={scenario}", *SMALL, *SHORT, *TWO_ENGINES,
                       "stage=target", "phase=phase_b", f"run_dir={copy}", f"trainer.negative_control={control}",
                       cwd=tmp_path, timeout=900)
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    return report_checks(copy)["training"]["summary"]


def test_with_failure_trains_on_the_baseline_rollouts_after_the_heal(runs, tmp_path):
    mode = "dp2_cp2_real_rollout_dense"
    run_dir, result = run_named(runs, "wf", f"mode={mode}", "scenario=with_failure", *SMALL, *SHORT, *TWO_ENGINES)
    checks = assert_passed(run_dir, result)
    assert [r["healed_cell_indices"] for r in checks["phase_b/target_reconfigures"]["details"]["actual"]] == [[], [1]]
    # At the heal (rollout 3) the target generated live, matched the baseline's rollout and trained on it.
    ratios = checks["phase_b/rollout_injection"]["details"]["match_ratios"]
    assert list(ratios) == ["3"] and ratios["3"] > 0.99, ratios
    assert (torch.load(run_dir / "target" / "phase_b" / "rollout_data" / "3.pt")
            == torch.load(run_dir / "baseline" / "phase_b" / "rollout_data" / "3.pt"))

    # After the heal, one engine is left out of the weight-update group: it keeps an older policy.
    failure = _target_again(run_dir, tmp_path, mode, "with_failure", "stale_engine_after_heal")
    assert "inference_engine_weight_checksum_consistency" in failure and "engine_1 differs" in failure, failure
    # After the heal, nothing reaches the engines: they agree with each other, not with the trainer.
    failure = _target_again(run_dir, tmp_path, mode, "with_failure", "skip_engine_update_after_heal")
    assert "does not hold the trainer's weights" in failure, failure
    # A broken megatron -> HF conversion (one tensor transposed): the engines generate from another
    # policy, so the match guard refuses the baseline's rollout.
    failure = _target_again(run_dir, tmp_path, mode, "with_failure", "transposed_weight_conversion")
    assert "match ratio" in failure, failure


def test_deterministic_pushes_bitwise_equal_weights_to_the_engines(runs):
    run_dir, result = run_named(runs, "det", "mode=dp2_cp2_real_rollout", "scenario=deterministic", *SMALL, *TWO_ENGINES)
    checks = assert_passed(run_dir, result)
    # phase_b's events include phase_a's, restored from its checkpoint.
    for phase, rollouts in (("phase_a", [0, 1, 2]), ("phase_b", [0, 1, 2, 3, 4, 5, 6])):
        assert checks[f"{phase}/engine_checksums"]["details"]["rollouts"] == rollouts
    # The generated rollouts are bitwise the same on both sides: the same weights, the same seeds.
    for k in range(7):
        phase = "phase_a" if k < 3 else "phase_b"
        assert (torch.load(run_dir / "baseline" / phase / "rollout_data" / f"{k}.pt")
                == torch.load(run_dir / "target" / phase / "rollout_data" / f"{k}.pt"))
