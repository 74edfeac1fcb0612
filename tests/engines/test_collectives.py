"""The fixed-order fold behind deterministic reductions: its order is exactly the documented one."""

import pytest
import torch

from ftexp.engines.collectives import ascending_fold, tree_fold


def _parts(n: int) -> list[torch.Tensor]:
    # Values whose float32 sum depends on the order of addition.
    values = [1e8, 1.0, -1e8, 1.0, 3.0, 1e-3, -7.5, 0.25]
    return [torch.tensor([values[i]], dtype=torch.float32) for i in range(n)]


def test_power_of_two_folds_as_a_pairwise_tree():
    p = _parts(4)
    assert torch.equal(tree_fold(p), (p[0] + p[1]) + (p[2] + p[3]))
    assert not torch.equal((p[0] + p[1]) + (p[2] + p[3]), ((p[0] + p[1]) + p[2]) + p[3])  # the order shows
    p8 = _parts(8)
    pairs = [p8[i] + p8[i + 1] for i in range(0, 8, 2)]
    assert torch.equal(tree_fold(p8), (pairs[0] + pairs[1]) + (pairs[2] + pairs[3]))


def test_other_sizes_fold_in_ascending_rank_order():
    p = _parts(3)
    assert torch.equal(tree_fold(p), (p[0] + p[1]) + p[2])
    p6 = _parts(6)
    expected = p6[0] + p6[1]
    for t in p6[2:]:
        expected = expected + t
    assert torch.equal(tree_fold(p6), expected)


def test_one_part_is_a_copy_and_none_is_an_error():
    t = torch.tensor([1.5])
    folded = tree_fold([t])
    assert torch.equal(folded, t) and folded is not t
    with pytest.raises(ValueError):
        tree_fold([])


def test_a_cell_fold_after_a_cp_fold_equals_the_baselines_dp_by_cp_fold():
    """Why the baseline's DP×CP group and a cell's CP group + cross-cell group add the same bits."""
    p = _parts(4)  # baseline ranks dp0cp0, dp0cp1, dp1cp0, dp1cp1
    assert torch.equal(tree_fold(p), tree_fold([tree_fold(p[:2]), tree_fold(p[2:])]))


def test_ascending_fold_differs_from_the_tree_only_from_three_parts_on():
    """Why deterministic runs on >= 3 cells: a + b == b + a bitwise, so 2 cells cannot show a wrong order."""
    p2 = _parts(2)
    assert torch.equal(ascending_fold(p2), tree_fold(p2)) and torch.equal(ascending_fold(p2[::-1]), tree_fold(p2))
    p4 = _parts(4)
    assert not torch.equal(ascending_fold(p4), tree_fold(p4))
