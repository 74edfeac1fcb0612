"""compare_dumps over real dump trees written with ftexp.audit.dumps.write_dump."""

import json
import math
import re

import pytest
import torch

import ftexp.verify.dumps as dumps
from ftexp.audit.dumps import load_dump, write_dump
from ftexp.errors import InputError
from ftexp.verify.dumps import compare_dumps, leaf_set
from ftexp.verify.predicate import PredicateError, parse_predicate
from ftexp.verify.report import json_safe

RULES = [(".*", "rel <= 0.0085")]
LEAVES = ("fwd_bwd/rollout_0", "fwd_bwd/rollout_1")


def randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def make_tensors():
    return {"weight__w": randn(16, 8, seed=1), "grad__w": randn(16, 8, seed=2), "grad__b": randn(8, seed=3)}


def write_tree(root, tensors_by_leaf, *, rank=0, dp=0):
    """Write one side; the target uses another rank/dp, as a different DP layout would."""
    for leaf, tensors in tensors_by_leaf.items():
        for i, (name, tensor) in enumerate(tensors.items()):
            write_dump(root / leaf, name, tensor, step=0, rank=rank, dump_index=i, dp=dp, tp=0, pp=0)
    return root


@pytest.fixture
def sides(tmp_path):
    """(baseline_root, target_root, tensors): identical trees, different rank/dp tags."""
    tensors = make_tensors()
    base = write_tree(tmp_path / "baseline", {leaf: tensors for leaf in LEAVES})
    target = write_tree(tmp_path / "target", {leaf: tensors for leaf in LEAVES}, rank=4, dp=1)
    return base, target, tensors


def overwrite(root, leaf, name, tensor, *, rank=4, dp=1, dump_index=0, **tags):
    """Replace (or add) one tensor of a tree; file names are keyed by dump_index, so drop old ones."""
    for old in (root / leaf).glob(f"*___name={name}___*"):
        old.unlink()
    write_dump(root / leaf, name, tensor, step=0, rank=rank, dump_index=dump_index, dp=dp, tp=0, pp=0, **tags)


def by_name(result, name, leaf="fwd_bwd/rollout_1"):
    [record] = [r for r in result.records if r.name == name and r.leaf == leaf]
    return record


def test_identical_trees_pass_across_dp_layouts(sides):
    base, target, _ = sides
    result = compare_dumps(base, target, RULES)
    assert result.passed, result.issues
    assert result.leaves == list(LEAVES)
    assert result.counts == {"passed": 6, "failed": 0, "failed-allowed": 0, "skipped": 0, "errored": 0}
    assert all(r.rel == 0.0 for r in result.records)
    assert {r.key["name"] for r in result.records} == {"weight__w", "grad__w", "grad__b"}
    assert "rank" not in result.records[0].key and "dp" not in result.records[0].key


def test_leaf_set(tmp_path, sides):
    base, _, _ = sides
    assert leaf_set(base) == list(LEAVES)
    (base / "notes.txt").write_text("not a dump")
    write_dump(tmp_path / "flat", "x", torch.ones(2), step=0, rank=0, dump_index=0)
    assert leaf_set(tmp_path / "flat") == ["."]
    assert leaf_set(base) == list(LEAVES)


def test_noise_over_and_under_threshold(sides):
    base, target, tensors = sides
    grad = tensors["grad__w"]
    noise = randn(16, 8, seed=9)
    # rel ≈ s²/2 for relative per-element noise of std s: 2% -> ~2e-4 (passes), 30% -> ~4e-2 (fails).
    overwrite(target, "fwd_bwd/rollout_0", "grad__w", grad + 0.02 * grad.std() * noise, dump_index=1)
    overwrite(target, "fwd_bwd/rollout_1", "grad__w", grad + 0.30 * grad.std() * noise, dump_index=1)
    result = compare_dumps(base, target, RULES)
    small, large = by_name(result, "grad__w", "fwd_bwd/rollout_0"), by_name(result, "grad__w")
    assert small.status == "passed" and 1e-5 < small.rel < 1e-3
    assert large.status == "failed" and large.rel > 0.0085 and large.failure
    assert not result.passed
    [issue] = result.issues
    assert "fwd_bwd/rollout_1" in issue and "grad__w" in issue and "rel=" in issue and "rel <= 0.0085" in issue
    assert result.worst(1)[0] is large


