"""What ``ep-comm stress`` prints: a failing case with the command that replays it, a fault not
survived in place, the summary table and verdict, and the progress line."""
from __future__ import annotations

import argparse
import sys
import threading
import time
from typing import Any, Optional

from . import faults, format_table, stress_cases, stress_kill
from .launcher import RankEnv

HEARTBEAT_S = 60.0  # a log line per this many seconds one iteration runs


def replay(env: RankEnv, args: argparse.Namespace, iteration: int, backends: list[str]) -> str:
    """The command that runs iteration ``iteration`` again, alone, on ``backends`` (at or after a kill:
    the run from its start to that iteration, the same rank killed in the same iteration)."""
    kill = faults.plan_kill(args, env.world_size)
    if kill is not None and iteration >= kill.iteration:
        span = f"--start {args.start} --iters {iteration - args.start + 1} --kill --kill-rank {kill.rank} " \
               f"--kill-at {kill.iteration}"
    else:
        span = f"--start {iteration} --iters 1"
    cmd = (f"ep-comm stress --nproc {env.world_size} --seed {args.seed} {span} "
           f"--backend {','.join(backends)} --hidden {args.hidden} --experts {args.experts} --topk {args.topk} "
           f"--max-tokens {args.max_tokens} --dtype {args.dtype}")
    if getattr(args, "zero_copy", False):
        cmd += " --zero-copy"
    if getattr(args, "num_sms", None) is not None:
        cmd += f" --num-sms {args.num_sms}"
    if getattr(args, "share_gpus", False):
        cmd += " --share-gpus"
    if args.faults:
        cmd += f" --faults --fault-rate {args.fault_rate:g}"
    if not faults.validating(args):
        cmd += " --validate-ids off"
    if args.faults and args.op_timeout != 100.0:
        cmd += f" --op-timeout {args.op_timeout:g}"  # an answer slower than it is wrong
    return cmd + (" --inject-fault" if args.inject_fault else "")


def print_failure(env: RankEnv, args: argparse.Namespace, case: stress_cases.Case, fault: Optional[faults.Fault],
                  bad: list, wrong: list) -> None:
    title = " and ".join(t for t, on in (("MISMATCH", bad), ("FAULT ANSWERED WRONGLY", wrong)) if on)
    print(f"\n{title} in iteration {case.iteration} (seed {args.seed}): {case.describe()}", flush=True)
    if fault is not None:
        print(f"  {fault.describe(faults.validating(args))}", flush=True)
    for rank, backend, layout, problems in bad + wrong:
        for p in problems:
            print(f"  rank {rank}, backend {backend}, layout {layout}: {p}", flush=True)
    print(f"  replay: {replay(env, args, case.iteration, sorted({b for _, b, _, _ in bad + wrong}))}", flush=True)


def print_not_survived(env: RankEnv, args: argparse.Namespace, fault: faults.Fault, fresh: list) -> None:
    """The first fault each variant did not survive in place (later ones are counted, not printed)."""
    names = [f"{b}/{lay}" for (b, lay), _ in fresh]
    (backend, layout), errors = fresh[0]
    print(f"\nFAULT NOT SURVIVED in iteration {fault.iteration} (seed {args.seed}): "
          f"{fault.describe(faults.validating(args))}", flush=True)
    print(f"  on {', '.join(names)} the next call on the same communicator raised; on {backend}/{layout}:", flush=True)
    for rank, error in errors:
        print(f"  rank {rank}: {error if len(error) <= 400 else error[:397] + '...'}", flush=True)
    print("  a new communicator is created and the run goes on; later faults not survived on "
          f"{'these variants' if len(fresh) > 1 else 'this variant'} are counted in the summary, not printed",
          flush=True)
    print(f"  replay: {replay(env, args, fault.iteration, sorted({b for (b, _), _ in fresh}))}", flush=True)


