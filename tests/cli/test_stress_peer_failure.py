"""``ep-comm stress`` when a rank is killed (kill -9) mid-run or raises between two calls: every
survivor fails with an EPTimeoutError naming that rank within --op-timeout + 10 s, the command exits
non-zero, and no process of the run is left behind."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from typing import Optional

import pytest

from .conftest import REPO, clean_env

OP_TIMEOUT = 3.0
BOUND_S = OP_TIMEOUT + 10


class _Run:
    """``python -m ep_comm stress ...`` with both pipes read in the background."""

    def __init__(self, args: list[str]):
        self.tag = uuid.uuid4().hex  # in every process's environment: finds leftovers by it
        self.proc = subprocess.Popen([sys.executable, "-m", "ep_comm", "stress", *args], cwd=REPO,
                                     env=clean_env(EP_COMM_TEST_RUN=self.tag, CUDA_VISIBLE_DEVICES=""),
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.out: list[str] = []
        self.err: list[str] = []
        self._cond = threading.Condition()
        self._readers = [threading.Thread(target=self._read, args=(pipe, sink), daemon=True)
                         for pipe, sink in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))]
        for t in self._readers:
            t.start()

    def _read(self, pipe, sink: list[str]) -> None:
        for line in pipe:
            with self._cond:
                sink.append(line)
                self._cond.notify_all()
        with self._cond:  # end of output: the process is exiting, waiters must look again
            self._cond.notify_all()

    def wait_for(self, pattern: str, timeout: float) -> None:
        """Until a stdout or stderr line matches ``pattern`` (a real sign of progress, not a sleep)."""
        rx = re.compile(pattern)
        with self._cond:
            ok = self._cond.wait_for(lambda: any(rx.search(ln) for ln in self.out + self.err)
                                     or self.proc.poll() is not None, timeout)
        assert ok and self.proc.poll() is None, f"no {pattern!r} before exit/timeout:\n{self.text()}"

    def finish(self, timeout: float) -> tuple[int, float]:
        t0 = time.monotonic()
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill_all()
            pytest.fail(f"ep-comm stress still running {timeout} s later:\n{self.text()}")
        for t in self._readers:
            t.join(10)
        return code, time.monotonic() - t0

    def rank_pids(self, nproc: int) -> list[int]:
        """The ranks, in rank order (spawn_local starts them one after the other): children of the
        command started with the ``spawn`` method, or children of its fork server (the CLI preloads
        torch in one and forks the ranks from it)."""
        info = {}
        for pid in _pids_with(self.tag):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    info[pid] = (ppid, f.read())
            except OSError:
                continue
        servers = {pid for pid, (ppid, cmd) in info.items() if ppid == self.proc.pid and b"forkserver" in cmd}
        kids = [pid for pid, (ppid, cmd) in info.items()
                if ppid in servers or (ppid == self.proc.pid and b"multiprocessing.spawn" in cmd)]
        assert len(kids) == nproc, (kids, info, self.text())
        return sorted(kids)

    def leftovers(self, within_s: float = 5.0) -> list[int]:
        deadline = time.monotonic() + within_s
        while True:
            left = _pids_with(self.tag)
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.1)  # polling /proc for processes to be gone: there is nothing to wait on

    def kill_all(self) -> None:
        for pid in _pids_with(self.tag):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass

    def text(self) -> str:
        return "".join(self.out) + "\n--- stderr ---\n" + "".join(self.err)


def _pids_with(tag: str) -> list[int]:
    needle = f"EP_COMM_TEST_RUN={tag}".encode()
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    out.append(int(name))
        except OSError:
            continue
    return out


def _failure_line(text: str, rank: int) -> Optional[str]:
    m = re.search(rf"^--- rank {rank} failed: (.*)$", text, re.M)
    return m.group(1) if m else None


def _check_survivors(text: str, nproc: int, culprit: int, how: str) -> None:
    for r in range(nproc):
        if r == culprit:
            continue
        line = _failure_line(text, r)
        assert line is not None and line.startswith("EPTimeoutError:"), f"rank {r}: {line}\n{text}"
        assert f"rank {culprit} is gone ({how}" in line, f"rank {r}: {line}"


@pytest.mark.parametrize("nproc,victim", [(2, 1), (3, 0)])
def test_killed_rank_mid_stress(nproc: int, victim: int) -> None:
    run = _Run(["--nproc", str(nproc), "--experts", "12", "--iters", "400", "--op-timeout", str(OP_TIMEOUT),
                "--backend", "ag_rs,naive"])
    try:
        run.wait_for(r"^stress 40/400 iterations", timeout=180)  # rank 0's first progress line: mid-run
        pid = run.rank_pids(nproc)[victim]
        os.kill(pid, signal.SIGKILL)
        code, secs = run.finish(timeout=BOUND_S + 30)
    finally:
        run.kill_all()
    text = run.text()
    assert code != 0, text
    assert secs < BOUND_S, f"survivors took {secs:.1f} s to fail after the kill:\n{text}"
    assert f"rank {victim} was killed by signal 9 (SIGKILL)" in (_failure_line(text, victim) or ""), text
    _check_survivors(text, nproc, victim, "its process")
    assert "stress PASSED" not in text
    assert run.leftovers() == [], text


def test_rank_raising_between_calls_in_stress() -> None:
    nproc = 3
    run = _Run(["--nproc", str(nproc), "--experts", "12", "--iters", "12", "--op-timeout", str(OP_TIMEOUT),
                "--backend", "ag_rs", "--inject-exception"])
    try:
        code, _ = run.finish(timeout=240)
    finally:
        run.kill_all()
    text = run.text()
    assert code != 0, text
    culprit = nproc - 1
    raised = _failure_line(text, culprit) or ""
    assert raised.startswith("InjectedError:"), text
    t_raise = float(re.search(r"at unix time ([0-9.]+)", raised).group(1))
    _check_survivors(text, nproc, culprit, "it closed its end of the communicator: closed after InjectedError")
    # the parent exits once every rank has: its exit time bounds the survivors' failure time
    assert time.time() - t_raise < BOUND_S, f"{time.time() - t_raise:.1f} s after the exception:\n{text}"
    assert run.leftovers() == [], text
