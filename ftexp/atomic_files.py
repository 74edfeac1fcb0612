"""Files a reader sees whole or not at all.

Every file that another process may read while it is being written (dumps, checkpoints, rollouts, the
warm-up state, node rendezvous files, reports) is written to a temporary file beside it and renamed
over it. A rename within one directory is atomic, so a reader sees the old file, no file, or the
complete new one; a writer that dies leaves only a ``.<name>.<random>.tmp`` file that no reader's
pattern matches.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any, Callable

import torch


def write_atomically(path: str | Path, write: Callable[[Path], Any]) -> None:
    """``write(tmp)`` fills a temporary file beside ``path``, which is then renamed over ``path``.

    The temporary name is unique across processes and hosts (a shared run dir may be written from
    several nodes), and it is removed again when ``write`` raises."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_beside(path)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def temporary_beside(path: Path) -> Path:
    """The name a new version of ``path`` is written under before the rename."""
    return path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")


def torch_save_atomically(obj: Any, path: str | Path) -> None:
    """``torch.save(obj, path)``, seen whole or not at all.

    Saved through a file object: given a path, torch names the archive inside after the file, and the
    random temporary name would make equal objects save to different bytes."""
    def save(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            torch.save(obj, f)

    write_atomically(path, save)


def write_text_atomically(path: str | Path, text: str) -> None:
    write_atomically(path, lambda tmp: tmp.write_text(text))
