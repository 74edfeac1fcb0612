"""The heal codec and wire protocol: a state crosses a real torchft gloo pair, each storage once."""

import datetime as dt

import torch
import torch.multiprocessing as mp

from ftexp.trainer import transfer
from ftexp.store import LoopbackStore


def _state():
    base = torch.arange(12, dtype=torch.float32)
    large = torch.arange(transfer.DIRECT_BYTES // 4 + 3, dtype=torch.float32)  # travels as its own message
    return {
        "model": {"w": base.view(3, 4), "w_row": base.view(3, 4)[1], "b": torch.ones(5, dtype=torch.float64),
                  "large": large, "large_tail": large[-7:], "large_too": -large},
        "optimizer": [{"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.full((2, 2), 0.5)}}}],
        "empty": torch.empty(0),
        "last_rollout_id": 7,
    }


def _peer(rank, port, out):
    from torchft.process_group import ProcessGroupGloo

    pg = ProcessGroupGloo(timeout=dt.timedelta(seconds=30))
    pg.configure(f"127.0.0.1:{port}/transfer_test", replica_id=str(rank), rank=rank, world_size=2,
                 quorum_id=0)
    if rank == 0:
        sent = transfer.send_state(pg, _state(), dst_rank=1)
        torch.save({"sent": sent}, f"{out}/sent.pt")
    else:
        state, received = transfer.recv_state(pg, src_rank=0)
        torch.save({"state": state, "received": received}, f"{out}/received.pt")


def test_state_crosses_a_gloo_pair_with_views_and_dedup(tmp_path):
    store = LoopbackStore()
    mp.spawn(_peer, args=(store.port, str(tmp_path)), nprocs=2)
    got = torch.load(tmp_path / "received.pt", weights_only=False)
    sent = torch.load(tmp_path / "sent.pt")["sent"]
    state, want = got["state"], _state()
    assert got["received"] == sent
    torch.testing.assert_close(state["model"], want["model"])
    torch.testing.assert_close(state["optimizer"], want["optimizer"])
    assert state["last_rollout_id"] == 7 and state["empty"].numel() == 0
    assert state["model"]["w_row"].untyped_storage().data_ptr() == state["model"]["w"].untyped_storage().data_ptr()
    meta, _ = transfer.encode(want)
    assert state["model"]["large_tail"].untyped_storage().data_ptr() == state["model"]["large"].untyped_storage().data_ptr()
    # w and w_row share one storage, sent once: 12 floats + 5 doubles + step + 4 floats; large and
    # large_tail too, next to large_too.
    assert sent == len(meta) + 12 * 4 + 5 * 8 + 4 + 4 * 4 + 2 * 4 * (transfer.DIRECT_BYTES // 4 + 3)
