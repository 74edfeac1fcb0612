"""Megatron TP(+SP) / CP / PP / EP on CPU+gloo train exactly like the unsplit model.

A single-rank run of each preset is the reference: it fixes the initial weights (saved once) and
records loss, reduced grads and updated weights for 3 Adam steps. Each parallel layout starts from
those weights and must match all three, per step, to float32 rounding.
"""

import pytest

pytest.importorskip("megatron.core", reason="megatron-core==0.16.1 is not installed")

import torch  # noqa: E402
from megatron_harness import run_layout  # noqa: E402

from ftexp.engines.megatron.model import Layout  # noqa: E402

STEPS = 3
RTOL, ATOL = 1e-4, 1e-5


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """preset -> (single-rank run, path of its initial full weights); computed on first use."""
    runs = {}

    def get(preset):
        if preset not in runs:
            out = tmp_path_factory.mktemp(f"{preset}_reference")
            runs[preset] = (run_layout(preset, Layout(), world=1, steps=STEPS, out_dir=out), out / "initial.pt")
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
LAYOUTS = [  # preset, layout, ranks, distributed optimizer
    pytest.param(DENSE, Layout(tp=2), 2, False, id="tp2"),
    pytest.param(DENSE, Layout(tp=2, sequence_parallel=True), 2, False, id="tp2_sp"),
    pytest.param(DENSE, Layout(cp=2), 2, False, id="cp2"),
    pytest.param(DENSE, Layout(pp=2, first_stage_layers=3, last_stage_layers=1), 2, False, id="pp2_uneven"),
    pytest.param(MOE, Layout(ep=2), 2, False, id="ep2_moe"),  # experts split, dense part DP2
    pytest.param(MOE, Layout(ep=2), 2, True, id="ep2_moe_distopt"),  # DP2 shards the optimizer
    # The spec's multi-axis modes without their DP axis (4 ranks at most on this machine):
    pytest.param(MOE, Layout(tp=2, cp=2, ep=2, sequence_parallel=True), 4, False, id="tp2_cp2_ep2_sp_moe"),
    pytest.param(MOE, Layout(pp=2, cp=2, first_stage_layers=3, last_stage_layers=2), 4, False, id="pp2_cp2_moe"),
]


@pytest.mark.slow
@pytest.mark.parametrize("preset, layout, world, distributed_optimizer", LAYOUTS)
def test_layout_matches_single_rank(preset, layout, world, distributed_optimizer, reference, tmp_path):
    ref, initial = reference(preset)
    run = run_layout(
        preset, layout, world=world, steps=STEPS, out_dir=tmp_path, init_state=initial,
        distributed_optimizer=distributed_optimizer,
    )
    assert_same_training(run, ref)
