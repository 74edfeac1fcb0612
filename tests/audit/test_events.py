"""Event types: every class is named after its ``type``, and the witness events round-trip."""

import re
import typing

from ftexp.audit.events import (Event, EventLogger, ProcessIdentity, TrainAdvantageComputationEvent,
                                WitnessSnapshotParamEvent, read_events)


def test_class_names_follow_the_type_discriminator():
    union = typing.get_args(typing.get_args(Event)[0])
    for cls in union:
        type_value = cls.model_fields["type"].default
        snake = re.sub(r"(?<!^)(?=[A-Z])", "_", cls.__name__).lower()
        assert snake == f"{type_value}_event", cls.__name__


def test_witness_events_round_trip(tmp_path):
    logger = EventLogger(tmp_path, ProcessIdentity(component="actor", cell_index=1, rank_within_cell=0))
    with logger.context(rollout_id=3, attempt=1):
        logger.log(WitnessSnapshotParamEvent(rollout_id=3, attempt=1, instance_id="pp0_chunk0.local_head",
                                             nonzero_witness_id_ranges=[(1, 2), (5, 9)], stale_id_ranges=[(8, 10), (0, 1)]))
        logger.log(TrainAdvantageComputationEvent(rollout_id=3, attempt=1, advantages=[[0.0, 0.0], []],
                                                  witness_ids=[[4, 4], []]))
    snapshot, advantages = read_events(tmp_path)
    assert snapshot.nonzero_witness_id_ranges == [(1, 2), (5, 9)] and snapshot.stale_id_ranges == [(8, 10), (0, 1)] and snapshot.source.cell_index == 1
    assert advantages.advantages == [[0.0, 0.0], []] and advantages.witness_ids == [[4, 4], []]
