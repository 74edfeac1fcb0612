"""Tensor dumps in the file format of sglang's tensor dumper.

One file per tensor: ``torch.save({"value": tensor, "meta": {...}})`` at
``<leaf>/step=<s>___rank=<r>___dump_index=<i>___name=<n>[___<key>=<value>...].pt``.
The comparator of the miles ecosystem reads this format; we write it with plain torch.

Per training rollout the trainer writes one leaf dir ``dumps/fwd_bwd/rollout_<id>/`` holding
every weight (``weight__<param>``) and gradient (``grad__<param>``) taken after the cross-cell
reduce and before the optimizer step. Files carry the parallel coordinates (``pp``, ``tp``,
``cp``, ``ep``) so that runs with different data-parallel layouts match tensor by tensor; the
keys ``rank``, ``dp``, ``edp``, ``dump_index`` and ``filename`` are ignored when matching.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ftexp.atomic_files import torch_save_atomically
from ftexp.errors import RunDirError, file_error

FIELD_SEP = "___"
# Tensor names may not contain the field separator, '=' or a path separator.
_BAD_NAME = re.compile(r"___|=|/")


def dump_file_name(meta: dict[str, Any]) -> str:
    head = [f"{k}={meta[k]}" for k in ("step", "rank", "dump_index", "name")]
    tail = [f"{k}={v}" for k, v in meta.items() if k not in ("step", "rank", "dump_index", "name")]
    return FIELD_SEP.join(head + tail) + ".pt"


def write_dump(leaf_dir: str | Path, name: str, tensor: torch.Tensor, *, step: int, rank: int,
               dump_index: int, **tags: Any) -> Path:
    """Write one tensor dump; ``tags`` are extra metadata such as pp/tp/cp/ep coordinates."""
    if _BAD_NAME.search(name):
        raise ValueError(f"tensor name {name!r} may not contain '___', '=' or '/'")
    meta = {"step": step, "rank": rank, "dump_index": dump_index, "name": name, **tags}
    path = Path(leaf_dir) / dump_file_name(meta)
    value = tensor.detach().cpu()
    if not _owns_its_storage(value):  # torch saves a view's whole storage (megatron's params live in one buffer)
        value = value.clone()
    torch_save_atomically({"value": value, "meta": meta}, path)  # never half a dump
    return path


def _owns_its_storage(tensor: torch.Tensor) -> bool:
    return (tensor.storage_offset() == 0 and tensor.is_contiguous()
            and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size())


@dataclass(frozen=True)
class DumpFile:
    path: Path
    meta: dict[str, str]  # parsed from the file name; values are strings

    @property
    def name(self) -> str:
        return self.meta["name"]


def parse_dump_file_name(filename: str) -> dict[str, str]:
    """``step=0___rank=1___...___name=x.pt`` -> {"step": "0", "rank": "1", ..., "name": "x"}."""
    if not filename.endswith(".pt"):
        raise ValueError(f"not a dump file: {filename}")
    meta: dict[str, str] = {}
    for field in filename[: -len(".pt")].split(FIELD_SEP):
        key, sep, value = field.partition("=")
        if not sep or not key:
            raise ValueError(f"malformed dump file name {filename!r} (field {field!r})")
        meta[key] = value
    for required in ("step", "rank", "dump_index", "name"):
        if required not in meta:
            raise ValueError(f"dump file name {filename!r} lacks {required!r}")
    return meta


def list_dump_files(leaf_dir: str | Path) -> list[DumpFile]:
    """The dump files directly inside one leaf dir, sorted by file name."""
    leaf = Path(leaf_dir)
    return [DumpFile(p, parse_dump_file_name(p.name)) for p in sorted(leaf.glob("*.pt"))]


def remove_dumps_at(leaf_dir: str | Path, coords: dict[str, int]) -> None:
    """Delete the dumps of one set of parallel coordinates from a leaf (before a rank rewrites it)."""
    if not Path(leaf_dir).is_dir():
        return
    for dump in list_dump_files(leaf_dir):
        if all(dump.meta.get(k) == str(v) for k, v in coords.items()):
            dump.path.unlink()


def load_dump(path: str | Path) -> torch.Tensor:
    """Load one dump's tensor; a missing, unreadable, corrupt or foreign file raises RunDirError (a
    ValueError) whose one line names the file and the cause."""
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises many types for truncated/corrupt files
        raise file_error(path, e, "dump file") from e
    if not isinstance(obj, dict) or not isinstance(obj.get("value"), torch.Tensor):
        raise RunDirError(f"corrupt dump file {path}: not a tensor dump (expected a dict with a 'value' tensor)")
    return obj["value"]
