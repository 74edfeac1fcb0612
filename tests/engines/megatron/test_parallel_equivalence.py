"""Megatron TP(+SP) / CP / PP / EP on CPU+gloo train exactly like the unsplit model.

A single-rank run of each preset is the reference: it fixes the initial weights (saved once) and
records loss, reduced grads and updated weights for 3 Adam steps. Each parallel layout starts from
those weights and must match all three, per step, to float32 rounding.
"""

import pytest
import torch
from megatron_harness import run_layout

from ftexp.config import ModeConfig

STEPS = 3
RTOL, ATOL = 1e-4, 1e-5


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """preset -> (single-rank run, path of its initial full weights); computed on first use."""
    runs = {}

    def get(preset):
        if preset not in runs:
            out = tmp_path_factory.mktemp(f"{preset}_reference")
            single = ModeConfig(name="single", num_cells=1)
            runs[preset] = (run_layout(preset, single, world=1, steps=STEPS, out_dir=out), out / "initial.pt")
        return runs[preset]

    return get


def assert_same_training(run, ref):
    assert run.losses == pytest.approx(ref.losses, rel=RTOL, abs=ATOL)
    for step in range(STEPS):
        compared = [("weight", run.weights[step], ref.weights[step])]
        if run.grads:  # not recorded under the distributed optimizer
            compared.append(("grad", run.grads[step], ref.grads[step]))
        for what, got, want in compared:
            assert got.keys() == want.keys()
            for name in want:
                torch.testing.assert_close(
                    got[name], want[name], rtol=RTOL, atol=ATOL, msg=lambda m: f"step {step} {what} {name}: {m}"
                )


DENSE, MOE = "tiny_dense", "tiny_moe_5layer"
LAYOUTS = [  # preset, mode, ranks, distributed optimizer
    pytest.param(DENSE, ModeConfig(name="tp2", num_cells=1, tp=2), 2, False, id="tp2"),
    pytest.param(DENSE, ModeConfig(name="tp2_sp", num_cells=1, tp=2, sequence_parallel=True), 2, False, id="tp2_sp"),
    pytest.param(DENSE, ModeConfig(name="cp2", num_cells=1, cp=2), 2, False, id="cp2"),
    pytest.param(DENSE, ModeConfig(name="pp2_uneven", num_cells=1, pp=2, decoder_first_pipeline_num_layers=3,
                                   decoder_last_pipeline_num_layers=1), 2, False, id="pp2_uneven"),
    # experts split, dense part DP2
    pytest.param(MOE, ModeConfig(name="ep2_moe", num_cells=2, ep=2), 2, False, id="ep2_moe"),
    # DP2 shards the optimizer
    pytest.param(MOE, ModeConfig(name="ep2_moe_distopt", num_cells=2, ep=2), 2, True, id="ep2_moe_distopt"),
    # The spec's multi-axis modes without their DP axis (4 ranks at most on this machine):
    pytest.param(MOE, ModeConfig(name="tp2_cp2_ep2_sp_moe", num_cells=1, tp=2, cp=2, ep=2, sequence_parallel=True),
                 4, False, id="tp2_cp2_ep2_sp_moe"),
    pytest.param(MOE, ModeConfig(name="pp2_cp2_moe", num_cells=1, pp=2, cp=2, decoder_first_pipeline_num_layers=3,
                                 decoder_last_pipeline_num_layers=2), 4, False, id="pp2_cp2_moe"),
]


@pytest.mark.slow
@pytest.mark.parametrize("preset, mode, world, distributed_optimizer", LAYOUTS)
def test_layout_matches_single_rank(preset, mode, world, distributed_optimizer, reference, tmp_path):
    ref, initial = reference(preset)
    run = run_layout(
        preset, mode, world=world, steps=STEPS, out_dir=tmp_path, init_state=initial,
        distributed_optimizer=distributed_optimizer,
    )
    assert_same_training(run, ref)
