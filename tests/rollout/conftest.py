"""Fixtures of the rollout tests: the tiny model's directory, its weight shapes, in-process engines."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from rollout.tiny_model import write_tiny_qwen3

from ftexp.rollout.engine_process import EngineServer
from ftexp.rollout.processes import OFFLINE_ENV
from ftexp.rollout.server_config import ServerConfig

os.environ.update(OFFLINE_ENV)  # tests load tokenizers and models from local directories only


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    return write_tiny_qwen3(tmp_path_factory.mktemp("tiny_qwen3"))


@pytest.fixture(scope="session")
def weight_shapes(model_dir) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    from ftexp.rollout.server import CpuEngine

    return CpuEngine(ServerConfig(str(model_dir))).weight_shapes()


@pytest.fixture
def start_engine(model_dir):
    """Start in-process engines (uvicorn in a thread of the test process); all shut down after the test."""
    engines = []

    def start(**overrides) -> str:
        engine = EngineServer(ServerConfig(str(model_dir), **overrides))
        engines.append(engine)
        return engine.start()

    yield start
    for engine in engines:
        engine.stop()