def test_bitwise_rule_catches_one_last_bit_flip(sides):
    base, target, tensors = sides
    flipped = tensors["weight__w"].clone()
    flipped[5, 5] = torch.nextafter(flipped[5, 5], torch.tensor(math.inf))
    assert compare_dumps(base, target, [(".*", "rel <= 0")]).passed
    overwrite(target, "fwd_bwd/rollout_1", "weight__w", flipped)
    result = compare_dumps(base, target, [(".*", "rel <= 0")])
    assert by_name(result, "weight__w").status == "failed"
    assert not result.passed
    assert compare_dumps(base, target, RULES).passed  # far below the float threshold


def test_first_full_match_wins(sides):
    base, target, tensors = sides
    overwrite(target, "fwd_bwd/rollout_1", "grad__w", tensors["grad__w"] * 1.5, dump_index=1)
    rules = [("grad__", "rel <= 0"), ("grad__w", "rel <= 1"), ("grad__.*", "rel <= 0"), (".*", "rel <= 1")]
    result = compare_dumps(base, target, rules)
    record = by_name(result, "grad__w")
    assert (record.status, record.rule, record.predicate) == ("passed", "grad__w", "rel <= 1")
    assert by_name(result, "grad__b").rule == "grad__.*"
    # Rules may hold parsed predicates too; the strict grad rule now judges grad__w first.
    strict = compare_dumps(base, target, [("grad__.*", parse_predicate("rel <= 0")), (".*", "1")])
    assert by_name(strict, "grad__w").status == "failed"


def test_missing_tensor_fails_unless_allowed(sides):
    base, target, _ = sides
    for f in (target / "fwd_bwd/rollout_1").glob("*name=grad__b*"):
        f.unlink()
    result = compare_dumps(base, target, RULES)
    record = by_name(result, "grad__b")
    assert (record.status, record.failure, record.message) == ("skipped", True, "only in baseline")
    assert any("grad__b" in i and "only in baseline" in i for i in result.issues)
    allowed = compare_dumps(base, target, RULES, allow_skipped_pattern="grad__.*")
    assert allowed.passed and by_name(allowed, "grad__b").status == "skipped"
    assert not compare_dumps(base, target, RULES, allow_skipped_pattern="grad__").passed  # fullmatch only


def test_extra_target_tensor_fails(sides):
    base, target, _ = sides
    overwrite(target, "fwd_bwd/rollout_0", "grad__extra", torch.ones(3), dump_index=7)
    result = compare_dumps(base, target, RULES)
    assert by_name(result, "grad__extra", "fwd_bwd/rollout_0").message == "only in target"
    assert not result.passed


def test_different_coordinates_do_not_match(sides):
    base, target, tensors = sides
    overwrite(target, "fwd_bwd/rollout_0", "grad__b", tensors["grad__b"], dump_index=2, ep=1)
    result = compare_dumps(base, target, RULES)
    assert sorted(r.message for r in result.records if r.status == "skipped") == ["only in baseline", "only in target"]


def test_missing_and_extra_leaves_fail(sides, tmp_path):
    base, target, tensors = sides
    for f in (target / "fwd_bwd/rollout_1").iterdir():
        f.unlink()
    write_tree(target, {"fwd_bwd/rollout_2": tensors}, rank=4, dp=1)
    result = compare_dumps(base, target, RULES)
    assert result.leaves == ["fwd_bwd/rollout_0"]
    assert result.issues == ["leaf fwd_bwd/rollout_1 missing in target", "leaf fwd_bwd/rollout_2 only in target"]


def test_empty_baseline_fails(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "t").mkdir()
    result = compare_dumps(tmp_path / "b", tmp_path / "t", RULES)
    assert not result.passed and "no dumps" in result.issues[0]


def test_unmatched_tensor_errors(sides):
    base, target, _ = sides
    result = compare_dumps(base, target, [("grad__.*", "rel <= 0.0085")])
    record = by_name(result, "weight__w")
    assert record.status == "errored"
    assert record.message == "no threshold rule matches 'weight__w'; add a catch-all '.*'"
    assert not result.passed and result.counts["errored"] == 2


