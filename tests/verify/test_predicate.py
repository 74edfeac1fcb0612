"""The threshold predicate language: grammar, precedence, errors, NaN semantics, no eval."""

import builtins
import math

import pytest

from ftexp.errors import InputError
from ftexp.verify.predicate import And, Comparison, Name, Not, Number, Or, PredicateError, parse_predicate

NAN = math.nan


def ev(text, rel=0.0, max_abs=0.0, mean_abs=0.0, norm_ratio=0.0):
    return parse_predicate(text).evaluate(rel, max_abs, mean_abs, norm_ratio)


def test_precedence_or_binds_looser_than_and():
    p = parse_predicate("rel <= 0.0085 or max_abs <= 1e-3 and mean_abs < 1")
    assert p.tree == Or((
        Comparison("<=", Name("rel"), Number(0.0085)),
        And((Comparison("<=", Name("max_abs"), Number(1e-3)), Comparison("<", Name("mean_abs"), Number(1.0)))),
    ))
    # Behaviourally: with or-first grouping this would be (True) and (5 < 1) = False.
    assert p.evaluate(rel=0.0, max_abs=1.0, mean_abs=5.0, norm_ratio=0.0) is True


def test_parentheses_override_precedence():
    text = "(rel <= 0.0085 or max_abs <= 1e-3) and mean_abs < 1"
    assert isinstance(parse_predicate(text).tree, And)
    assert ev(text, rel=0.0, max_abs=1.0, mean_abs=5.0) is False
    assert ev(text, rel=0.0, max_abs=1.0, mean_abs=0.5) is True


def test_not_binds_tightest_and_nests():
    p = parse_predicate("not rel > 1 and max_abs < 1")
    rel_above_1 = Comparison(">", Name("rel"), Number(1.0))
    assert p.tree == And((Not(rel_above_1), Comparison("<", Name("max_abs"), Number(1.0))))
    assert ev("not not rel <= 1", rel=0.5) is True
    assert ev("not (rel <= 1 or max_abs <= 1)", rel=2, max_abs=2) is True
    assert ev("not (rel <= 1 or max_abs <= 1)", rel=2, max_abs=0) is False


@pytest.mark.parametrize("text, rel, expected", [
    ("0.0085", 0.0085, True),
    ("0.0085", 0.0086, False),
    ("0", 0.0, True),
    ("0", 1e-300, False),
    (".5", 0.5, True),
    ("1e-3", 0.002, False),
    ("  2.5E+1  ", 25.0, True),
])
def test_bare_number_is_rel_at_most(text, rel, expected):
    assert parse_predicate(text).tree == Comparison("<=", Name("rel"), Number(float(text)))
    assert ev(text, rel=rel) is expected


@pytest.mark.parametrize("op, lhs, rhs, expected", [
    ("<=", 1, 1, True), ("<=", 2, 1, False),
    ("<", 1, 1, False), ("<", 0, 1, True),
    (">=", 1, 1, True), (">=", 0, 1, False),
    (">", 2, 1, True), (">", 1, 1, False),
    ("==", 1, 1, True), ("==", 1, 2, False),
    ("!=", 1, 2, True), ("!=", 1, 1, False),
])
def test_comparators(op, lhs, rhs, expected):
    assert ev(f"rel {op} {rhs}", rel=lhs) is expected


def test_operands_can_be_names_or_numbers_on_either_side():
    assert ev("0.1 > rel", rel=0.05) is True
    assert ev("max_abs < mean_abs", max_abs=1, mean_abs=2) is True
    assert ev("-2.5E+4 < rel", rel=-1e3) is True
    assert ev("rel>=-2.5e+4", rel=-3e4) is False
    assert ev("mean_abs<=.5", mean_abs=0.5) is True


def test_text_is_kept():
    assert parse_predicate("rel <= 0.0085").text == "rel <= 0.0085"


@pytest.mark.parametrize("text, where", [
    ("", "empty"),
    ("   ", "empty"),
    ("foo <= 1", "unknown name 'foo'"),
    ("rel <= ", "end of input"),
    ("rel <=", "end of input"),
    ("rel", "comparison operator"),
    ("(rel <= 1", "expected ')'"),
    ("rel <= 1)", "position 8"),
    ("rel <= 1 rel <= 2", "position 9"),
    ("rel <= 1 and", "end of input"),
    ("or rel <= 1", "position 0"),
    ("rel <= 1 <= 2", "position 9"),
    ("rel = 1", "unexpected character '='"),
    ("rel << 1", "position 5"),
    ("rel <= 1e", "malformed number '1e'"),
    ("rel <= 1.5.3", "malformed number"),
    ("rel <= nan", "unknown name 'nan'"),
    ("not", "end of input"),
    ("()", "position 1"),
    ("1 2", "position 2"),
    ("rel <= 0.1; rel", "unexpected character ';'"),
    ("rel <= 0.1\nor x > 1", "unknown name 'x'"),
    ("norm_ration <= 0.015", "unknown name 'norm_ration' (allowed: rel, max_abs, mean_abs, norm_ratio)"),
    ("norm_ratio", "comparison operator"),
    ("__import__('os').system('x')", "unknown name '__import__'"),
    ("rel.__class__", "unexpected character '.'"),
    ("[rel for rel in ()]", "unexpected character '['"),
])
def test_malformed_predicates_raise_one_line_input_error(text, where):
    with pytest.raises(PredicateError) as info:
        parse_predicate(text)
    message = str(info.value)
    assert isinstance(info.value, InputError)
    assert where in message
    assert repr(text) in message
    assert "\n" not in message


