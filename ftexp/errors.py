"""The exception types the command line turns into one line: bad input (exit 2) and an interrupt (exit 130)."""

from __future__ import annotations

import re
from pathlib import Path


class InputError(Exception):
    """Bad configuration or input (unknown mode, malformed predicate, corrupt dump, ...)."""


class RunDirError(InputError, ValueError):
    """A file of a run dir that cannot be read: missing, corrupt, truncated or not permitted.

    The message is one line naming the file and the cause. It is also a ``ValueError``, so the
    callers that catch the ``ValueError`` of a bad line or a bad dump keep working.
    """

    def __init__(self, message: str) -> None:
        super().__init__(message)


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM stopped the run; ``str()`` is one line: by which signal, during what, what was cleaned up."""


def interrupt_signal(exc: BaseException) -> str:
    """The signal behind a KeyboardInterrupt: the CLI's SIGTERM handler raises ``KeyboardInterrupt("SIGTERM")``."""
    return exc.args[0] if exc.args and str(exc.args[0]).startswith("SIG") else "SIGINT"


def one_line(exc: BaseException, limit: int = 200) -> str:
    """``Type: the line that says what went wrong``; torch's unpickling errors span many lines of advice."""
    text = str(exc)
    detail = re.search(r"WeightsUnpickler error:\s*(\S[^\n]*)", text)
    line = detail.group(1).strip() if detail else next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    if len(line) > limit:
        line = line[: limit - 1] + "…"
    return f"{type(exc).__name__}: {line}" if line else type(exc).__name__


def file_error(path: str | Path, exc: BaseException, what: str = "file") -> RunDirError:
    """One line for a run-dir file that could not be read: missing, not permitted, or corrupt."""
    if isinstance(exc, FileNotFoundError):
        return RunDirError(f"missing {what} {path}")
    if isinstance(exc, OSError):
        return RunDirError(f"cannot read {what} {path}: {exc.strerror or one_line(exc)}")
    return RunDirError(f"corrupt {what} {path}: {one_line(exc)}")
