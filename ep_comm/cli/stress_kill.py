"""``ep-comm stress --kill``: the victim's end (a SIGKILL to itself, leaving a record of when and
where) and the survivors' (raise, shrink every communicator and the results plane, agree on what
happened), and the summary lines.  ``ep_comm.cli.faults`` plans which rank dies when."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import tempfile
import threading
import time
from typing import Optional

from ..distributed.control import ControlPlane
from ..errors import EPError, EPTimeoutError
from . import faults
from .launcher import RankEnv


@dataclasses.dataclass
class KillAnswer:
    """One survivor's side of the kill (picklable: gathered over the survivors after the shrink)."""

    rank: int
    error: str  # the class of what it raised
    message: str
    lost_ranks: list[int]
    where: str  # what this rank was doing when it raised
    raise_s: Optional[float]  # after the kill (the victim's record, same host only), else None
    since_iteration_s: float  # after this rank started the kill's iteration
    shrink_s: float  # every shrink, the results plane's included (waiting for the other survivors)
    problems: list[str]  # active_ranks of a shrunk communicator other than the survivors

    def wrong(self, victim: int) -> list[str]:
        out = list(self.problems)
        if self.error != "EPTimeoutError" or sorted(self.lost_ranks) != [victim]:
            out.append(f"raised {self.error} with lost_ranks {self.lost_ranks}, expected EPTimeoutError with "
                       f"lost_ranks [{victim}]: {self.message[:300]}")
        return out


@dataclasses.dataclass
class KillOutcome:
    """The kill as the survivors saw it, the same on every survivor."""

    kill: faults.Kill
    answers: list[KillAnswer]
    dropped: dict[tuple[str, str], str]  # variants that could not shrink here, with the error
    killed_in: Optional[str]  # what the victim was doing (its record; None when unreadable here)
    variants: int = 0  # variants that went on
    iterations: int = 0  # after the kill
    failing: int = 0
    faults: int = 0

    @property
    def survivors(self) -> list[int]:
        return [a.rank for a in self.answers]

    def wrong(self) -> list[tuple[int, str]]:
        return [(a.rank, p) for a in self.answers for p in a.wrong(self.kill.rank)]


#: what this rank is doing, read by the kill's timer thread when it fires (the summary says where the
#: victim died)
WHERE = ["between calls"]


def at(what: str) -> None:
    WHERE[0] = what


class KillSwitch:
    """The victim's end: SIGKILL to itself after a delay or at once, leaving a record of when and
    where for the survivors on this host (a file named by the results plane's token)."""

    def __init__(self, path: str):
        self.path = path
        # the armed timer and the main thread (once its iteration is done) may fire at the same moment:
        # both writing the one temporary file left a record the survivors could not parse
        self._firing = threading.Lock()

    def arm(self, delay_s: float) -> None:
        timer = threading.Timer(delay_s, self.fire)
        timer.daemon = True
        timer.start()

    def fire(self) -> None:
        self._firing.acquire()  # never released: the first caller kills the process
        record = json.dumps({"time": time.time(), "where": WHERE[0]})
        try:
            with open(self.path + ".tmp", "w") as f:
                f.write(record)
            os.replace(self.path + ".tmp", self.path)
        except OSError:  # the survivors then time from the iteration's start
            pass
        os.kill(os.getpid(), signal.SIGKILL)


def kill_record_path(plane: ControlPlane) -> str:
    return os.path.join(tempfile.gettempdir(), f"ep_comm_stress_kill_{plane.token}.json")


