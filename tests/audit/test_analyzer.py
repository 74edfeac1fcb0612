"""The event analyzer's rules on crafted event logs: each passes a sound log and fails a broken one."""

import pytest

from ftexp.audit.analyzer import (EventAnalysisError, IncrementalAnalyzer, analyze, cross_replica_weight_checksum,
                                  inference_engine_weight_checksum_consistency, raise_on_issues, witness)
from ftexp.audit.events import (EventLogger, InferenceEngineWeightChecksumEvent, ProcessIdentity,
                                TrainAdvantageComputationEvent, TrainEngineLocalWeightChecksumEvent,
                                TrainGroupStepEndEvent, WitnessAllocateIdEvent, WitnessSnapshotParamEvent, read_events)

HEAD, TAIL = "pp0_chunk0.local_head", "pp0_chunk0.local_tail"


def actor(cell: int, rank: int = 0) -> ProcessIdentity:
    return ProcessIdentity(component="actor", cell_index=cell, rank_within_cell=rank)


def alloc(rollout_id, attempt, ids, counter_after=None):
    return WitnessAllocateIdEvent(rollout_id=rollout_id, attempt=attempt, counter_after=counter_after or max(ids) + 1,
                                  witness_id_to_sample_index={wid: i for i, wid in enumerate(ids)})


def advantages(rollout_id, attempt, cell, per_sample: dict[int, list[float]], rank=0):
    """per_sample: witness id -> that sample's per-token advantages on this rank."""
    return TrainAdvantageComputationEvent(rollout_id=rollout_id, attempt=attempt, source=actor(cell, rank),
                                          advantages=list(per_sample.values()),
                                          witness_ids=[[wid] * len(a) for wid, a in per_sample.items()])


def snapshots(rollout_id, attempt, cell, nonzero, stale=()):
    return [WitnessSnapshotParamEvent(rollout_id=rollout_id, attempt=attempt, source=actor(cell), instance_id=instance,
                                      nonzero_witness_id_ranges=[(i, i + 1) for i in sorted(nonzero)], stale_id_ranges=list(stale))
            for instance in (HEAD, TAIL)]


def commit(rollout_id, attempt, outcomes):
    return TrainGroupStepEndEvent(rollout_id=rollout_id, attempt=attempt, cell_outcomes=outcomes)


def trained(rollout_id, attempt, ids):
    """Both cells trained ``ids`` with non-zero advantages (split between them)."""
    return [advantages(rollout_id, attempt, cell, {wid: [0.5, -0.5] for wid in ids[cell::2]}) for cell in (0, 1)]


def sound_log():
    """Two cells, two rollouts; rollout 1's attempt 0 was discarded and retried with fresh ids."""
    return [
        alloc(0, 0, [0, 1, 2, 3]), *trained(0, 0, [0, 1, 2, 3]),
        *snapshots(0, 0, 0, {0, 1, 2, 3}), *snapshots(0, 0, 1, {0, 1, 2, 3}),
        commit(0, 0, {0: ["normal"], 1: ["normal"]}),
        alloc(1, 0, [4, 5, 6, 7]), *trained(1, 0, [4, 5, 6, 7]),
        alloc(1, 1, [8, 9, 10, 11]), *trained(1, 1, [8, 9, 10, 11]),
        *snapshots(1, 1, 0, set(range(4)) | {8, 9, 10, 11}), *snapshots(1, 1, 1, set(range(4)) | {8, 9, 10, 11}),
        commit(1, 1, {0: ["normal"], 1: ["normal"]}),
    ]


def replace_snapshots(log, rollout_id, cell, nonzero, attempt=None):
    kept = [e for e in log if not (isinstance(e, WitnessSnapshotParamEvent) and e.rollout_id == rollout_id
                                   and e.source.cell_index == cell)]
    attempt = max(e.attempt for e in log if isinstance(e, WitnessAllocateIdEvent) and e.rollout_id == rollout_id) \
        if attempt is None else attempt
    return kept + snapshots(rollout_id, attempt, cell, nonzero)


