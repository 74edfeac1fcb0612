"""Fast checks of the Megatron engine's pure helpers and the CPU patch layer (no process groups)."""

import megatron.core
import pytest
import torch
from megatron_training import ShardInfo, assemble_full, shard_of

from ftexp.engines.megatron import cpu_compat
from ftexp.engines.megatron.cp_attention import chunk_order, local_positions


@pytest.mark.parametrize("stride", [1, 2])
@pytest.mark.parametrize("dim", [0, 1])
def test_tp_shards_reassemble_to_the_full_tensor(stride, dim):
    full = torch.arange(8 * 12, dtype=torch.float32).reshape(8, 12)
    shards = [(shard_of(full, info), info) for info in (ShardInfo(r, 2, dim, stride) for r in range(2))]
    torch.testing.assert_close(assemble_full(shards), full, rtol=0, atol=0)


def test_strided_shard_holds_interleaved_pieces():
    # SwiGLU fc1 = [gate; up]: TP rank r holds [gate_r; up_r].
    gate, up = torch.zeros(4, 1), torch.ones(4, 1)
    shard = shard_of(torch.cat([gate, up]), ShardInfo(tp_rank=1, tp_size=2, dim=0, stride=2))
    torch.testing.assert_close(shard, torch.tensor([[0.0], [0.0], [1.0], [1.0]]))


def test_cp_chunk_layout_matches_get_batch_on_this_cp_rank():
    assert chunk_order(2) == [0, 3, 1, 2]
    assert local_positions(4, cp_size=2, cp_rank=1).tolist() == [2, 3, 4, 5]
    assert local_positions(4, cp_size=2, cp_rank=0).tolist() == [0, 1, 6, 7]


def test_cuda_type_names_are_retargeted_in_nested_code():
    def check(t):
        def inner():
            return t.type() in ["torch.cuda.HalfTensor", "torch.cuda.BFloat16Tensor"]

        return t.type() == "torch.cuda.FloatTensor", inner()

    check.__code__ = cpu_compat._cpu_type_names(check.__code__)
    assert check(torch.zeros(1)) == (True, False)
    assert check(torch.zeros(1, dtype=torch.bfloat16)) == (False, True)


def test_other_megatron_versions_are_refused(monkeypatch):
    monkeypatch.setattr(cpu_compat, "_applied", False)
    monkeypatch.setattr(megatron.core, "__version__", "0.15.0")
    with pytest.raises(RuntimeError, match="megatron-core==0.16.1"):
        cpu_compat.apply_cpu_patches()
