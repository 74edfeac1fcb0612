"""Threshold predicates: the tiny language that decides whether one tensor diff is acceptable.

A predicate is a boolean expression over exactly four numbers measured per tensor pair (see
``tensor_diff``): ``rel`` (direction), ``max_abs`` and ``mean_abs`` (absolute size of the
difference) and ``norm_ratio`` (scale: |‖t‖/‖b‖ − 1|). Examples::

    rel <= 0.0085
    rel <= 0.0085 and norm_ratio <= 0.01
    (rel <= 0.0085 and norm_ratio <= 0.01) or max_abs <= 1e-3
    not (mean_abs > 1e-6) and rel < .5
    0.0085                      # a bare number x is shorthand for ``rel <= x``

Grammar (``or`` binds loosest, ``not`` tightest, parentheses group)::

    or_expr    := and_expr ('or' and_expr)*
    and_expr   := not_expr ('and' not_expr)*
    not_expr   := 'not' not_expr | atom
    atom       := '(' or_expr ')' | comparison
    comparison := operand CMP operand           CMP in  <=  <  >=  >  ==  !=
    operand    := 'rel' | 'max_abs' | 'mean_abs' | 'norm_ratio' | NUMBER

The text is tokenized and parsed by hand and never handed to ``eval``: threshold rules come from
config files and command lines, and an expression language with builtins would let them run code.

NaN semantics are IEEE 754: if an operand is NaN, every comparison is false except ``!=``, which is
true. So ``rel <= 0.0085`` fails for a NaN diff, as a threshold should. Beware that ``not``
inverts this: ``not rel > 0.0085`` *passes* a NaN diff; write thresholds in the positive form.
"""

from __future__ import annotations

import contextlib
import operator
import re
from dataclasses import dataclass
from typing import Callable, Union

from ftexp.errors import InputError

NAMES = ("rel", "max_abs", "mean_abs", "norm_ratio")
_KEYWORDS = ("and", "or", "not")
_COMPARATORS: dict[str, Callable[[float, float], bool]] = {
    "<=": operator.le,
    "<": operator.lt,
    ">=": operator.ge,
    ">": operator.gt,
    "==": operator.eq,
    "!=": operator.ne,
}
# Deep enough for any real threshold, shallow enough that a hostile '((((...' cannot exhaust the
# Python stack (a RecursionError would escape as a crash instead of a one-line input error).
_MAX_DEPTH = 64

# Longest operators first so that '<=' is not read as '<' followed by '='.
_CMP_RE = re.compile(r"<=|>=|==|!=|<|>")
_NUMBER_RE = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
_WORD_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class PredicateError(InputError):
    """A predicate that does not parse; the message names the text and the position."""


# --- syntax tree -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Name:
    name: str  # one of NAMES

    def resolve(self, env: dict[str, float]) -> float:
        return env[self.name]

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class Number:
    number: float

    def resolve(self, env: dict[str, float]) -> float:
        return self.number

    def __str__(self) -> str:
        return repr(self.number)


Operand = Union[Name, Number]


@dataclass(frozen=True)
class Comparison:
    op: str
    left: Operand
    right: Operand

    def evaluate(self, env: dict[str, float]) -> bool:
        return _COMPARATORS[self.op](self.left.resolve(env), self.right.resolve(env))

    def __str__(self) -> str:
        return f"{self.left} {self.op} {self.right}"


@dataclass(frozen=True)
class Not:
    operand: "Node"

    def evaluate(self, env: dict[str, float]) -> bool:
        return not self.operand.evaluate(env)

    def __str__(self) -> str:
        return f"not ({self.operand})"


@dataclass(frozen=True)
class And:
    operands: tuple["Node", ...]

    def evaluate(self, env: dict[str, float]) -> bool:
        return all(o.evaluate(env) for o in self.operands)

    def __str__(self) -> str:
        return " and ".join(f"({o})" for o in self.operands)


@dataclass(frozen=True)
class Or:
    operands: tuple["Node", ...]

    def evaluate(self, env: dict[str, float]) -> bool:
        return any(o.evaluate(env) for o in self.operands)

    def __str__(self) -> str:
        return " or ".join(f"({o})" for o in self.operands)


Node = Union[Comparison, Not, And, Or]


@dataclass(frozen=True)
class Predicate:
    """A parsed predicate: the original ``text`` and its syntax ``tree``."""

    text: str
    tree: Node

    def evaluate(self, rel: float, max_abs: float, mean_abs: float, norm_ratio: float) -> bool:
        return self.tree.evaluate({"rel": float(rel), "max_abs": float(max_abs), "mean_abs": float(mean_abs),
                                   "norm_ratio": float(norm_ratio)})

    def __str__(self) -> str:
        return self.text


# --- tokenizer ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Token:
    kind: str  # "number" | "name" | "keyword" | "cmp" | "(" | ")" | "end"
    text: str
    pos: int