def only(issues):
    assert len(issues) >= 1
    assert all(i.rule == "witness" for i in issues)
    return issues


# ---- witness --------------------------------------------------------------------------------------
def test_sound_log_passes():
    assert witness(sound_log()) == []
    assert analyze(sound_log()) == []


def test_lost_sample_is_missing():
    log = replace_snapshots(sound_log(), 1, 1, set(range(4)) | {8, 9, 11})
    issues = only(witness(log))
    assert len(issues) == 2  # both instances of cell 1
    assert issues[0].rollout_id == 1 and "cell 1" in issues[0].description
    assert "missing 1 ids [10]" in issues[0].description and "extra 0 ids" in issues[0].description


def test_discarded_attempt_that_reached_the_weights_is_extra():
    log = replace_snapshots(sound_log(), 1, 0, set(range(12)))
    [head, tail] = only(witness(log))
    assert "extra 4 ids [4, 5, 6, 7]" in head.description and HEAD in head.description and TAIL in tail.description
    with pytest.raises(EventAnalysisError, match=r"\[witness\] rollout 1: cell 0 .*extra 4 ids \[4, 5, 6, 7\]"):
        raise_on_issues(log)


def test_a_retried_step_trained_twice_is_extra_even_when_all_cells_agree():
    log = sound_log()
    for cell in (0, 1):  # both cells stepped attempt 0 and attempt 1: checksums agree, witnesses do not
        log = replace_snapshots(log, 1, cell, set(range(12)))
    assert len(witness(log)) == 4
    assert cross_replica_weight_checksum(log) == []


def test_only_the_latest_attempt_snapshot_of_a_cell_counts():
    log = sound_log() + snapshots(1, 0, 0, {0, 1, 2, 3, 4, 5, 6, 7})  # a stale attempt-0 snapshot
    assert witness(log) == []
    log = sound_log() + snapshots(1, 2, 0, {0, 1, 2, 3, 4, 5, 6, 7})  # a later attempt that is wrong
    assert only(witness(log))


def test_only_the_latest_attempt_allocation_is_expected():
    log = replace_snapshots(sound_log(), 1, 0, set(range(8)), attempt=1)  # attempt 0's ids instead of attempt 1's
    issues = only(witness(log))
    assert "missing 4 ids [8, 9, 10, 11]" in issues[0].description and "extra 4 ids [4, 5, 6, 7]" in issues[0].description


def test_committed_cell_without_snapshot_is_an_issue():
    log = [e for e in sound_log() if not (isinstance(e, WitnessSnapshotParamEvent) and e.rollout_id == 0
                                          and e.source.cell_index == 1)]
    [issue] = only(witness(log))
    assert issue.rollout_id == 0 and "cell 1 committed but logged no witness snapshot" in issue.description


@pytest.mark.parametrize("outcome", ["error", ["discarded_should_retry"], ["normal", "discarded_should_retry"]])
def test_cells_that_did_not_commit_normally_are_skipped(outcome):
    log = [e for e in sound_log() if not (isinstance(e, WitnessSnapshotParamEvent) and e.source.cell_index == 1)]
    log = [commit(e.rollout_id, e.attempt, {0: ["normal"], 1: outcome}) if isinstance(e, TrainGroupStepEndEvent) else e
           for e in log]
    assert witness(log) == []


def test_zero_advantage_samples_are_excused():
    log = sound_log() + [advantages(1, 1, 0, {9: [0.0, 0.0, 0.0]})]
    log = replace_snapshots(replace_snapshots(log, 1, 0, set(range(4)) | {8, 10, 11}), 1, 1, set(range(4)) | {8, 10, 11})
    assert witness(log) == []
    # The excuse lasts: the row stays 0 in later rollouts too.
    log += [alloc(2, 0, [12, 13]), *trained(2, 0, [12, 13]), *snapshots(2, 0, 0, set(range(4)) | {8, 10, 11, 12, 13}),
            *snapshots(2, 0, 1, set(range(4)) | {8, 10, 11, 12, 13}), commit(2, 0, {0: ["normal"], 1: ["normal"]})]
    assert witness(log) == []


