"""Checksums: a tensor's hash is the hash of its bytes in row-major order, whatever its layout or dtype."""

import hashlib

import pytest
import torch
import xxhash

from ftexp.audit.checksums import hash_tree, tensor_hash


def row_major_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("tensor", [
    torch.arange(12, dtype=torch.float32).reshape(3, 4),
    torch.arange(12, dtype=torch.float32).reshape(3, 4).t(),  # a transposed view: hashed in its own row-major order
    torch.arange(10, dtype=torch.int64)[2:7],  # a view at an offset into a larger storage
    torch.tensor(2.5),  # 0-dim
    torch.zeros(0),
    torch.arange(5, dtype=torch.bfloat16),  # no numpy dtype of its own
    torch.tensor([True, False, True]),
], ids=["matrix", "transposed", "offset_view", "scalar", "empty", "bfloat16", "bool"])
def test_a_tensor_hashes_as_its_row_major_bytes(tensor):
    data = row_major_bytes(tensor)
    assert tensor_hash(tensor) == xxhash.xxh3_128_hexdigest(data)
    assert tensor_hash(tensor, "sha256") == hashlib.sha256(data).hexdigest()


def test_one_changed_element_or_layout_changes_the_hash():
    base = torch.arange(1 << 16, dtype=torch.float32)
    changed = base.clone()
    changed[-1] += 1  # the last byte counts too: no prefix or sample is hashed
    assert tensor_hash(base) != tensor_hash(changed)
    square = torch.arange(16, dtype=torch.float32).reshape(4, 4)
    assert tensor_hash(square) != tensor_hash(square.t())


def test_hash_tree_names_every_leaf_by_its_path():
    out: dict = {}
    hash_tree({"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.ones(2)}}, "lr": 0.1}, "optimizer", out)
    assert out == {"optimizer.lr": 0.1, "optimizer.state.0.exp_avg": tensor_hash(torch.ones(2)),
                   "optimizer.state.0.step": tensor_hash(torch.tensor(3.0))}
