"""Which tensors exist, on both sides and in every rollout, apart from their values."""

import shutil

import pytest
import torch

from ftexp.audit.dumps import write_dump
from ftexp.errors import InputError
from ftexp.verify.dumps import compare_dumps
from ftexp.verify.inventory import compare_inventories

LEAVES = ["fwd_bwd/rollout_0", "fwd_bwd/rollout_1"]
PARAMS = {"w": (16, 8), "b": (8,)}


def write_side(root, *, rank, dp, leaves=LEAVES, params=PARAMS, dtype=torch.float32, tp=0):
    for leaf in leaves:
        index = 0
        for prefix in ("weight", "grad"):
            for i, (name, shape) in enumerate(params.items()):
                value = torch.randn(*shape, generator=torch.Generator().manual_seed(i)).to(dtype)
                write_dump(root / leaf, f"{prefix}__{name}", value, step=0, rank=rank, dump_index=index, dp=dp, tp=tp, pp=0)
                index += 1
    return root


@pytest.fixture
def sides(tmp_path):
    return write_side(tmp_path / "baseline", rank=0, dp=0), write_side(tmp_path / "target", rank=3, dp=1)


def dump(root, leaf, name):
    [path] = (root / leaf).glob(f"*___name={name}___*.pt")
    return path


def inventory(sides, **kw):
    return compare_inventories(*sides, LEAVES, **kw)


def test_identical_inventories_pass_across_dp_layouts(sides):
    result = inventory(sides)
    assert result.passed, result.issues
    check = result.to_check("phase_b/tensor_inventory")
    assert check.passed and check.name == "phase_b/tensor_inventory"
    assert check.summary.startswith("2 leaves x 4 tensors on each side")
    assert check.details["tensors_per_leaf"] == {"baseline": {leaf: 4 for leaf in LEAVES},
                                                 "target": {leaf: 4 for leaf in LEAVES}}


def test_a_tensor_added_in_the_target_only_is_named(sides):
    base, target = sides
    shutil.copy(dump(target, LEAVES[1], "grad__w"),
                target / LEAVES[1] / dump(target, LEAVES[1], "grad__w").name.replace("grad__w", "grad__w2"))
    check = inventory(sides).to_check()
    assert not check.passed
    assert check.details["issues"][0] == "fwd_bwd/rollout_1: grad__w2 [pp=0, step=0, tp=0] in target, missing in baseline"
    assert "grad__w2" in check.summary


def test_a_tensor_renamed_in_the_target_is_named(sides):
    base, target = sides
    path = dump(target, LEAVES[0], "weight__b")
    path.rename(path.with_name(path.name.replace("weight__b", "weight__bias")))
    issues = inventory(sides).issues
    assert issues[0] == "fwd_bwd/rollout_0: weight__b [pp=0, step=0, tp=0] in baseline, missing in target"
    assert issues[1] == "fwd_bwd/rollout_0: weight__bias [pp=0, step=0, tp=0] in target, missing in baseline"


def test_a_tensor_missing_from_both_sides_of_one_rollout_fails_here_not_in_the_value_comparison(sides):
    base, target = sides
    for root in sides:
        dump(root, LEAVES[1], "grad__w").unlink()
    assert compare_dumps(base, target, [(".*", "rel <= 0")]).passed  # nothing unmatched to judge
    result = inventory(sides)
    assert not result.passed
    assert result.issues[0] == ("baseline: grad__w [pp=0, step=0, tp=0] in fwd_bwd/rollout_0, "
                                "missing in fwd_bwd/rollout_1")
    assert "baseline fwd_bwd/rollout_1: weight__w [pp=0, step=0, tp=0] has no grad__w" in result.issues


def test_a_parameter_missing_from_every_dump_shows_as_unpaired(sides):
    base, target = sides
    for root in sides:
        for leaf in LEAVES:
            dump(root, leaf, "grad__b").unlink()
    assert compare_dumps(base, target, [(".*", "rel <= 0")]).passed
    issues = inventory(sides).issues
    assert issues and all("weight__b [pp=0, step=0, tp=0] has no grad__b" in i for i in issues)
    assert len(issues) == 4  # 2 sides x 2 leaves


def test_shape_and_dtype_differences_are_named(tmp_path):
    base = write_side(tmp_path / "b", rank=0, dp=0)
    target = write_side(tmp_path / "t", rank=1, dp=1, dtype=torch.bfloat16)
    issues = compare_inventories(base, target, LEAVES).issues
    assert issues[0] == "fwd_bwd/rollout_0: grad__b [pp=0, step=0, tp=0]: baseline float32 [8] vs target bfloat16 [8]"
    shaped = write_side(tmp_path / "s", rank=1, dp=1, params={"w": (16, 8), "b": (9,)})
    issues = compare_inventories(base, shaped, LEAVES).issues
    assert issues[0] == "fwd_bwd/rollout_0: grad__b [pp=0, step=0, tp=0]: baseline float32 [8] vs target float32 [9]"


def test_other_coordinates_do_not_match(tmp_path):
    base = write_side(tmp_path / "b", rank=0, dp=0)
    target = write_side(tmp_path / "t", rank=1, dp=1, tp=1)
    issues = compare_inventories(base, target, LEAVES).issues
    assert issues[0] == "fwd_bwd/rollout_0: grad__b [pp=0, step=0, tp=0] in baseline, missing in target"


def test_leaves_must_be_exactly_the_expected_ones_on_both_sides(sides, tmp_path):
    base, target = sides
    shutil.rmtree(target / LEAVES[1])
    write_side(base, rank=0, dp=0, leaves=["fwd_bwd/rollout_7"])
    issues = inventory(sides).issues
    assert "target: leaf fwd_bwd/rollout_1 missing" in issues
    assert "baseline: unexpected leaf fwd_bwd/rollout_7" in issues
    missing = compare_inventories(tmp_path / "nope", target, LEAVES)
    assert "baseline: leaf fwd_bwd/rollout_0 missing" in missing.issues
    assert not compare_inventories(base, target, []).passed  # nothing expected proves nothing


def test_duplicates_fail_and_witnesses_are_excluded(sides):
    base, target = sides
    write_dump(target / LEAVES[0], "grad__w", torch.zeros(16, 8), step=0, rank=5, dump_index=9, dp=2, tp=0, pp=0)
    assert any("grad__w [pp=0, step=0, tp=0] held by 2 files" in i for i in inventory(sides).issues)
    (target / LEAVES[0] / "step=0___rank=5___dump_index=9___name=grad__w___dp=2___tp=0___pp=0.pt").unlink()
    write_dump(target / LEAVES[0], "witness__head", torch.zeros(3), step=0, rank=0, dump_index=9, dp=1, tp=0, pp=0)
    assert not inventory(sides).passed
    assert inventory(sides, exclude_pattern=".*witness.*").passed


def test_corrupt_dump_is_input_error(sides):
    base, target = sides
    dump(target, LEAVES[0], "grad__w").write_bytes(b"junk")
    with pytest.raises(InputError, match="corrupt"):
        inventory(sides)