def test_allow_failed_pattern(sides):
    base, target, tensors = sides
    overwrite(target, "fwd_bwd/rollout_1", "grad__b", -tensors["grad__b"], dump_index=2)
    result = compare_dumps(base, target, RULES, allow_failed_pattern="grad__b|input_ids")
    record = by_name(result, "grad__b")
    assert (record.status, record.failure) == ("failed-allowed", False)
    assert record.rel == pytest.approx(2.0)
    assert result.passed and result.counts["failed-allowed"] == 1
    assert not compare_dumps(base, target, RULES, allow_failed_pattern="grad__w").passed


def test_exclude_pattern_ignores_witness_tensors(sides):
    base, target, _ = sides
    overwrite(target, "fwd_bwd/rollout_0", "witness_ids", torch.arange(4), dump_index=9)
    assert not compare_dumps(base, target, RULES).passed
    result = compare_dumps(base, target, RULES, exclude_pattern=".*witness.*")
    assert result.passed and not any(r.name == "witness_ids" for r in result.records)


def test_duplicate_key_on_one_side_errors(sides):
    base, target, tensors = sides
    write_dump(target / "fwd_bwd/rollout_1", "grad__b", tensors["grad__b"], step=0, rank=5, dump_index=99,
               dp=2, tp=0, pp=0)
    result = compare_dumps(base, target, RULES)
    record = by_name(result, "grad__b")
    assert record.status == "errored" and "2 dumps with the same key in target" in record.message


def test_shape_mismatch_errors_but_leading_ones_squeeze(sides):
    base, target, tensors = sides
    overwrite(base, "fwd_bwd/rollout_0", "grad__b", tensors["grad__b"].reshape(1, 8), rank=0, dp=0, dump_index=2)
    overwrite(target, "fwd_bwd/rollout_1", "grad__b", tensors["grad__b"].reshape(2, 4), dump_index=2)
    result = compare_dumps(base, target, RULES)
    assert by_name(result, "grad__b", "fwd_bwd/rollout_0").status == "passed"
    record = by_name(result, "grad__b")
    assert record.status == "errored" and "shape mismatch" in record.message


def test_nan_in_target_fails(sides):
    base, target, tensors = sides
    poisoned = tensors["grad__w"].clone()
    poisoned[0, 0] = math.nan
    overwrite(target, "fwd_bwd/rollout_1", "grad__w", poisoned, dump_index=1)
    result = compare_dumps(base, target, [(".*", "rel <= 0.0085 or max_abs <= 1e-3")])
    assert by_name(result, "grad__w").status == "failed"
    assert result.worst(1)[0].name == "grad__w"  # NaN ranks worst
    json.dumps(json_safe(result.to_dict()), allow_nan=False)


def test_corrupt_dump_is_input_error(sides):
    base, target, _ = sides
    [victim] = (target / "fwd_bwd/rollout_1").glob("*name=grad__w*")
    victim.write_bytes(b"not a torch file")
    with pytest.raises(InputError, match="grad__w"):
        compare_dumps(base, target, RULES)


def test_foreign_pt_name_is_input_error(sides):
    base, target, _ = sides
    (target / "fwd_bwd/rollout_1" / "random.pt").write_bytes(b"")
    with pytest.raises(InputError, match="random.pt"):
        compare_dumps(base, target, RULES)


def test_missing_roots_are_input_errors(sides, tmp_path):
    base, target, _ = sides
    with pytest.raises(InputError, match="target dump root"):
        compare_dumps(base, tmp_path / "nope", RULES)
    with pytest.raises(InputError, match="baseline dump root"):
        compare_dumps(tmp_path / "nope", target, RULES)
    with pytest.raises(InputError, match="phase_a"):
        compare_dumps(base, target, RULES, phase_subdir="phase_a")
    assert compare_dumps(base, target, RULES, phase_subdir="fwd_bwd").leaves == ["rollout_0", "rollout_1"]


def test_bad_rules_fail_before_reading(tmp_path):
    missing = tmp_path / "does-not-exist"
    with pytest.raises(PredicateError):
        compare_dumps(missing, missing, [(".*", "rel <= 0.0085"), ("grad.*", "rel <=")])
    with pytest.raises(InputError, match="regex"):
        compare_dumps(missing, missing, [("grad__(", "rel <= 0")])
    with pytest.raises(InputError, match="regex"):
        compare_dumps(missing, missing, RULES, allow_failed_pattern="[")
    with pytest.raises(InputError, match="pair"):
        compare_dumps(missing, missing, [".*"])
    with pytest.raises(InputError, match="rank"):
        compare_dumps(missing, missing, RULES, grouping_skip_keys=("dp",))


