"""Checksums of a replica's state, as the local weight checksum events carry them.

The cross-replica rule only asks "are these equal?", so a hash per tensor is enough: every alive
cell must hold bitwise the same parameters, optimizer state and RNG generators after every commit
and heal. Equality needs no cryptographic strength, so the default is xxHash's 128-bit XXH3
(about 10x faster than SHA-256 here: 0.38 against 4.2 ms for 8 MB); ``trainer.checksum=sha256`` selects SHA-256.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import xxhash

DEFAULT = "xxh3_128"


def digest(data: bytes | memoryview, algorithm: str = DEFAULT) -> str:
    if algorithm == "xxh3_128":
        return xxhash.xxh3_128_hexdigest(data)
    return hashlib.new(algorithm, data).hexdigest()


def tensor_hash(t: torch.Tensor, algorithm: str = DEFAULT) -> str:
    """The hash of the tensor's bytes, read in place: copying them out first took two thirds of the time."""
    flat = t.detach().contiguous().cpu().reshape(-1)
    return digest(memoryview(flat.view(torch.uint8).numpy()), algorithm)


def hash_tree(obj: Any, prefix: str, out: dict[str, Any], algorithm: str = DEFAULT) -> None:
    """Flatten a nested state (dicts, lists, tensors, scalars) into ``out``: dotted path -> hash or value."""
    if isinstance(obj, dict):
        for k in sorted(obj, key=str):
            hash_tree(obj[k], f"{prefix}.{k}", out, algorithm)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            hash_tree(v, f"{prefix}[{i}]", out, algorithm)
    elif torch.is_tensor(obj):
        out[prefix] = tensor_hash(obj, algorithm)
    elif isinstance(obj, (int, float, str, bool)) or obj is None:
        out[prefix] = obj
    else:
        out[prefix] = digest(repr(obj).encode(), algorithm)


def rng_hashes(state: dict[str, Any], algorithm: str = DEFAULT) -> dict[str, str]:
    """One hash per RNG generator of an ``rng_state()`` dict (torch, python, numpy): name -> hash.

    Python's state is a tuple of ints, numpy's a tuple holding a key array; both hash by their repr
    (numpy's array printed in full, so no element is elided).
    """
    out = {}
    for name, value in sorted(state.items()):
        if torch.is_tensor(value):
            out[name] = tensor_hash(value, algorithm)
        else:
            parts = [v.tobytes() if hasattr(v, "tobytes") else repr(v).encode() for v in value]
            out[name] = digest(b"\0".join(parts), algorithm)
    return out
