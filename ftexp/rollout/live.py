"""Live rollouts: GRPO groups sampled from the current policy by rollout engines, through the router.

A live rollout has the same shape as a recorded one (``ftexp.rollout.recorded``): ``rollout_batch_size``
prompts, each answered ``n_samples_per_prompt`` times, with the sampled tokens' log-probs as the engine
computed them (temperature 1). Without a task, the prompts are random tokens and every sample is scored
by the ``deterministic_random`` reward; with one (``ftexp.tasks``), the prompts are the task's training
problems in the policy's tokens (``tasks.base.PolicyTokenizer``: ASCII, or an HF checkpoint's), a
response ends at the tokenizer's end-of-answer token, and its reward is the task's grade. The
prompts are drawn from (seed, rollout_id) and every sample has its own sampling seed, so a rollout is a
pure function of (weights, seed, rollout_id): whichever engine the router picks for a request, baseline
and target generate the same samples from the same weights.

``evaluate`` answers a task's eval set greedily through the router: its accuracy is ``eval/<task>``.

Injection (``inject``): after a fault the target still generates live, then trains on the baseline's
recorded rollout instead — if the two agree: equal sample counts, identical prompts, and a mean
response-token match ratio strictly above a threshold (a broken weight update drives it toward chance).
"""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from ftexp.config import RolloutConfig
from ftexp.errors import InputError
from ftexp.rollout.client import EngineClient, Generation, SamplingParams
from ftexp.rollout.recorded import deterministic_random_reward, rollout_metadata
from ftexp.tasks.base import PolicyTokenizer, Problem, Task, response_text

# Requests in flight at once: enough to keep every engine busy behind the router.
CONCURRENT_REQUESTS = 16


