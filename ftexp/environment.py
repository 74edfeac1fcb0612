"""Environment variables set for a while: what the processes started meanwhile inherit.

A child process copies its parent's environment when it starts, so setting a variable around a
start is how ftexp hands a value to one job's processes (a job's token) or to one process of Ray's
(its dashboard's proxy) without leaving it in the caller for whatever it starts later.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator


@contextlib.contextmanager
def environment_set(updates: dict[str, str]) -> Iterator[None]:
    """``updates`` in ``os.environ`` inside the block; afterwards each variable is as it was (unset if it was)."""
    saved = {name: os.environ.get(name) for name in updates}
    os.environ.update(updates)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
