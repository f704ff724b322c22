"""Is a peer process still there?  Answered from ``/proc`` for processes on this machine.

A rank's ``ProcessIdentity`` is gathered once, when a control plane is created.  Later, when an
exchange with the peers fails, a survivor can tell "rank 3's process is gone" apart from "rank 3 is
slow" without asking rank 3, which may be dead.  The identity carries the machine (Linux boot id and
pid namespace: only when both equal ours does the pid name a process our ``/proc`` shows) and the
process start time (so a reused pid is not mistaken for the peer).  For peers on other machines the
answer is "cannot tell" (None); the caller then falls back to what the transport and the rendezvous
store say.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import socket
from typing import Optional

__all__ = ["ProcessIdentity", "process_gone"]


@functools.lru_cache(maxsize=1)
def _machine_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}/{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:  # no /proc (macOS): the host name, checked with kill(pid, 0) only
        return "host:" + socket.gethostname()


def _proc_stat(pid: int) -> Optional[tuple[str, int]]:
    """(state letter, start time in clock ticks) of ``pid``, or None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            raw = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    except OSError:
        return None
    # the command name (field 2) may contain spaces and parentheses: split after the last ')'
    fields = raw[raw.rindex(")") + 2:].split()
    return fields[0], int(fields[19])


@dataclasses.dataclass(frozen=True)
class ProcessIdentity:
    machine: str
    pid: int
    start: int  # /proc start time in clock ticks; -1 where /proc is missing

    @classmethod
    def current(cls) -> ProcessIdentity:
        pid = os.getpid()
        stat = _proc_stat(pid)
        return cls(_machine_id(), pid, stat[1] if stat else -1)


def process_gone(ident: ProcessIdentity) -> Optional[str]:
    """Why the process ``ident`` is gone, ``""`` while it is alive, None when this machine cannot tell."""
    if ident.machine != _machine_id():
        return None
    if ident.start < 0:
        try:
            os.kill(ident.pid, 0)
        except ProcessLookupError:
            return f"its process {ident.pid} has exited"
        except OSError:
            return None
        return ""
    stat = _proc_stat(ident.pid)
    if stat is None or stat[1] != ident.start:
        return f"its process {ident.pid} has exited"
    if stat[0] in ("Z", "X", "x"):  # killed or exited, not yet reaped by its parent
        return f"its process {ident.pid} has exited or was killed"
    return ""
