"""Checksums of a replica's state, as the local weight checksum events carry them.

The cross-replica rule only asks "are these equal?", so a hash per tensor is enough: every alive
cell must hold bitwise the same parameters and optimizer state after every commit and heal.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch


def tensor_hash(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().cpu().numpy().tobytes()).hexdigest()


def hash_tree(obj: Any, prefix: str, out: dict[str, Any]) -> None:
    """Flatten a nested state (dicts, lists, tensors, scalars) into ``out``: dotted path -> hash or value."""
    if isinstance(obj, dict):
        for k in sorted(obj, key=str):
            hash_tree(obj[k], f"{prefix}.{k}", out)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            hash_tree(v, f"{prefix}[{i}]", out)
    elif torch.is_tensor(obj):
        out[prefix] = tensor_hash(obj)
    elif isinstance(obj, (int, float, str, bool)) or obj is None:
        out[prefix] = obj
    else:
        out[prefix] = hashlib.sha256(repr(obj).encode()).hexdigest()