def test_zero_advantages_of_an_earlier_attempt_excuse_nothing():
    log = sound_log() + [advantages(1, 0, 0, {9: [0.0, 0.0]})]  # attempt 0 said 9 was zero; attempt 1 did not
    log = replace_snapshots(log, 1, 0, set(range(4)) | {8, 10, 11})
    assert "missing 1 ids [9]" in only(witness(log))[0].description


def test_a_reallocated_id_loses_its_excuse():
    log = [
        alloc(0, 0, [0, 1]), advantages(0, 0, 0, {0: [0.0], 1: [1.0]}),
        *snapshots(0, 0, 0, {1}), commit(0, 0, {0: ["normal"]}),
        alloc(1, 0, [0, 2]), advantages(1, 0, 0, {0: [0.3], 2: [1.0]}),  # slot 0 reused, trained this time
        *snapshots(1, 0, 0, {1, 2}), commit(1, 0, {0: ["normal"]}),
    ]
    assert "missing 1 ids [0]" in only(witness(log))[0].description
    log = log[:-3] + [*snapshots(1, 0, 0, {0, 1, 2}), commit(1, 0, {0: ["normal"]})]
    assert witness(log) == []


def test_an_empty_cp_shard_is_not_a_zero_advantage_sample():
    # Under CP, sample 9's whole response may sit on the other CP rank: this rank logs [] for it.
    base = sound_log() + [advantages(1, 1, 0, {9: []}, rank=1)]
    log = replace_snapshots(base, 1, 0, set(range(4)) | {8, 10, 11})
    assert "missing 1 ids [9]" in only(witness(log))[0].description
    # Zero on the rank that holds its tokens, empty on the other: excused.
    log = replace_snapshots(base + [advantages(1, 1, 0, {9: [0.0, 0.0]}, rank=0)], 1, 0, set(range(4)) | {8, 10, 11})
    log = replace_snapshots(log, 1, 1, set(range(4)) | {8, 10, 11})
    assert witness(log) == []


def test_stale_slots_are_ignored_on_both_sides():
    log = sound_log()
    log = [e for e in log if not (isinstance(e, WitnessSnapshotParamEvent) and e.rollout_id == 1)]
    # Slots 0..3 are stale at rollout 1: their rows were zeroed, or are about to be.
    for cell, nonzero in ((0, {8, 9, 10, 11}), (1, {2, 8, 9, 10, 11})):
        log += snapshots(1, 1, cell, nonzero, stale=[(0, 4)])
    assert witness(log) == []
    log += snapshots(1, 1, 0, {8, 9, 10}, stale=[(0, 4)])
    assert only(witness(log))


def test_a_sample_with_several_witness_ids_is_an_issue():
    event = TrainAdvantageComputationEvent(rollout_id=0, attempt=0, source=actor(0), advantages=[[0.1, 0.2]],
                                           witness_ids=[[0, 1]])
    [issue] = only(witness(sound_log() + [event]))
    assert "several witness ids [0, 1]" in issue.description


def test_without_any_allocation_the_witness_was_off():
    log = [e for e in sound_log() if isinstance(e, TrainGroupStepEndEvent)]
    assert witness(log) == []


def test_the_rule_survives_the_json_round_trip(tmp_path):
    main = EventLogger(tmp_path, ProcessIdentity(component="main"))
    cells = {c: EventLogger(tmp_path, actor(c)) for c in (0, 1)}
    for e in sound_log():
        (cells[e.source.cell_index] if e.source.component == "actor" else main).log(e)
    events = read_events(tmp_path)
    assert len(events) == len(sound_log()) and witness(events) == []
    cells[0].log(snapshots(1, 1, 0, set(range(12)))[0])
    assert only(witness(read_events(tmp_path)))


