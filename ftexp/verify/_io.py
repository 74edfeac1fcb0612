"""Reading the audit trail for the comparators: an unreadable trail is bad input, not a verdict."""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

from ftexp.audit.events import read_events
from ftexp.errors import InputError

E = TypeVar("E")


def read_typed_events(events_dir: str | Path, event_type: type[E]) -> list[E]:
    """The events of one type under ``events_dir`` in read order; [] if the dir does not exist.

    A corrupt line raises InputError naming the file and line, so that a damaged trail can
    neither pass nor be mistaken for a run that logged nothing.
    """
    try:
        events = read_events(events_dir, strict=True)
    except ValueError as e:
        raise InputError(str(e)) from e
    return [e for e in events if isinstance(e, event_type)]
