"""The loopback TCPStore master: its listening fd has one owner, torch's store server."""

import gc
import os

from ftexp.store import LoopbackStore


def test_dropping_the_wrapper_leaves_the_listening_fd_to_the_store_and_a_file_opened_after_it_intact(tmp_path):
    # A handle on the store may outlive its wrapper (a weight-update group keeps the one it joined on).
    wrapper = LoopbackStore()
    store = wrapper.store
    del wrapper
    gc.collect()
    with open(tmp_path / "events.jsonl", "w") as f:  # takes the lowest free fd: the listening one, were it closed
        del store
        gc.collect()  # its server closes the listening fd: never this file's
        os.fstat(f.fileno())  # EBADF if the fd was closed under the file
        f.write("{}\n")


def test_a_dropped_store_closes_its_listening_fd():
    before = set(os.listdir("/proc/self/fd"))
    wrapper = LoopbackStore()
    opened = set(os.listdir("/proc/self/fd")) - before
    assert opened, "the store listens on an fd of this process"
    del wrapper
    gc.collect()
    assert not opened & set(os.listdir("/proc/self/fd"))