# ---- cross_replica_weight_checksum ----------------------------------------------------------------
def checksum(cell, rollout_id, attempt, param="a", exp_avg="b"):
    return TrainEngineLocalWeightChecksumEvent(rollout_id=rollout_id, attempt=attempt, source=actor(cell),
                                               state={"param_hashes": {"pp0.w": param},
                                                      "optimizer_hashes": {"w.exp_avg": exp_avg}})


def test_cross_replica_checksums_must_agree_per_rollout_and_attempt():
    assert cross_replica_weight_checksum([checksum(0, 0, 0), checksum(1, 0, 0), checksum(1, 1, 0, "z")]) == []
    [issue] = cross_replica_weight_checksum([checksum(0, 0, 0), checksum(1, 0, 0, exp_avg="c")])
    assert issue.rule == "cross_replica_weight_checksum" and "optimizer_hashes.w.exp_avg" in issue.description


def test_every_rank_of_a_normal_cell_must_log_a_checksum_of_the_commit():
    """Cell 1 committed with two ranks; its rank 1 logged no checksum of the committed attempt (only of the
    discarded one): the rule names it, where comparing the checksums present would find nothing."""
    two_ranks = {0: ["normal", "normal"], 1: ["normal", "normal"]}

    def of(cell, rank, attempt):
        return checksum(cell, 0, attempt).model_copy(update={"source": actor(cell, rank)})
    log = [of(0, 0, 1), of(0, 1, 1), of(1, 0, 1), of(1, 1, 0), commit(0, 1, two_ranks)]
    [issue] = cross_replica_weight_checksum(log)
    assert str(issue) == ("[cross_replica_weight_checksum] rollout 0: attempt 1: cell 1 rank 1 committed but "
                          "logged no weight checksum")
    assert cross_replica_weight_checksum(log[:3] + [of(1, 1, 1), commit(0, 1, two_ranks)]) == []
    # A cell that did not commit normally owes none; a log without any checksum had the audit off.
    assert cross_replica_weight_checksum(log[:3] + [commit(0, 1, {**two_ranks, 1: "error"})]) == []
    assert cross_replica_weight_checksum([commit(0, 1, two_ranks)]) == []


def test_a_checksum_issue_names_the_parts_of_the_state_that_differ():
    """A heal that drops only the RNG generators: the issue says so, whatever the first keys listed are."""
    def with_rng(cell, torch_rng, exp_avg="b"):
        event = checksum(cell, 0, 0, exp_avg=exp_avg)
        return event.model_copy(update={"state": {**event.state, "rng_hashes": {"torch": torch_rng, "python": "p"}}})
    [issue] = cross_replica_weight_checksum([with_rng(0, "t"), with_rng(1, "u")])
    assert "differ in 1 entries (rng_hashes 1)" in issue.description
    [issue] = cross_replica_weight_checksum([with_rng(0, "t"), with_rng(1, "u", exp_avg="c")])
    assert "differ in 2 entries (optimizer_hashes 1, rng_hashes 1)" in issue.description


# ---- the incremental analyzer the driver runs before every rollout --------------------------------
def _write(events_dir, log):
    """Each event into its process's file, as the run's processes write them."""
    for e in log:
        EventLogger(events_dir, e.source).log(e)


def _logs():
    with_checksums = sound_log() + [checksum(0, 0, 0), checksum(1, 0, 0, exp_avg="c"), checksum(0, 1, 1),
                                    checksum(1, 1, 1)]
    return {
        "sound": sound_log(),
        "lost": replace_snapshots(sound_log(), 1, 1, set(range(4)) | {8, 9, 11}),
        "discarded_reached_weights": replace_snapshots(sound_log(), 1, 0, set(range(12))),
        "wrong_attempt_allocation": replace_snapshots(sound_log(), 1, 0, set(range(8)), attempt=1),
        "no_snapshot": [e for e in sound_log() if not (isinstance(e, WitnessSnapshotParamEvent) and e.rollout_id == 0
                                                       and e.source.cell_index == 1)],
        "checksums": with_checksums,
        "no_checksum": [e for e in with_checksums if not (isinstance(e, TrainEngineLocalWeightChecksumEvent)
                                                          and e.rollout_id == 1 and e.source.cell_index == 1)],
    }


