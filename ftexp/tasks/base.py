"""What a task is: problems with checkable answers, split three ways, and an accuracy metric.

A task hands out ``Problem``s from three disjoint splits — ``warmup`` (the supervised warm-up at the
start of a run), ``train`` (the prompts of the GRPO rollouts) and ``eval`` (the held-out set whose
accuracy is the metric ``eval/<task>``) — and scores a response: ``reward`` is 1.0 for an exactly
right final answer and 0.0 for anything else, so the accuracy is the mean reward of greedy answers.

The policies read and write ASCII, one token per character (``ftexp.rollout.tokenizer`` builds the
same mapping for the engines and the router). A response ends with ``END`` (ASCII end-of-transmission),
the one token at which the engines stop generating; what the warm-up teaches is ``solution + END``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

VOCAB_SIZE = 128
UNKNOWN_ID = 0x1A  # ASCII SUB: a character outside ASCII
END = "\x04"       # ASCII EOT: the response is complete
END_ID = ord(END)


def encode(text: str) -> list[int]:
    """ASCII token ids of ``text``: a character's code, SUB for anything outside ASCII."""
    return [ord(c) if ord(c) < VOCAB_SIZE else UNKNOWN_ID for c in text]


def decode(ids: Sequence[int]) -> str:
    return "".join(chr(i) for i in ids)


def response_text(ids: Sequence[int]) -> str:
    """The text of a generated response, up to (not including) its END token."""
    text = decode(ids)
    return text.split(END, 1)[0]


@dataclass(frozen=True)
class Problem:
    prompt: str     # what the policy is asked
    answer: str     # the reference final answer
    solution: str   # what the warm-up teaches the policy to answer (the answer alone, or a worked solution)


class Task(Protocol):
    """A source of problems with verifiable answers (see the module docstring)."""

    name: str

    @property
    def metric_key(self) -> str:
        """``eval/<task>``: the eval accuracy's metric name."""

    def train_problems(self, rollout_id: int, count: int, seed: int) -> list[Problem]:
        """The prompts of rollout ``rollout_id``: a pure function of (seed, rollout id)."""

    def warmup_problems(self, step: int, count: int, seed: int) -> list[Problem]:
        """Warm-up step ``step``'s batch: a pure function of (seed, step)."""

    def eval_problems(self) -> list[Problem]:
        """The fixed eval set (the same for every experiment seed, so their accuracies compare)."""

    def reward(self, problem: Problem, response: str) -> float:
        """1.0 if ``response`` (without END) states exactly the right final answer, else 0.0."""


def metric_key(task_name: str) -> str:
    return f"eval/{task_name}"


def longest_prompt(problems: Sequence[Problem]) -> int:
    return max((len(encode(p.prompt)) for p in problems), default=0)
