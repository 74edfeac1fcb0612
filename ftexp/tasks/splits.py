"""Disjoint splits of a task's problems, and seeded draws from them.

A problem belongs to one split for good, decided by a hash of its prompt and the task's dataset
seed: ``eval`` (3 in 10), ``warmup`` (3 in 10) or ``train`` (4 in 10). Two problems with the same
prompt always share a split, so no eval prompt is ever trained on, even where a generator repeats
itself (a small arithmetic space does). Draws are seeded streams, independent of Python's salted hash.
"""

from __future__ import annotations

import hashlib
import random

EVAL, WARMUP, TRAIN = "eval", "warmup", "train"
SPLITS = (EVAL, WARMUP, TRAIN)


def stream_seed(*parts: object) -> int:
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little")


def split_of(prompt: str, dataset_seed: int) -> str:
    bucket = stream_seed("split", dataset_seed, prompt) % 10
    return EVAL if bucket < 3 else WARMUP if bucket < 6 else TRAIN


def rng_for(*parts: object) -> random.Random:
    return random.Random(stream_seed(*parts))
