"""Weight updates over a gloo weight-update group: a sender (this process) and in-process engines."""

from __future__ import annotations

import time

import pytest
import torch
from rollout.tiny_model import PROMPT, random_weights

from ftexp.rollout.client import EngineClient, EngineError, SamplingParams
from ftexp.rollout.processes import free_port
from ftexp.rollout.weight_sync import WeightSender, engine_checksums, tensor_checksums

SAMPLING = SamplingParams(temperature=0.8, max_new_tokens=12, sampling_seed=11)


@pytest.fixture
def sender():
    sender = WeightSender(timeout_s=30)
    yield sender
    sender.close()


def test_distributed_update_reaches_every_engine_exactly(start_engine, weight_shapes, sender):
    urls = [start_engine(), start_engine()]
    before = EngineClient(urls[0]).generate(PROMPT, SAMPLING)
    weights = random_weights(weight_shapes, seed=1)
    assert sum(t.numel() * t.element_size() for t in weights.values()) > 500_000
    sender.connect(urls, "update_group_1")
    started = time.monotonic()
    sender.send(weights, weight_version="rollout_0")
    print(f"weight update of {len(weights)} tensors to 2 engines: {time.monotonic() - started:.3f} s")
    expected = tensor_checksums(weights)
    assert engine_checksums(urls) == [expected, expected]
    after = [EngineClient(url).generate(PROMPT, SAMPLING) for url in urls]
    assert after[0].output_ids == after[1].output_ids != before.output_ids
    assert {a.weight_version for a in after} == {"rollout_0"}
    # A fresh engine given the same weights another way generates the same tokens.
    fresh = EngineClient(start_engine(init_seed=9))
    fresh.update_weights_from_tensor(weights)
    assert fresh.generate(PROMPT, SAMPLING).output_ids == after[0].output_ids


def test_a_reformed_group_replaces_the_old_one(start_engine, weight_shapes, sender):
    urls = [start_engine(), start_engine()]
    sender.connect(urls, "group_a")
    sender.send(random_weights(weight_shapes, seed=1), weight_version="1")
    # The sender changes (a cell crashed or healed): a new sender, a new group name.
    second = WeightSender(timeout_s=30)
    try:
        second.connect(urls, "group_b")
        weights = random_weights(weight_shapes, seed=2)
        second.send(weights, weight_version="2")
        assert engine_checksums(urls) == [tensor_checksums(weights)] * 2
        with pytest.raises(EngineError, match=r"no weight-update group named 'group_a' \(current: 'group_b'\)"):
            EngineClient(urls[0]).update_weights_from_distributed(["model.norm.weight"], ["float32"], [[64]], "group_a")
        second.send(random_weights(weight_shapes, seed=3), weight_version="3")  # the group lives on
        assert EngineClient(urls[1]).get_weight_version() == "3"
    finally:
        second.close()


def test_a_refused_update_loads_nothing_and_names_the_tensor(start_engine, weight_shapes, sender):
    urls = [start_engine(), start_engine()]
    before = engine_checksums(urls)
    weights = random_weights(weight_shapes, seed=4)
    sender.connect(urls, "g")
    with pytest.raises(EngineError, match=r"/update_weights_from_distributed: HTTP 400: unknown weight name 'model.extra'"):
        sender.send({**weights, "model.extra": torch.zeros(3)}, weight_version="bad")
    with pytest.raises(RuntimeError, match="send before connect"):  # a failed send leaves the group
        sender.send(weights, weight_version="bad")
    sender.connect(urls, "g2")
    bad_shape = {**weights, "model.norm.weight": torch.zeros(32)}
    with pytest.raises(EngineError, match=r"weight model.norm.weight: shape \(32,\), the model's is \(64,\)"):
        sender.send(bad_shape, weight_version="bad")
    assert engine_checksums(urls) == before
    assert EngineClient(urls[0]).get_weight_version() == "default"


def test_an_unreachable_engine_fails_connect_at_once_naming_it(start_engine):
    live = start_engine(weight_group_timeout_s=3)  # its half-formed group gives up soon after
    dead = f"http://127.0.0.1:{free_port()}"
    sender = WeightSender(timeout_s=3)
    started = time.monotonic()
    with pytest.raises(EngineError, match=f"POST {dead}/init_weights_update_group: cannot reach the engine"):
        sender.connect([live, dead], "g")
    assert time.monotonic() - started < 2.5  # not the group's timeout
    assert sender.group is None
    # The live engine's stale join ends with its timeout (torch's store client may add a retry
    # backoff of a few seconds); meanwhile a new group request waits for it, then forms as usual.
    patient = WeightSender(timeout_s=30)
    try:
        patient.connect([live], "g2")
        patient.send({"model.norm.weight": torch.ones(64)}, weight_version="after")
        assert EngineClient(live).get_weight_version() == "after"
    finally:
        patient.close()