@pytest.mark.parametrize("name", list(_logs()))
def test_incremental_analysis_finds_what_the_batch_rules_find(tmp_path, name):
    log = _logs()[name]
    whole = tmp_path / "whole"
    _write(whole, log)
    batch = sorted(str(i) for i in analyze(read_events(whole)))
    assert sorted(str(i) for i in IncrementalAnalyzer(whole).check()) == batch
    # Fed as the driver sees it: a rollout's events before its commit, the log checked after each commit.
    log = sorted(log, key=lambda e: (e.rollout_id, isinstance(e, TrainGroupStepEndEvent)))
    growing, analyzer, found = tmp_path / "growing", None, []
    commits = [i for i, e in enumerate(log) if isinstance(e, TrainGroupStepEndEvent)] + [len(log) - 1]
    start = 0
    for end in commits:
        _write(growing, log[start:end + 1])
        start = end + 1
        analyzer = analyzer or IncrementalAnalyzer(growing)
        found += [str(i) for i in analyzer.check()]
    assert sorted(found) == batch
    assert (name == "sound") == (batch == [])


def test_incremental_analysis_reads_each_line_once_and_waits_for_whole_lines(tmp_path):
    _write(tmp_path, sound_log()[:3])
    analyzer = IncrementalAnalyzer(tmp_path)
    assert analyzer.check() == [] and analyzer.tail.read_new() == []
    main = tmp_path / "main.jsonl"
    line = commit(0, 0, {0: ["normal"], 1: ["normal"]}).model_dump_json()
    with open(main, "a") as f:
        f.write(line[:20])  # a line still being written
    assert analyzer.tail.read_new() == []
    with open(main, "a") as f:
        f.write(line[20:] + "\n")
    assert [type(e) for e in analyzer.tail.read_new()] == [TrainGroupStepEndEvent]


# ---- inference_engine_weight_checksum_consistency ----------------------------------------------------
def engine_update(rollout_id, *engines):
    return InferenceEngineWeightChecksumEvent(rollout_id=rollout_id, engine_checksums=list(engines))


def test_engines_with_the_same_weights_pass(tmp_path):
    same = {"model.norm.weight": "aa", "lm_head.weight": "bb"}
    log = [engine_update(None, same, dict(same)), engine_update(0, same, same, same)]
    assert inference_engine_weight_checksum_consistency(log) == []
    _write(tmp_path, log)
    assert IncrementalAnalyzer(tmp_path).check() == []


def test_an_engine_with_other_weights_is_named(tmp_path):
    """One engine updated from a different cell (or not at all) holds other tensors than engine 0."""
    good = {"model.norm.weight": "aa", "lm_head.weight": "bb"}
    log = [engine_update(3, good, good, {**good, "lm_head.weight": "stale"}), engine_update(4, good, {"x": "1"})]
    issues = inference_engine_weight_checksum_consistency(log)
    assert [(i.rollout_id, i.description.split(" differs")[0]) for i in issues] == [(3, "engine_2"), (4, "engine_1")]
    assert "lm_head.weight" in issues[0].description
    _write(tmp_path, log)
    assert sorted(map(str, IncrementalAnalyzer(tmp_path).check())) == sorted(map(str, issues))
    assert {i.rule for i in analyze(log)} == {"inference_engine_weight_checksum_consistency"}


def test_engines_that_agree_on_stale_weights_differ_from_the_trainer():
    """An update that never reached the engines: they agree with each other, not with the trainer."""
    stale = {"model.norm.weight": "old", "lm_head.weight": "bb"}
    event = InferenceEngineWeightChecksumEvent(rollout_id=2, engine_checksums=[stale, stale],
                                               trainer_checksums={**stale, "model.norm.weight": "new"})
    issues = inference_engine_weight_checksum_consistency([event])
    assert len(issues) == 1 and "does not hold the trainer's weights" in issues[0].description
    assert "model.norm.weight" in issues[0].description
