"""Every other alive cell's own dumps, leaf by leaf against the baseline's (``scenarios.cell_dumps``)."""

import torch

from ftexp.audit.dumps import write_dump
from ftexp.config import ThresholdConfig
from ftexp.rundir import SideDir
from ftexp.scenarios.cell_dumps import check_cell_dumps

TH = ThresholdConfig(name="t", dumps=[[".*", "rel <= 0.0085"]], fp32_dumps=[[".*", "rel <= 1e-6"]], metrics=[])


def _tensors(rollout_id: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(rollout_id)
    return {"weight__w": torch.randn(16, 8, generator=g), "grad__w": torch.randn(16, 8, generator=g)}


def _write(leaf, tensors, rank):
    for i, (name, t) in enumerate(tensors.items()):
        write_dump(leaf, name, t, step=0, rank=rank, dump_index=i, pp=0, tp=0, cp=0, ep=0)


def test_each_cell_holds_exactly_its_planned_leaves_and_every_tensor_is_judged(tmp_path):
    baseline, target = tmp_path / "baseline" / "dumps", SideDir(tmp_path / "target")
    for r in range(6):
        _write(baseline / f"fwd_bwd/rollout_{r}", _tensors(r), rank=0)
    # Rollouts 0-4 each commit in a new quorum, 5 in 4's. Cell 1 commits 0, 2 and 4 as a non-first cell (it
    # was the first at 1 and missed 3; at 5 it dumps nothing); its rollout-4 gradient is 1% off.
    for r in (0, 2, 4):
        tensors = _tensors(r) | ({"grad__w": _tensors(r)["grad__w"] * 1.01} if r == 4 else {})
        _write(target.cell_dump_leaf(1, r), tensors, rank=1)
    _write(target.cell_dump_leaf(2, 1), _tensors(1), rank=2)  # cell 2 dumped a rollout it should not have
    committers = {0: [0, 1], 1: [1, 3], 2: [0, 1], 3: [0], 4: [0, 1], 5: [0, 1]}
    checks = {c.name: c for c in check_cell_dumps(baseline, target, committers, [0, 1, 2, 3, 4], 4, TH, features=(),
                                                  label="p/")}
    assert checks["p/cell_dump_leaves/cell1"].passed
    assert checks["p/dumps/cell1"].passed  # 1% passes the bf16-calibrated rule ...
    fp32 = checks["p/dumps_fp32/cell1"]
    assert not fp32.passed and fp32.details["leaves"] == ["fwd_bwd/rollout_0", "fwd_bwd/rollout_2", "fwd_bwd/rollout_4"]
    [record] = fp32.details["not_passed"]  # ... not the fp32 one, and the record names its leaf
    assert (record["name"], record["leaf"]) == ("grad__w", "fwd_bwd/rollout_4")
    assert "first: fwd_bwd/rollout_4: grad__w [cp=0, ep=0, pp=0, step=0, tp=0] failed: " in fp32.summary
    # Cell 2 committed nothing here, so it must have dumped nothing.
    leaves = checks["p/cell_dump_leaves/cell2"]
    assert not leaves.passed and leaves.details == {"expected": [], "actual": ["fwd_bwd/rollout_1"]}
    assert "p/dumps/cell2" not in checks
    # Cell 3 should have dumped rollout 1 and wrote nothing.
    assert checks["p/cell_dump_leaves/cell3"].details == {"expected": ["fwd_bwd/rollout_1"], "actual": []}


def test_a_dump_in_an_unchanged_quorum_is_an_extra_leaf(tmp_path):
    """Rollout 1 commits in rollout 0's quorum: a cell dumping it anyway fails its leaves check, naming the leaf."""
    baseline, target = tmp_path / "baseline" / "dumps", SideDir(tmp_path / "target")
    for r in range(2):
        _write(baseline / f"fwd_bwd/rollout_{r}", _tensors(r), rank=0)
        _write(target.cell_dump_leaf(1, r), _tensors(r), rank=1)
    [leaves, *_] = check_cell_dumps(baseline, target, {0: [0, 1], 1: [0, 1]}, [0], 2, TH, features=(), label="")
    assert not leaves.passed and leaves.details == {"expected": ["fwd_bwd/rollout_0"],
                                                    "actual": ["fwd_bwd/rollout_0", "fwd_bwd/rollout_1"]}