def print_summary(env: RankEnv, args: argparse.Namespace, stats: dict, failed: list, elapsed: float,
                   injected: list, kill: Optional[faults.Kill] = None,
                   outcome: Optional[stress_kill.KillOutcome] = None) -> None:
    headers = ["backend", "layout", "iters", "fp8", "uint8", "skewed", "zero_tok_ranks", "tokens", "failures"]
    headers += ["faults", "wrong", "in_place", "new_comm"] if args.faults else []
    dropped = outcome.dropped if outcome is not None else {}
    rows = []
    for (backend, layout), st in sorted(stats.items()):
        per_iter = 1e3 * st.seconds / st.iterations if st.iterations else 0.0
        f = st.faults
        row = [backend, layout, st.iterations, st.fp8, st.uint8, st.skewed, st.zero_token_ranks, st.tokens, st.failures]
        row += [f.injected, f.wrong, f.in_place, f.new_comm] if args.faults else []
        failing = st.failures or f.wrong or f.new_comm
        rows.append(row + [f"{per_iter:.1f}", "FAIL" if failing else "dropped" if (backend, layout) in dropped
                           else "ok"])
    print(format_table(headers + ["ms/iter", "result"], rows, right=range(2, len(headers) + 1)), flush=True)
    done = max((st.iterations for st in stats.values()), default=0)
    total = {k: sum(getattr(st.faults, k) for st in stats.values())
             for k in ("injected", "wrong", "in_place", "new_comm")}
    if args.faults:
        print(f"faults: {len(injected)} of {done} iteration(s) faulty, each fault made on every variant "
              f"({faults.tally_kinds(injected)})", flush=True)
        lost = [f"  {b}/{lay}: {st.faults.new_comm} of {st.faults.injected} ({faults.tally_kinds(st.faults.lost)})"
                for (b, lay), st in sorted(stats.items()) if st.faults.new_comm]
        if lost:
            print("\n".join(["faults not survived in place (the next call raised; a new communicator was created):",
                             *lost]), flush=True)
    kill_wrong = False
    if kill is not None:
        print("\n".join(stress_kill.kill_lines(kill, outcome)), flush=True)
        kill_wrong = outcome.wrong() != [] if outcome is not None else not failed
    verdict = "FAILED" if failed or total["new_comm"] or kill_wrong else "PASSED"
    fault_part = (f", {total['injected']} fault(s): {total['in_place']} survived in place, {total['new_comm']} "
                  f"needed a new communicator, {total['wrong']} answered wrongly" if args.faults else "")
    kill_part = ""
    if outcome is not None:
        kill_part = (f" (rank {outcome.kill.rank} killed in iteration {outcome.kill.iteration}: "
                     f"{'answered wrongly' if kill_wrong else 'survived'}, then {outcome.iterations} iteration(s) "
                     f"on ranks {outcome.survivors})")
    print(f"stress {verdict}: {done} iteration(s) x {len(stats)} variant(s) on {env.world_size} ranks{kill_part}, "
          f"{len(failed)} failing iteration(s){fault_part}, {elapsed:.1f} s", flush=True)


class Progress:
    """On a terminal tqdm when installed, else a \\r counter; into a log (not a terminal) a line per 10 %,
    whether tqdm is installed or not (its redrawn bar makes an unreadable log), and a line whenever an
    iteration has run for ``heartbeat_s`` more seconds (a stuck run then says where it is)."""

    def __init__(self, total: int, enabled: bool, heartbeat_s: float = HEARTBEAT_S):
        self.total, self.enabled, self.done, self.failures = total, enabled, 0, 0
        self.bar: Any = None
        self.tty = enabled and sys.stderr.isatty()
        self._heartbeat_s = heartbeat_s
        self._since = time.monotonic()
        self._timer: Optional[threading.Timer] = None
        if enabled and not self.tty:
            self._arm()
        if self.tty:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, file=sys.stderr, desc="stress", unit="it", leave=False)
            except ImportError:
                self.bar = None

    def _arm(self, delay_s: Optional[float] = None) -> None:
        self._timer = threading.Timer(self._heartbeat_s if delay_s is None else delay_s, self._beat)
        self._timer.daemon = True
        self._timer.start()

    def _beat(self) -> None:
        idle = time.monotonic() - self._since
        if idle < self._heartbeat_s:  # an iteration ended meanwhile: look again when this one is due
            self._arm(self._heartbeat_s - idle)
            return
        print(f"stress: iteration {self.done + 1} of {self.total} still running after {idle:.0f} s "
              f"({self.failures} failing so far)", file=sys.stderr, flush=True)
        self._arm()

    def update(self, failures: int) -> None:
        if not self.enabled:
            return
        self._since = time.monotonic()
        self.done += 1
        self.failures = failures
        if self.bar is not None:
            self.bar.set_postfix(failures=failures, refresh=False)
            self.bar.update(1)
        elif self.tty:
            sys.stderr.write(f"\rstress {self.done}/{self.total} iterations, {failures} failing")
            sys.stderr.flush()
        elif self.done == self.total or self.done % max(1, self.total // 10) == 0:
            print(f"stress {self.done}/{self.total} iterations, {failures} failing", file=sys.stderr, flush=True)

    def clear(self) -> None:
        if self.bar is not None:
            self.bar.clear()
        elif self.tty:
            sys.stderr.write("\r" + " " * 60 + "\r")

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        elif self.tty and self.done:
            sys.stderr.write("\n")
            self.tty = False
