"""What one rollout engine serves: a light module, so an engine's Ray actor takes its config without torch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ServerConfig:
    """What one engine serves.

    ``model_path`` holds the HF ``config.json`` and, optionally, ``model.safetensors`` or its shards (checkpoint
    names); without weights the model starts from a random init seeded by ``init_seed`` and gets its
    weights from the trainer's first update. ``tokenizer_path`` defaults to ``model_path``.
    """

    model_path: str
    tokenizer_path: str | None = None
    weight_version: str = "default"
    init_seed: int = 0
    weight_group_timeout_s: float = 120.0