def test_non_string_predicate_is_an_input_error():
    with pytest.raises(PredicateError):
        parse_predicate(None)


def test_deep_nesting_is_an_input_error_not_a_recursion_crash():
    with pytest.raises(PredicateError, match="nesting"):
        parse_predicate("(" * 500 + "rel <= 1" + ")" * 500)
    with pytest.raises(PredicateError, match="nesting"):
        parse_predicate("not " * 500 + "rel <= 1")
    assert ev("(" * 20 + "rel <= 1" + ")" * 20, rel=1) is True


def test_never_evals(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("eval/exec/compile must not be used")

    for name in ("eval", "exec", "compile"):
        monkeypatch.setattr(builtins, name, forbidden)
    assert ev("rel <= 0.0085 or not (max_abs > 1e-3)", rel=1.0, max_abs=0.0) is True
    with pytest.raises(PredicateError):
        parse_predicate("__import__('os').system('echo pwned')")


@pytest.mark.parametrize("op", ["<=", "<", ">=", ">", "=="])
@pytest.mark.parametrize("which", ["rel", "max_abs", "mean_abs", "norm_ratio"])
def test_nan_makes_comparisons_false(op, which):
    values = {"rel": 0.0, "max_abs": 0.0, "mean_abs": 0.0, "norm_ratio": 0.0, which: NAN}
    assert parse_predicate(f"{which} {op} 1").evaluate(**values) is False
    assert parse_predicate(f"1 {op} {which}").evaluate(**values) is False


def test_nan_not_equal_is_true_and_not_inverts():
    assert ev("rel != 1", rel=NAN) is True
    assert ev("rel != rel", rel=NAN) is True
    assert ev("rel <= 0.0085 or max_abs <= 1e-3", rel=NAN, max_abs=NAN) is False
    # The documented pitfall: 'not' turns the false comparison into a pass.
    assert ev("not rel > 0.0085", rel=NAN) is True


# The stock rule for expert and QK-norm grads (conf/threshold/with_failure.yaml).
STOCK_FLOOR = "(rel <= 0.0085 and norm_ratio <= 0.015) or max_abs <= 1e-3"


def test_norm_ratio_is_an_operand():
    p = parse_predicate("rel <= 0.0085 and norm_ratio <= 0.015")
    assert p.tree == And((Comparison("<=", Name("rel"), Number(0.0085)),
                          Comparison("<=", Name("norm_ratio"), Number(0.015))))
    assert ev(p.text, rel=4.6e-4, norm_ratio=0.03) is False  # a 3% scale error: rel alone would pass it
    assert ev(p.text, rel=4.6e-4, norm_ratio=0.01) is True
    assert ev("norm_ratio > rel", rel=1e-4, norm_ratio=1e-2) is True


@pytest.mark.parametrize("rel, norm_ratio, max_abs, expected", [
    (1e-11, 1e-7, 0.5, True),     # fp32 noise: the first branch holds
    (4.6e-4, 0.03, 0.5, False),   # a 3% scale error on a real gradient: both branches fail
    (4.6e-4, 0.03, 1e-4, True),   # ... on a near-zero gradient: the max_abs floor (the or branch) passes it
    (0.5, 0.0, 1e-4, True),       # a noisy near-zero gradient: the floor
    (0.5, 0.0, 2e-3, False),
    (1.0, math.inf, 1e-9, True),  # zero baseline, a speck in the target: the floor
    (1.0, math.inf, 1.0, False),
])
def test_the_stock_or_rule_takes_both_branches(rel, norm_ratio, max_abs, expected):
    assert ev(STOCK_FLOOR, rel=rel, norm_ratio=norm_ratio, max_abs=max_abs) is expected


def test_infinite_norm_ratio_fails_at_most_thresholds():
    assert ev("norm_ratio <= 1e300", norm_ratio=math.inf) is False
    assert ev("norm_ratio > 1", norm_ratio=math.inf) is True