def test_to_dict_and_check(sides):
    base, target, tensors = sides
    overwrite(target, "fwd_bwd/rollout_1", "grad__w", -tensors["grad__w"], dump_index=1)
    result = compare_dumps(base, target, RULES)
    data = json.loads(json.dumps(result.to_dict()))
    assert data["passed"] is False and data["counts"]["failed"] == 1 and len(data["records"]) == 6
    check = result.to_check("dumps/phase", worst_n=2)
    assert (check.name, check.passed) == ("dumps/phase", False)
    assert [r["name"] for r in check.details["worst"]][0] == "grad__w"
    assert len(check.details["worst"]) == 2 and len(check.details["not_passed"]) == 1


# --- norm_ratio and dead rules -----------------------------------------------------------------


def test_scale_error_fails_the_norm_rule_that_rel_passes(sides):
    base, target, tensors = sides
    overwrite(target, "fwd_bwd/rollout_1", "grad__w", tensors["grad__w"] * 0.97, dump_index=1)
    assert compare_dumps(base, target, RULES).passed  # rel ~4.6e-4: direction unchanged
    result = compare_dumps(base, target, [(".*", "rel <= 0.0085 and norm_ratio <= 0.015")])
    record = by_name(result, "grad__w")
    assert record.status == "failed" and record.norm_ratio == pytest.approx(0.03, rel=1e-5)
    assert record.rel == pytest.approx(0.0009 / 1.9409, rel=1e-3)
    [issue] = result.issues
    assert "grad__w" in issue and "norm_ratio=0.03" in issue and "norm_ratio <= 0.015" in issue
    check = result.to_check("dumps")
    assert check.details["worst_norm_ratio"][0]["name"] == "grad__w"
    assert "grad__w" in check.summary  # the first issue is in the one-line summary


def usage(result):
    return [(u["regex"], u["first_match_of"], u["status"]) for u in result.rules]


def test_every_rule_must_be_the_first_match_of_some_tensor(sides):
    base, target, _ = sides
    result = compare_dumps(base, target, [("grad__.*", "rel <= 0.0085"), (".*", "rel <= 0.0085")])
    assert result.passed, result.issues
    assert usage(result) == [("grad__.*", 4, "live"), (".*", 2, "live")]  # 2 leaves x (2 grads, 1 weight)
    # A typo'd pattern matches nothing: the comparison fails naming the rule, although every tensor passed.
    typo = compare_dumps(base, target, [("grad__.*[.]atn[.].*", "rel <= 0.0085"), (".*", "rel <= 0.0085")])
    assert typo.counts["passed"] == 6 and not typo.passed
    [issue] = typo.issues
    assert issue.startswith("threshold rule #0 'grad__.*[.]atn[.].*' -> 'rel <= 0.0085'") and "dead rule" in issue
    assert usage(typo)[0] == ("grad__.*[.]atn[.].*", 0, "dead")
    assert "dead rule" in typo.to_check("dumps").summary


def test_a_rule_shadowed_by_an_earlier_one_is_dead(sides):
    base, target, _ = sides
    # The catch-all matches everything; "matches" means "is the first rule to match".
    result = compare_dumps(base, target, [(".*", "rel <= 0.0085"), ("grad__.*", "rel <= 0.0085 or max_abs <= 1e-3")])
    assert usage(result) == [(".*", 6, "live"), ("grad__.*", 0, "dead")]
    assert not result.passed and "#1 'grad__.*'" in result.issues[0]


def test_a_rule_for_a_model_feature_is_required_only_on_models_with_it(sides):
    base, target, _ = sides
    rules = [(r"grad__.*\.mlp\.experts\..*", "rel <= 0.0085 or max_abs <= 1e-3", "moe"), (".*", "rel <= 0.0085")]
    dense = compare_dumps(base, target, rules)  # no features: the expert rule cannot apply
    assert dense.passed, dense.issues
    assert usage(dense)[0] == (r"grad__.*\.mlp\.experts\..*", 0, "not applicable")
    assert dense.rules[0]["feature"] == "moe"
    moe = compare_dumps(base, target, rules, model_features={"moe", "qk_norm"})
    assert not moe.passed
    assert "'grad__.*\\\\.mlp\\\\.experts\\\\..*'" in moe.issues[0] and "(for models with moe)" in moe.issues[0]


