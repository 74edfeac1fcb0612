"""Recorded rollout batches ("debug rollout data").

A rollout is one batch of GRPO experience: ``rollout_batch_size`` random prompts, each
answered ``n_samples_per_prompt`` times by sampling the policy, every sample scored by the
``deterministic_random`` reward. Rollouts are generated once from the initial policy and saved
as ``<data_dir>/<rollout_id>.pt`` (a ``torch.save`` dict ``{rollout_id, metadata, samples}``,
like miles' ``--save-debug-rollout-data``), so that the baseline and the fault-tolerant runs
train on exactly the same samples and only the training step is compared.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import pickle
import types
from pathlib import Path
from typing import Any

import torch

from ftexp.atomic_files import torch_save_atomically
from ftexp.config import RolloutConfig
from ftexp.engines.torch.model import TinyGPT, token_log_probs
from ftexp.errors import InputError, RunDirError, file_error


def deterministic_random_reward(tokens: list[int], response: list[int]) -> float:
    """miles' ``deterministic_random`` reward: 0.0 or 1.0, a pure function of the sample."""
    # sha256 rather than hash(): Python's string hash is salted per process.
    digest = hashlib.sha256((str(tokens) + str(response)).encode("utf-8")).digest()
    return float(digest[0] % 2)


def _rollout_generator(seed: int, rollout_id: int) -> torch.Generator:
    # Derive the stream from both numbers through a hash so distinct (seed, rollout_id)
    # pairs never share a stream by arithmetic coincidence.
    digest = hashlib.sha256(f"{seed}:{rollout_id}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


@torch.no_grad()
def generate_rollout(model: TinyGPT, rollout_id: int, cfg: RolloutConfig) -> dict[str, Any]:
    """Sample one rollout from ``model``; every sequence of the batch is decoded in lockstep."""
    if cfg.prompt_len + cfg.response_len > model.cfg.max_seq_len:
        raise InputError(f"prompt_len + response_len = {cfg.prompt_len + cfg.response_len} "
                         f"exceeds the model's max_seq_len={model.cfg.max_seq_len}")
    if cfg.temperature <= 0:
        raise InputError(f"temperature must be > 0, got {cfg.temperature}")
    generator = _rollout_generator(cfg.seed, rollout_id)
    prompts = torch.randint(0, model.cfg.vocab_size, (cfg.rollout_batch_size, cfg.prompt_len),
                            generator=generator)
    tokens = prompts.repeat_interleave(cfg.n_samples_per_prompt, dim=0)
    for _ in range(cfg.response_len):
        # No KV cache: re-running the short prefix is cheap at this size and keeps it simple.
        next_logits = model(tokens)[:, -1, :] / cfg.temperature
        next_tokens = torch.multinomial(next_logits.softmax(dim=-1), 1, generator=generator)
        tokens = torch.cat([tokens, next_tokens], dim=1)
    # The recorded log-probs are those of the policy itself (temperature 1), which is what the
    # trainer's importance ratio compares against.
    response_log_probs = token_log_probs(model, tokens)[:, cfg.prompt_len - 1:]

    samples = []
    for index, (seq, log_probs) in enumerate(zip(tokens.tolist(), response_log_probs.tolist())):
        response = seq[cfg.prompt_len:]
        samples.append({
            "group_index": index // cfg.n_samples_per_prompt,
            "index": index,
            "rollout_id": rollout_id,
            "tokens": seq,
            "response_length": cfg.response_len,
            "reward": deterministic_random_reward(seq, response),
            "loss_mask": [1] * cfg.response_len,
            "rollout_log_probs": log_probs,
        })
    return {"rollout_id": rollout_id, "metadata": rollout_metadata(cfg, len(samples)), "samples": samples}


def rollout_metadata(cfg: RolloutConfig, num_samples: int, **extra: Any) -> dict[str, Any]:
    """The settings a rollout was generated with, as plain values (the file loads with weights_only)."""
    settings = {k: v.value if isinstance(v, enum.Enum) else v for k, v in dataclasses.asdict(cfg).items()}
    return {**settings, "num_samples": num_samples, **extra}


def save_rollout(batch: dict[str, Any], path: str | Path) -> None:
    """Write atomically: readers see either no file or the complete one."""
    torch_save_atomically(batch, path)


class _PlainDataUnpickler(pickle.Unpickler):
    """Python's C unpickler that refuses every global: the file holds plain containers and numbers only.

    As safe as ``torch.load(weights_only=True)`` for such a file, and ten times faster (torch's
    weights-only unpickler is pure Python: 30 ms of CPU per default rollout, more than its step).
    """

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"a rollout file holds plain data only, not {module}.{name}")


