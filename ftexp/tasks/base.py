"""What a task is: problems with checkable answers, split three ways, and an accuracy metric.

A task hands out ``Problem``s from three disjoint splits — ``warmup`` (the supervised warm-up at the
start of a run), ``train`` (the prompts of the GRPO rollouts) and ``eval`` (the held-out set whose
accuracy is the metric ``eval/<task>``) — and scores a response: ``reward`` is 1.0 for an exactly
right final answer and 0.0 for anything else, so the accuracy is the mean reward of greedy answers.

How the policy reads and writes text is its tokenizer (`policy_tokenizer`, the one place that
chooses it): the presets read and write ASCII, one token per character (``ftexp.rollout.tokenizer``
builds the same mapping for the engines and the router), and a response ends with ``END`` (ASCII
end-of-transmission), the one token at which the engines stop generating; a policy loaded from an
HF checkpoint (``mode.hf_checkpoint``) reads and writes with the checkpoint's ``tokenizer.json``, and
its answers end at the checkpoint's ``eos_token_id``. What the warm-up teaches is the solution, then
the end token.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Protocol, Sequence

from ftexp.config import ModeConfig
from ftexp.errors import InputError

VOCAB_SIZE = 128
UNKNOWN_ID = 0x1A  # ASCII SUB: a character outside ASCII
END = "\x04"       # ASCII EOT: the response is complete
END_ID = ord(END)


def encode(text: str) -> list[int]:
    """ASCII token ids of ``text``: a character's code, SUB for anything outside ASCII."""
    return [ord(c) if ord(c) < VOCAB_SIZE else UNKNOWN_ID for c in text]


def decode(ids: Sequence[int]) -> str:
    return "".join(chr(i) for i in ids)


class PolicyTokenizer(Protocol):
    """Text <-> the policy's token ids, and the token that ends an answer."""

    end_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class AsciiTokenizer:
    """The presets' tokenizer: one token per ASCII character (`encode`, `decode`), answers end at ``END``."""

    end_id = END_ID

    def encode(self, text: str) -> list[int]:
        return encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return decode(ids)


ASCII = AsciiTokenizer()


class CheckpointTokenizer:
    """An HF checkpoint's ``tokenizer.json`` (the ``tokenizers`` library, no special tokens added to the text)."""

    def __init__(self, tokenizer_file: Path, end_id: int):
        from tokenizers import Tokenizer

        try:
            self._tokenizer = Tokenizer.from_file(str(tokenizer_file))
        except Exception as e:  # tokenizers raises a bare Exception for a malformed file
            raise InputError(f"mode.hf_checkpoint: {tokenizer_file} is not a tokenizer.json the tokenizers library "
                             f"reads ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
        self.end_id = end_id

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids))


def policy_tokenizer(mode: ModeConfig) -> PolicyTokenizer:
    """The tokenizer of `mode`'s policy: its HF checkpoint's when it has one, else ASCII."""
    return _checkpoint_tokenizer(mode.hf_checkpoint) if mode.hf_checkpoint else ASCII


@lru_cache(maxsize=4)
def _checkpoint_tokenizer(path: str) -> CheckpointTokenizer:
    from ftexp.engines.megatron.hf_import import open_checkpoint  # torch: only for a checkpoint

    checkpoint = open_checkpoint(path)
    return CheckpointTokenizer(checkpoint.tokenizer_file, checkpoint.eos_token_id)


def response_text(ids: Sequence[int], tokenizer: PolicyTokenizer) -> str:
    """The text of a generated response, up to (not including) its end token."""
    ids = list(ids)
    return tokenizer.decode(ids[:ids.index(tokenizer.end_id)] if tokenizer.end_id in ids else ids)


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


def longest_prompt(problems: Sequence[Problem], tokenizer: PolicyTokenizer) -> int:
    """The most tokens a prompt of `problems` takes."""
    return max((len(tokenizer.encode(p.prompt)) for p in problems), default=0)