def test_feature_rules_match_on_models_that_have_the_feature(tmp_path):
    tensors = {"grad__decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight": randn(8, 4, seed=1),
               "grad__decoder.layers.0.self_attention.q_layernorm.weight": randn(4, seed=2) * 1e-4,
               "grad__decoder.layers.0.mlp.router.weight": randn(4, 8, seed=3)}
    base = write_tree(tmp_path / "b", {"fwd_bwd/rollout_0": tensors})
    # A near-zero QK-norm grad 50% off: only the max_abs floor (the 'or' branch) lets it pass.
    noisy = dict(tensors)
    noisy["grad__decoder.layers.0.self_attention.q_layernorm.weight"] = tensors[
        "grad__decoder.layers.0.self_attention.q_layernorm.weight"] * 1.5
    target = write_tree(tmp_path / "t", {"fwd_bwd/rollout_0": noisy}, rank=1, dp=1)
    rules = [(r"grad__.*\.mlp\.experts\..*", "(rel <= 0.0085 and norm_ratio <= 0.015) or max_abs <= 1e-3", "moe"),
             (r"grad__.*\.[qk]_layernorm\..*", "(rel <= 0.0085 and norm_ratio <= 0.015) or max_abs <= 1e-3", "qk_norm"),
             (".*", "rel <= 0.0085 and norm_ratio <= 0.015")]
    result = compare_dumps(base, target, rules, model_features={"moe", "qk_norm"})
    assert result.passed, result.issues
    assert [u["status"] for u in result.rules] == ["live", "live", "live"]
    q = by_name(result, "grad__decoder.layers.0.self_attention.q_layernorm.weight", leaf="fwd_bwd/rollout_0")
    assert q.status == "passed" and q.norm_ratio == pytest.approx(0.5) and q.rule == r"grad__.*\.[qk]_layernorm\..*"


def test_no_dead_rule_issue_without_tensors(tmp_path):
    (tmp_path / "b").mkdir(), (tmp_path / "t").mkdir()
    result = compare_dumps(tmp_path / "b", tmp_path / "t", [("grad__.*", "rel <= 0"), (".*", "rel <= 0")])
    assert len(result.issues) == 1 and "no dumps" in result.issues[0]


@pytest.mark.parametrize("rule, message", [
    (("x", "rel <= 1", "Bad Feature"), "model feature must be a lowercase name"),
    (("x", "rel <= 1", 3), "model feature"),
    (("x", "rel <= 1", "moe", "extra"), "pair or a (regex, predicate, model feature) triple"),
])
def test_bad_rule_features_are_input_errors(tmp_path, rule, message):
    with pytest.raises(InputError, match=re.escape(message)):
        compare_dumps(tmp_path, tmp_path, [rule])


def test_a_verdict_reads_each_dump_file_once_and_a_rewritten_one_again(sides, monkeypatch):
    base, target, tensors = sides
    monkeypatch.setattr(dumps, "_RECENT", dumps._RecentTensors(max_bytes=1 << 20))
    reads = []
    monkeypatch.setattr(dumps, "load_dump", lambda path: reads.append(path) or load_dump(path))
    for _ in range(2):  # as a verdict does: once per rule set
        assert compare_dumps(base, target, RULES).passed
    assert len(reads) == len(set(reads)) == 2 * len(LEAVES) * len(tensors)

    # Rewritten in place (same file, other values): read again, and the verdict sees the new values.
    [victim] = (base / "fwd_bwd/rollout_1").glob("*name=grad__w*")
    payload = torch.load(victim, weights_only=True)
    torch.save({**payload, "value": payload["value"] * 2}, victim)
    result = compare_dumps(base, target, RULES)
    assert not result.passed and by_name(result, "grad__w").status == "failed"
    assert reads.count(victim) == 2


def test_recent_tensors_hold_at_most_their_bytes(sides, monkeypatch):
    base, _, _ = sides
    reads = []
    monkeypatch.setattr(dumps, "load_dump", lambda path: reads.append(path) or load_dump(path))
    files = sorted((base / "fwd_bwd/rollout_0").glob("*.pt"))  # 512, 512 and 32 bytes of float32
    recent = dumps._RecentTensors(max_bytes=600)
    for path in files + files:
        recent.load(path)
    assert recent.held_bytes <= 600
    assert len(reads) > len(files)  # at most one of the two 512-byte tensors is held: the other is read again
