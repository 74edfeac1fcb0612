"""Grade-school math word problems: ``task=gsm_symbolic`` (generated) and ``task=gsm8k`` (a local file).

Both are graded the standard GSM8K way: the final answer of a response is the number after its last
``####`` marker, or else the last number in it (commas dropped, a trailing period ignored), and it
must equal the reference as a number. The warm-up teaches the worked solution, which ends in
``#### <answer>``.

* ``gsm_symbolic``: reasoning-gym's GSM8K-style generator (100 templates, numbers drawn per
  problem), nothing downloaded.
* ``gsm8k``: GSM8K as the user has it on disk — a ``.jsonl`` or ``.parquet`` file of
  ``question`` / ``answer`` records whose answer ends in ``#### <number>`` (``task.data_path``, and
  optionally the test file ``task.eval_path``; without it the eval set is a held-out split of the
  data file). A missing or malformed file is bad input, named with its line.
"""

from __future__ import annotations

import json
import re
from decimal import Decimal, InvalidOperation
from pathlib import Path

import reasoning_gym

from ftexp.errors import InputError, one_line
from ftexp.tasks.base import Problem, metric_key
from ftexp.tasks.generated import POOL, GeneratedTask
from ftexp.tasks.splits import EVAL, TRAIN, WARMUP, rng_for, split_of

_MARKER = "####"
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def final_number(text: str) -> str | None:
    """The final answer a response states (see the module docstring); None if it states no number."""
    tail = text.rsplit(_MARKER, 1)[1] if _MARKER in text else text
    numbers = _NUMBER.findall(tail)
    if not numbers:
        return None
    return (numbers[0] if _MARKER in text else numbers[-1]).replace(",", "")


def same_number(a: str | None, b: str) -> bool:
    if a is None:
        return False
    try:
        return Decimal(a) == Decimal(b.replace(",", ""))
    except InvalidOperation:
        return False


def grade(response: str, answer: str) -> float:
    return 1.0 if same_number(final_number(response), answer) else 0.0


class GsmSymbolicTask(GeneratedTask):
    name = "gsm_symbolic"

    def __init__(self, dataset_seed: int, eval_size: int):
        super().__init__(dataset_seed, eval_size)
        self.dataset = reasoning_gym.create_dataset("gsm_symbolic", size=POOL, seed=dataset_seed)

    def item(self, index: int) -> Problem:
        entry = self.dataset[index]
        solution = entry["metadata"]["answer_cot"]
        return Problem(prompt=f"Question: {entry['question']}\nAnswer: ", answer=entry["answer"], solution=solution)

    def reward(self, problem: Problem, response: str) -> float:
        return grade(response, problem.answer)


def read_gsm8k(path: Path) -> list[Problem]:
    """The records of a GSM8K file as problems; InputError (one line) naming what is wrong."""
    if not path.exists():
        raise InputError(f"task.data_path: GSM8K file {path} does not exist")
    if not path.is_file():
        raise InputError(f"task.data_path: {path} is not a file")
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise InputError(f"task.data_path: reading {path} needs pyarrow (pip install pyarrow), "
                             f"or give the data as .jsonl") from None
        try:
            rows = pq.read_table(path, columns=["question", "answer"]).to_pylist()
        except Exception as e:  # pyarrow raises several types for a bad file or a missing column
            raise InputError(f"task.data_path: {path} is not a GSM8K parquet file: {one_line(e)}") from e
    elif path.suffix == ".jsonl":
        rows = []
        for lineno, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except ValueError as e:
                raise InputError(f"{path}:{lineno}: not a JSON line: {one_line(e)}") from e
    else:
        raise InputError(f"task.data_path: {path} must be a .jsonl or .parquet file")
    problems = []
    for lineno, row in enumerate(rows, 1):
        question, answer = (row.get("question"), row.get("answer")) if isinstance(row, dict) else (None, None)
        if not isinstance(question, str) or not isinstance(answer, str) or _MARKER not in answer:
            raise InputError(f"{path}: record {lineno} needs a question and an answer ending in '#### <number>'")
        reference = final_number(answer)
        if reference is None:
            raise InputError(f"{path}: record {lineno}: no number after '{_MARKER}' in its answer")
        problems.append(Problem(prompt=f"Question: {question}\nAnswer: ", answer=reference, solution=answer))
    if not problems:
        raise InputError(f"task.data_path: {path} holds no records")
    return problems


class Gsm8kTask:
    name = "gsm8k"

    def __init__(self, data_path: Path, eval_path: Path | None, dataset_seed: int, eval_size: int):
        self.dataset_seed = dataset_seed
        data = read_gsm8k(data_path)
        by_split: dict[str, list[Problem]] = {EVAL: [], WARMUP: [], TRAIN: []}
        for problem in data:
            by_split[split_of(problem.prompt, dataset_seed)].append(problem)
        if eval_path is not None:  # a separate test file: the data file is all warm-up and training
            by_split[EVAL] = read_gsm8k(eval_path)
            by_split[TRAIN] += [p for p in data if split_of(p.prompt, dataset_seed) == EVAL]
        self.eval = by_split[EVAL][:eval_size]
        self.warmup, self.train = by_split[WARMUP], by_split[TRAIN]
        for split, problems in ((EVAL, self.eval), (WARMUP, self.warmup), (TRAIN, self.train)):
            if not problems:
                raise InputError(f"task gsm8k: {data_path} has too few records for a {split} split")

    @property
    def metric_key(self) -> str:
        return metric_key(self.name)

    def train_problems(self, rollout_id: int, count: int, seed: int) -> list[Problem]:
        rng = rng_for(self.name, self.dataset_seed, "train", seed, rollout_id)
        return [rng.choice(self.train) for _ in range(count)]

    def warmup_problems(self, step: int, count: int, seed: int) -> list[Problem]:
        rng = rng_for(self.name, self.dataset_seed, "warmup", seed, step)
        return [rng.choice(self.warmup) for _ in range(count)]

    def eval_problems(self) -> list[Problem]:
        return self.eval

    def reward(self, problem: Problem, response: str) -> float:
        return grade(response, problem.answer)
