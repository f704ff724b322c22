"""Typed errors of ep_comm (docs/design.md §9).

Every failure a user can cause or meet is one of these; nothing in the library uses ``assert`` for
error handling.  ``EPConfigError`` and ``EPInputError`` also derive from ``ValueError`` so engines that
catch ``ValueError`` around their input handling keep working.
"""
from __future__ import annotations

from typing import Iterable, Sequence


class EPError(RuntimeError):
    """Base class of every ep_comm error."""


class EPConfigError(EPError, ValueError):
    """An ``EPConfig`` field (or the group it is used with, an ``$EP_COMM_*`` environment variable:
    ``field`` starting with ``$``, or another setting named in words: ``field`` with a space, such as
    ``"env MASTER_ADDR"``) is invalid; the message names it."""

    def __init__(self, field: str, value: object, why: str):
        self.field = field
        self.value = value
        named = field.startswith("$") or " " in field
        super().__init__(f"{field if named else 'EPConfig.' + field}={value!r}: {why}")


class EPInputError(EPError, ValueError):
    """A tensor passed to dispatch/combine is invalid; the message names the argument and value."""


class EPTopologyError(EPError):
    """The ranks cannot be connected the way the chosen backend needs (e.g. cross-host without fabric)."""


class EPTimeoutError(EPError):
    """Peers did not take part in a call: ``missing_ranks`` names every rank that did not arrive within
    ``timeout_s``; ``lost_ranks`` (a subset) those known to be gone: their process exited or was
    killed, or they closed their end of the communicator."""

    def __init__(self, message: str, missing_ranks: Iterable[int] = (), lost_ranks: Iterable[int] = ()):
        self.lost_ranks: Sequence[int] = tuple(sorted(set(lost_ranks)))
        self.missing_ranks: Sequence[int] = tuple(sorted(set(missing_ranks) | set(self.lost_ranks)))
        super().__init__(message)

    def __reduce__(self):  # keep both rank lists when the error crosses a process boundary
        return (type(self), (str(self), self.missing_ranks, self.lost_ranks))


__all__ = ["EPError", "EPConfigError", "EPInputError", "EPTopologyError", "EPTimeoutError"]