def read_kill_record(path: str) -> Optional[dict]:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def survive_kill(env: RankEnv, args: argparse.Namespace, kill: faults.Kill, exc: EPTimeoutError, t_iter: float,
                  comms: dict, variants: list, plane: ControlPlane) -> tuple[ControlPlane, KillOutcome]:
    """A survivor after the kill's error: shrink the results plane and every communicator (in the same
    order on every survivor: each shrink is collective over them), drop the variants that cannot
    shrink, and agree on what happened."""
    t_raise = time.time()
    where = WHERE[0]
    record_path = kill_record_path(plane)
    lost = [kill.rank]
    new_plane = plane.shrink(lost)
    plane.close(f"shrunk to ranks {new_plane.labels}", because_of=lost)
    survivors = list(new_plane.labels)
    dropped: dict[tuple[str, str], str] = {}
    problems: list[str] = []
    for key in sorted(comms, key=lambda k: (k[0], k[1], k[2] or "")):
        variant = key[:2]
        if variant in dropped:
            comms.pop(key).close("its variant could not shrink")
            continue
        try:
            # the ranks every survivor drops alike (each survivor's own error naming them is checked
            # in KillAnswer); shrink() without them is the engine's path, tested where it is made
            comms[key] = new = comms[key].shrink(lost)
        except EPTimeoutError:
            raise
        except EPError as err:
            # alike on every survivor (the backend refuses after the survivors met): drop the variant
            dropped[variant] = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            comms.pop(key).close("it could not shrink")
            continue
        if list(new.active_ranks) != survivors:
            problems.append(f"{key[0]}/{key[1]}: active_ranks {list(new.active_ranks)} after shrink(), expected "
                            f"{survivors}")
    for key in [k for k in comms if k[:2] in dropped]:
        comms.pop(key).close("its variant could not shrink")
    for variant in dropped:
        variants.remove(variant)
    shrink_s = time.time() - t_raise
    record = read_kill_record(record_path)
    answer = KillAnswer(env.rank, type(exc).__name__, str(exc), sorted(exc.lost_ranks), where,
                        None if record is None else t_raise - float(record["time"]), t_raise - t_iter, shrink_s,
                        problems)
    gathered = new_plane.gather_objects((answer, None if record is None else str(record["where"])))
    if new_plane.me == survivors[0] and record is not None:
        try:
            os.remove(record_path)
        except OSError:
            pass
    lead_dropped = new_plane.gather_objects(dropped)[0]  # the same everywhere; the lead's is the record
    killed_in = next((w for _, w in gathered if w is not None), None)
    return new_plane, KillOutcome(kill, [a for a, _ in gathered], lead_dropped, killed_in, variants=len(variants))


def print_kill(outcome: KillOutcome) -> None:
    """The kill's moment, in the log where it happened (the summary has the details)."""
    k = outcome.kill
    where = f" (during {outcome.killed_in})" if outcome.killed_in else ""
    print(f"\nrank {k.rank} killed with SIGKILL in iteration {k.iteration}{where}: survivors {outcome.survivors} "
          f"raised and shrank; {outcome.variants} variant(s) go on" + (f", {len(outcome.dropped)} could not shrink"
                                                                      if outcome.dropped else ""), flush=True)
    for rank, problem in outcome.wrong():
        print(f"KILL ANSWERED WRONGLY: rank {rank}: {problem}", flush=True)


def kill_lines(kill: faults.Kill, outcome: Optional[KillOutcome]) -> list[str]:
    if outcome is None:
        return [f"kill: rank {kill.rank} was to die in iteration {kill.iteration}; the run ended before it"]
    answers = outcome.answers

    def raised(a: KillAnswer) -> str:
        when = (f"{a.raise_s:.2f} s after the kill" if a.raise_s is not None else
                f"{a.since_iteration_s:.2f} s after its iteration began")
        return f"rank {a.rank} {when} (in {a.where})"

    lost = sorted({r for a in answers for r in a.lost_ranks})
    errors = sorted({a.error for a in answers})
    lines = [f"kill: rank {kill.rank} killed with SIGKILL in iteration {kill.iteration}"
             + (f", during {outcome.killed_in}" if outcome.killed_in else ""),
             f"kill: survivors raised {'/'.join(errors)} with lost_ranks {lost}: "
             + ", ".join(raised(a) for a in answers),
             f"kill: shrank to ranks {outcome.survivors} in {max(a.shrink_s for a in answers):.2f} s (slowest "
             f"survivor): {outcome.variants} variant(s) went on, not shrinkable here: "
             + ("; ".join(f"{b}/{lay} ({why})" for (b, lay), why in sorted(outcome.dropped.items())) or "none"),
             f"kill: after the shrink {outcome.iterations} iteration(s) x {outcome.variants} variant(s) on ranks "
             f"{outcome.survivors}, {outcome.failing} failing, {outcome.faults} fault(s) on surviving ranks"]
    lines += [f"kill: ANSWERED WRONGLY: rank {r}: {p}" for r, p in outcome.wrong()]
    return lines