# What torch.load needs of a pickle module (``load``: the legacy, non-zip format).
_PLAIN_DATA_PICKLE = types.SimpleNamespace(Unpickler=_PlainDataUnpickler, __name__="plain_data_pickle",
                                           load=lambda f, **kw: _PlainDataUnpickler(f, **kw).load())


def load_rollout(path: str | Path, expected_rollout_id: int | None = None) -> dict[str, Any]:
    """Load and validate a rollout file; any problem is an InputError naming the file."""
    path = Path(path)
    if not path.is_file():
        raise RunDirError(f"rollout file not found: {path}")
    try:
        batch = torch.load(path, weights_only=False, pickle_module=_PLAIN_DATA_PICKLE)
    except Exception as exc:  # torch raises several unrelated types for a damaged file
        raise file_error(path, exc, "rollout file") from exc
    problem = _batch_problem(batch, expected_rollout_id)
    if problem:
        raise RunDirError(f"malformed rollout file {path}: {problem}")
    return batch


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _batch_problem(batch: Any, expected_rollout_id: int | None) -> str | None:
    """Describe the first structural problem of a loaded batch, or return None if it is sound."""
    if not isinstance(batch, dict):
        return f"expected a dict, got {type(batch).__name__}"
    missing = {"rollout_id", "metadata", "samples"} - batch.keys()
    if missing:
        return f"missing keys {sorted(missing)}"
    rollout_id, metadata, samples = batch["rollout_id"], batch["metadata"], batch["samples"]
    if not _is_int(rollout_id):
        return f"rollout_id must be an int, got {rollout_id!r}"
    if expected_rollout_id is not None and rollout_id != expected_rollout_id:
        return f"rollout_id is {rollout_id}, expected {expected_rollout_id}"
    if not isinstance(metadata, dict):
        return f"metadata must be a dict, got {type(metadata).__name__}"
    group_size = metadata.get("n_samples_per_prompt")
    if not _is_int(group_size) or group_size < 1:
        return f"metadata.n_samples_per_prompt must be a positive int, got {group_size!r}"
    if not isinstance(samples, list) or not samples:
        return "samples must be a non-empty list"
    if len(samples) % group_size:
        return f"{len(samples)} samples do not form whole groups of {group_size}"
    for position, sample in enumerate(samples):
        problem = _sample_problem(sample, position, rollout_id, group_size)
        if problem:
            return f"sample {position}: {problem}"
    return None


_SAMPLE_KEYS = {"group_index", "index", "rollout_id", "tokens", "response_length", "reward",
                "loss_mask", "rollout_log_probs"}


def _sample_problem(sample: Any, position: int, rollout_id: int, group_size: int) -> str | None:
    if not isinstance(sample, dict):
        return f"expected a dict, got {type(sample).__name__}"
    missing = _SAMPLE_KEYS - sample.keys()
    if missing:
        return f"missing keys {sorted(missing)}"
    # The trainer addresses samples by list position and groups them contiguously.
    if sample["index"] != position:
        return f"index is {sample['index']!r}, expected its position {position}"
    if sample["group_index"] != position // group_size:
        return f"group_index is {sample['group_index']!r}, expected {position // group_size}"
    if sample["rollout_id"] != rollout_id:
        return f"rollout_id is {sample['rollout_id']!r}, expected {rollout_id}"
    tokens, response_length = sample["tokens"], sample["response_length"]
    if not isinstance(tokens, list) or not all(_is_int(t) and t >= 0 for t in tokens):
        return "tokens must be a list of non-negative ints"
    # At least one prompt token: the first token of a sequence is never predicted.
    if not _is_int(response_length) or not 0 <= response_length < len(tokens):
        return f"response_length {response_length!r} does not fit {len(tokens)} tokens"
    if not _is_number(sample["reward"]):
        return f"reward must be a number, got {sample['reward']!r}"
    loss_mask, log_probs = sample["loss_mask"], sample["rollout_log_probs"]
    if not isinstance(loss_mask, list) or not all(m in (0, 1) for m in loss_mask):
        return "loss_mask must be a list of 0/1"
    if not isinstance(log_probs, list) or not all(_is_number(lp) for lp in log_probs):
        return "rollout_log_probs must be a list of numbers"
    if not len(loss_mask) == len(log_probs) == response_length:
        return (f"loss_mask ({len(loss_mask)}) and rollout_log_probs ({len(log_probs)}) "
                f"must both have response_length={response_length} entries")
    return None