def _error(text: str, pos: int, problem: str) -> PredicateError:
    where = "end of input" if pos >= len(text) else f"position {pos}"
    # repr() keeps the message on one line even if the text holds a newline.
    return PredicateError(f"invalid predicate {text!r}: {problem} at {where}")


def _tokenize(text: str) -> list[_Token]:
    tokens: list[_Token] = []
    pos = 0
    while pos < len(text):
        ch = text[pos]
        if ch.isspace():
            pos += 1
            continue
        if ch in "()":
            tokens.append(_Token(ch, ch, pos))
            pos += 1
            continue
        if m := _CMP_RE.match(text, pos):
            tokens.append(_Token("cmp", m.group(), pos))
            pos = m.end()
            continue
        if m := _NUMBER_RE.match(text, pos):
            # '1e' or '1.5.3' must not split into a number and a stray word or number.
            if m.end() < len(text) and (text[m.end()].isalnum() or text[m.end()] in "._"):
                bad = re.match(r"[+-]?[A-Za-z0-9_.]*", text[pos:]).group()
                raise _error(text, pos, f"malformed number {bad!r}")
            tokens.append(_Token("number", m.group(), pos))
            pos = m.end()
            continue
        if m := _WORD_RE.match(text, pos):
            word = m.group()
            if word in _KEYWORDS:
                tokens.append(_Token("keyword", word, pos))
            elif word in NAMES:
                tokens.append(_Token("name", word, pos))
            else:
                raise _error(text, pos, f"unknown name {word!r} (allowed: {', '.join(NAMES)})")
            pos = m.end()
            continue
        raise _error(text, pos, f"unexpected character {ch!r}")
    tokens.append(_Token("end", "", len(text)))
    return tokens


# --- recursive-descent parser ------------------------------------------------------------------


class _Parser:
    def __init__(self, text: str, tokens: list[_Token]):
        self.text = text
        self.tokens = tokens
        self.i = 0
        self.depth = 0

    @property
    def peek(self) -> _Token:
        return self.tokens[self.i]

    def take(self) -> _Token:
        token = self.tokens[self.i]
        self.i += 1
        return token

    def at_keyword(self, word: str) -> bool:
        return self.peek.kind == "keyword" and self.peek.text == word

    def fail(self, problem: str) -> PredicateError:
        if self.peek.kind != "end":
            problem = f"{problem}, found {self.peek.text!r}"
        return _error(self.text, self.peek.pos, problem)

    def parse(self) -> Node:
        tree = self.or_expr()
        if self.peek.kind != "end":
            raise self.fail("expected 'and', 'or' or end of predicate")
        return tree

    def or_expr(self) -> Node:
        operands = [self.and_expr()]
        while self.at_keyword("or"):
            self.take()
            operands.append(self.and_expr())
        return operands[0] if len(operands) == 1 else Or(tuple(operands))

    def and_expr(self) -> Node:
        operands = [self.not_expr()]
        while self.at_keyword("and"):
            self.take()
            operands.append(self.not_expr())
        return operands[0] if len(operands) == 1 else And(tuple(operands))

    def not_expr(self) -> Node:
        if self.at_keyword("not"):
            self.take()
            with self.nested():
                return Not(self.not_expr())
        return self.atom()

    def atom(self) -> Node:
        if self.peek.kind == "(":
            self.take()
            with self.nested():
                inner = self.or_expr()
            if self.peek.kind != ")":
                raise self.fail("expected ')'")
            self.take()
            return inner
        left = self.operand()
        if self.peek.kind != "cmp":
            raise self.fail(f"expected a comparison operator ({' '.join(_COMPARATORS)}) after {left}")
        op = self.take().text
        return Comparison(op, left, self.operand())

    def operand(self) -> Operand:
        token = self.peek
        if token.kind == "name":
            self.take()
            return Name(token.text)
        if token.kind == "number":
            self.take()
            return Number(float(token.text))
        raise self.fail(f"expected a number or one of {', '.join(NAMES)}")

    @contextlib.contextmanager
    def nested(self):
        self.depth += 1
        if self.depth > _MAX_DEPTH:
            raise self.fail(f"nesting deeper than {_MAX_DEPTH}")
        try:
            yield
        finally:
            self.depth -= 1


def parse_predicate(text: str) -> Predicate:
    """Parse ``text``; raises PredicateError (an InputError) on anything malformed."""
    if not isinstance(text, str):
        raise PredicateError(f"invalid predicate {text!r}: expected a string, got {type(text).__name__}")
    tokens = _tokenize(text)
    if tokens[0].kind == "end":
        raise PredicateError(f"invalid predicate {text!r}: empty predicate")
    if len(tokens) == 2 and tokens[0].kind == "number":
        return Predicate(text, Comparison("<=", Name("rel"), Number(float(tokens[0].text))))
    return Predicate(text, _Parser(text, tokens).parse())
