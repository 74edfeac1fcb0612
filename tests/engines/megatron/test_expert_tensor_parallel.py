"""Expert-TP 2 on CPU+gloo trains exactly like expert-TP 1 from the same weights.

With etp = 2 each expert's weights are split over two ranks, and the alltoall dispatcher moves the
tokens routed to a rank's experts over the expert-TP group with unevenly sized all-gathers and
reduce-scatters, which ``cpu_compat`` pads to even sizes for gloo. A TP2 + EP2 + SP replica with
etp = 1 fixes the initial weights and records loss, reduced grads and updated weights for a few
Adam steps; the etp = 2 replica starts from those weights and must match all three, per step, to
float32 rounding. A planted bug (each rank's piece cut with another rank's size) must be caught by
the same comparison; it changes nothing when the pieces happen to be even, so catching it also
proves the uneven path ran.
"""

import pytest
import torch
from megatron_harness import run_layout

from ftexp.config import ModeConfig

PRESET = "tiny_moe_5layer"
WORLD, STEPS = 4, 2
RTOL, ATOL = 1e-4, 1e-5


def _layout(etp: int) -> ModeConfig:
    return ModeConfig(name=f"tp2_ep2_etp{etp}_sp", num_cells=1, tp=2, ep=2, etp=etp, sequence_parallel=True)


def plant_swapped_split_sizes():
    """The bug, on each rank: the uneven all-gather cuts rank r's piece to the other rank's size."""
    from megatron.core.tensor_parallel import mappings

    from ftexp.engines.megatron.cpu_compat import apply_cpu_patches

    apply_cpu_patches()
    gather = mappings._gather_along_first_dim

    def gather_with_swapped_sizes(input_, group, output_split_sizes=None, use_global_buffer=False):
        swapped = None if output_split_sizes is None else output_split_sizes[::-1]
        return gather(input_, group, swapped, use_global_buffer)

    mappings._gather_along_first_dim = gather_with_swapped_sizes


def _differences(run, ref) -> list[str]:
    """Every loss, grad and weight of `run` that is not `ref`'s to float32 rounding, per step."""
    found = []
    for step in range(STEPS):
        if run.losses[step] != pytest.approx(ref.losses[step], rel=RTOL, abs=ATOL):
            found.append(f"step {step} loss {run.losses[step]} != {ref.losses[step]}")
        for what, got, want in (("grad", run.grads[step], ref.grads[step]),
                                ("weight", run.weights[step], ref.weights[step])):
            assert got.keys() == want.keys()
            found += [f"step {step} {what} {name}" for name in want
                      if not torch.allclose(got[name], want[name], rtol=RTOL, atol=ATOL)]
    return found


@pytest.fixture(scope="module")
def etp1(tmp_path_factory):
    """The etp = 1 run and the path of its initial full weights."""
    out = tmp_path_factory.mktemp("etp1")
    return run_layout(PRESET, _layout(1), world=WORLD, steps=STEPS, out_dir=out), out / "initial.pt"


@pytest.mark.slow
def test_expert_tp2_matches_expert_tp1(etp1, tmp_path):
    ref, initial = etp1
    run = run_layout(PRESET, _layout(2), world=WORLD, steps=STEPS, out_dir=tmp_path, init_state=initial)
    assert any(".experts." in name for name in run.grads[0])
    assert _differences(run, ref) == []


@pytest.mark.slow
def test_a_wrongly_cut_gather_is_caught(etp1, tmp_path):
    ref, initial = etp1
    run = run_layout(PRESET, _layout(2), world=WORLD, steps=STEPS, out_dir=tmp_path, init_state=initial,
                     rank_setup=plant_swapped_split_sizes)
    found = _differences(run, ref)
    assert any("loss" in d for d in found) and any(".experts." in d for d in found), found