def _stream_seed(*parts: object) -> int:
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def rollout_prompts(rollout_id: int, cfg: RolloutConfig, vocab_size: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(_stream_seed("prompts", cfg.seed, rollout_id))
    return torch.randint(0, vocab_size, (cfg.rollout_batch_size, cfg.prompt_len), generator=generator).tolist()


def sampling_seed(cfg: RolloutConfig, rollout_id: int, sample_index: int) -> int:
    return _stream_seed("sample", cfg.seed, rollout_id, sample_index) % (2**31 - 1)


def generate_live_rollout(router: EngineClient, rollout_id: int, cfg: RolloutConfig, vocab_size: int,
                          task: Task | None = None, max_response_tokens: int | None = None, *,
                          tokenizer: PolicyTokenizer) -> dict[str, Any]:
    """One rollout through ``router`` (the sglang router, or one engine): a request per sample, several in flight.

    With a ``task``, prompts are its problems in ``tokenizer``'s ids and responses stop at the
    tokenizer's end-of-answer token or after ``max_response_tokens``.
    """
    num_samples = cfg.samples
    problems: list[Problem] = []
    if task is None:
        prompts = rollout_prompts(rollout_id, cfg, vocab_size)
    else:
        problems = task.train_problems(rollout_id, cfg.rollout_batch_size, cfg.seed)
        prompts = [tokenizer.encode(p.prompt) for p in problems]
    prompt_of = [prompts[index // cfg.n_samples_per_prompt] for index in range(num_samples)]

    def sample(index: int) -> Generation:
        params = SamplingParams(temperature=cfg.engine_temperature, top_p=cfg.engine_top_p,
                                max_new_tokens=cfg.response_len if task is None else max_response_tokens,
                                stop_token_ids=() if task is None else (tokenizer.end_id,), ignore_eos=True,
                                sampling_seed=sampling_seed(cfg, rollout_id, index))
        return router.generate(prompt_of[index], params, return_logprob=True)

    with ThreadPoolExecutor(CONCURRENT_REQUESTS) as pool:
        answers = list(pool.map(sample, range(num_samples)))
    samples = []
    for index, answer in enumerate(answers):
        response, log_probs = answer.output_ids, answer.output_token_logprobs or []
        if len(log_probs) != len(response) or not response:
            raise RuntimeError(f"rollout {rollout_id} sample {index}: the engine returned {len(response)} tokens "
                               f"and {len(log_probs)} log-probs")
        tokens = prompt_of[index] + response
        if task is None:
            reward = deterministic_random_reward(tokens, response)
        else:
            reward = task.reward(problems[index // cfg.n_samples_per_prompt], response_text(response, tokenizer))
        samples.append({
            "group_index": index // cfg.n_samples_per_prompt,
            "index": index,
            "rollout_id": rollout_id,
            "tokens": tokens,
            "response_length": len(response),
            "reward": reward,
            "loss_mask": [1] * len(response),
            "rollout_log_probs": log_probs,
            "weight_version": answer.weight_version,
        })
    metadata = rollout_metadata(cfg, len(samples), live=True, task=task.name if task is not None else "none")
    return {"rollout_id": rollout_id, "metadata": metadata, "samples": samples}


def evaluate(router: EngineClient, task: Task, max_response_tokens: int, tokenizer: PolicyTokenizer) -> float:
    """The accuracy of the engines' current policy on ``task``'s eval set, answering greedily."""
    problems = task.eval_problems()
    params = SamplingParams(temperature=0.0, top_k=1, max_new_tokens=max_response_tokens,
                            stop_token_ids=(tokenizer.end_id,), ignore_eos=True)

    def grade(problem: Problem) -> float:
        answer = router.generate(tokenizer.encode(problem.prompt), params, return_logprob=False)
        return task.reward(problem, response_text(answer.output_ids, tokenizer))

    with ThreadPoolExecutor(CONCURRENT_REQUESTS) as pool:
        return sum(pool.map(grade, problems)) / len(problems)


class RolloutMismatchError(RuntimeError):
    """The live generation does not match the rollout that was to be injected in its place."""


def response_match_ratio(generated: list[int], recorded: list[int]) -> float:
    """Positions with the same token over the longer response; 1.0 when both are empty."""
    if not generated and not recorded:
        return 1.0
    return sum(a == b for a, b in zip(generated, recorded)) / max(len(generated), len(recorded))


def check_injection(generated: dict[str, Any], recorded: dict[str, Any], min_match_ratio: float) -> float:
    """The match guard: raise RolloutMismatchError unless ``recorded`` may stand in for ``generated``; the mean ratio."""
    gen, rec = generated["samples"], recorded["samples"]
    if len(gen) != len(rec):
        raise RolloutMismatchError(f"rollout {generated['rollout_id']}: {len(gen)} generated samples, "
                              f"{len(rec)} recorded")
    ratios = []
    for index, (a, b) in enumerate(zip(gen, rec)):
        prompt_a = a["tokens"][:len(a["tokens"]) - a["response_length"]]
        prompt_b = b["tokens"][:len(b["tokens"]) - b["response_length"]]
        if prompt_a != prompt_b:
            raise RolloutMismatchError(f"rollout {generated['rollout_id']} sample {index}: prompts differ")
        ratios.append(response_match_ratio(a["tokens"][len(prompt_a):], b["tokens"][len(prompt_b):]))
    mean = sum(ratios) / len(ratios)
    if not mean > min_match_ratio:
        raise RolloutMismatchError(f"rollout {generated['rollout_id']}: mean response-token match ratio {mean:.3f} "
                              f"is not above {min_match_ratio} (min sample {min(ratios):.3f})")
    return mean


def validate_live(cfg: RolloutConfig, seq_length: int) -> None:
    if cfg.prompt_len + cfg.response_len > seq_length:
        raise InputError(f"trainer.rollout: prompt_len + response_len = {cfg.prompt_len + cfg.response_len} exceeds "
                         f"the model's seq_length {seq_length}")
    if cfg.engine_temperature <= 0:
        raise InputError(f"trainer.rollout.engine_temperature must be > 0, got {cfg.engine_temperature}")
