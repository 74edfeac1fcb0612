"""Tensor dumps as written: one tensor per file, the tensor's own bytes only."""

import torch

from ftexp.audit.dumps import load_dump, write_dump


def test_a_view_is_dumped_without_the_rest_of_its_buffer(tmp_path):
    buffer = torch.arange(1_000_000, dtype=torch.float32)  # 4 MB, as a bucket of grads
    for name, view in (("slice", buffer[10:20]), ("strided", buffer[:40].view(4, 10).t())):
        path = write_dump(tmp_path, f"grad__{name}", view, step=0, rank=0, dump_index=0)
        assert path.stat().st_size < 10_000, name
        assert torch.equal(load_dump(path), view)


def test_a_tensor_of_its_own_is_dumped_as_it_is(tmp_path):
    weight = torch.randn(64, 32)
    path = write_dump(tmp_path, "weight__w", weight, step=0, rank=0, dump_index=0)
    assert torch.equal(load_dump(path), weight) and 64 * 32 * 4 < path.stat().st_size < 64 * 32 * 4 + 4096
