"""A file written through ftexp.atomic_files is seen whole or not at all."""

import pytest
import torch

from ftexp.atomic_files import torch_save_atomically, write_atomically, write_text_atomically


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "sub" / "report.json"
    write_text_atomically(path, "old")

    def half_then_crash(tmp):
        tmp.write_text("half")
        raise RuntimeError("writer died")

    with pytest.raises(RuntimeError):
        write_atomically(path, half_then_crash)
    assert path.read_text() == "old"
    assert sorted(p.name for p in path.parent.iterdir()) == ["report.json"]


def test_a_new_file_appears_complete_under_its_name_only(tmp_path):
    seen_during_write = []
    path = tmp_path / "rank0.pt"

    def save(tmp):
        torch.save({"w": torch.arange(3)}, tmp)
        seen_during_write.extend(p.name for p in tmp_path.iterdir())

    write_atomically(path, save)
    [temporary] = seen_during_write
    assert temporary.startswith(".rank0.pt.") and temporary.endswith(".tmp")  # no reader's *.pt pattern matches it
    assert torch.equal(torch.load(path)["w"], torch.arange(3))
    torch_save_atomically({"w": torch.ones(2)}, path)
    assert torch.equal(torch.load(path)["w"], torch.ones(2))


def test_equal_objects_save_to_equal_bytes(tmp_path):
    torch_save_atomically({"w": torch.arange(4)}, tmp_path / "a.pt")
    torch_save_atomically({"w": torch.arange(4)}, tmp_path / "b.pt")
    assert (tmp_path / "a.pt").read_bytes() == (tmp_path / "b.pt").read_bytes()
