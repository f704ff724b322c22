"""``ep-comm stress --faults --kill``: one rank killed with SIGKILL mid-iteration, the survivors raise
``EPTimeoutError`` naming it, shrink every communicator and run the remaining iterations (faults on
surviving ranks only) with every valid call checked against the oracle over the active ranks; the run
exits 0 and the planned death is no failure.  Gloo ranks, naive and ag_rs, both layouts."""
from __future__ import annotations

import argparse
import json
import re
import threading

import pytest

from ep_comm.cli import faults, stress, stress_kill
from ep_comm.cli.launcher import planned_death
from ep_comm.cli.main import build_parser
from ep_comm.distributed.spawn import RankResult

from .conftest import CPU_RANKS

SHAPE = ["--hidden", "128", "--topk", "3", "--max-tokens", "8", "--experts", "12", "--op-timeout", "5"]
OP_TIMEOUT = 5.0


def _kill_args(**kw) -> argparse.Namespace:
    base = dict(kill=True, seed=1, start=0, iters=200, kill_rank=None, kill_at=None)
    return argparse.Namespace(**(base | kw))


def _parsed(argv: list[str]) -> argparse.Namespace:
    args = build_parser().parse_args(["stress", *argv])
    del args.module
    return args


# -- the plan ------------------------------------------------------------------------------------------
def test_kill_plan_is_reproducible_and_overridable():
    plans = [faults.plan_kill(_kill_args(seed=s), 3) for s in range(40)]
    assert plans == [faults.plan_kill(_kill_args(seed=s), 3) for s in range(40)]
    assert {p.rank for p in plans} == {0, 1, 2}
    assert all(50 <= p.iteration < 150 and 0 <= p.fraction < 1 for p in plans)
    drawn = faults.plan_kill(_kill_args(seed=4), 3)
    assert faults.plan_kill(_kill_args(seed=4, kill_rank=0), 3) == faults.Kill(0, drawn.iteration, drawn.fraction)
    assert faults.plan_kill(_kill_args(seed=4, kill_at=7), 3) == faults.Kill(drawn.rank, 7, drawn.fraction)
    assert faults.plan_kill(_kill_args(kill=False), 3) is None
    assert faults.plan_kill(_kill_args(iters=1, start=5), 2).iteration == 5


def test_faults_after_the_kill_fall_on_surviving_ranks_only():
    args = argparse.Namespace(seed=3, fault_rate=1.0)
    for i in range(300):
        assert faults.plan_fault(args, i, 3, 12) == faults.plan_fault(args, i, 3, 12, [0, 1, 2])
        assert set(faults.plan_fault(args, i, 3, 12, [0, 2]).ranks) <= {0, 2}
        assert faults.plan_fault(args, i, 3, 12, [1]).ranks == (1,)


@pytest.mark.parametrize("argv,problem", [
    (["--kill-rank", "1"], "--kill-rank and --kill-at need --kill"),
    (["--kill", "--nproc", "1"], "at least 2 ranks"),
    (["--kill", "--nproc", "3", "--kill-rank", "3"], "--kill-rank must be in [0, 3)"),
    (["--kill", "--nproc", "3", "--iters", "10", "--start", "5", "--kill-at", "15"], "--kill-at must be one of"),
])
def test_kill_arguments_are_checked(argv, problem):
    assert problem in (stress.check_arguments(_parsed(argv)) or "")
    assert stress.check_arguments(_parsed(["--kill", "--nproc", "3", "--kill-rank", "2", "--kill-at", "0"])) is None


def test_only_the_planned_sigkill_is_no_failure():
    assert planned_death(RankResult(1, False, error="rank 1 was killed by signal 9 (SIGKILL) without reporting",
                                    exitcode=-9))
    assert not planned_death(RankResult(1, False, error="rank 1 did not finish within 60 s; killed by the launcher",
                                        exitcode=-9))
    assert not planned_death(RankResult(1, True, value=0, exitcode=0))
    assert not planned_death(RankResult(1, False, error="rank 1 raised", exitcode=1))


def test_a_survivor_naming_the_wrong_ranks_is_a_wrong_answer():
    good = stress_kill.KillAnswer(0, "EPTimeoutError", "rank 1 is gone", [1], "naive/standard dispatch", 0.1, 0.2,
                                  0.3, [])
    assert good.wrong(1) == []
    assert "expected EPTimeoutError with lost_ranks [2]" in good.wrong(2)[0]
    blind = stress_kill.KillAnswer(2, "EPTimeoutError", "missing rank 1", [], "ag_rs/batched combine", 0.1, 0.2, 0.3,
                              ["naive/batched: active_ranks [0, 1, 2] after shrink(), expected [0, 2]"])
    outcome = stress_kill.KillOutcome(faults.Kill(1, 10, 0.5), [good, blind], {}, None)
    assert [r for r, _ in outcome.wrong()] == [2, 2] and outcome.survivors == [0, 2]


# -- whole runs ----------------------------------------------------------------------------------------
def _planned_faults(seed: int, rate: float, iters: int, world: int, kill: faults.Kill) -> tuple[int, int]:
    """(faults before the kill, faults after it) as the run draws them: none in the kill's iteration,
    the victim spared after it."""
    args = argparse.Namespace(seed=seed, fault_rate=rate)
    survivors = [r for r in range(world) if r != kill.rank]
    before = sum(faults.plan_fault(args, i, world, 12) is not None for i in range(kill.iteration))
    after = [faults.plan_fault(args, i, world, 12, survivors) for i in range(kill.iteration + 1, iters)]
    assert all(kill.rank not in f.ranks for f in after if f is not None)
    return before, sum(f is not None for f in after)


def _check_run(proc, seed: int, iters: int, world: int, kill: faults.Kill, rate: float,
               layouts=("batched", "standard")) -> None:
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    survivors = [r for r in range(world) if r != kill.rank]
    before, after = _planned_faults(seed, rate, iters, world, kill)
    n = before + after
    variants = [(b, lay) for b in ("ag_rs", "naive") for lay in layouts]
    rows = {tuple(ln.split()[:2]): ln.split() for ln in out.splitlines() if tuple(ln.split()[:2]) in variants}
    assert set(rows) == set(variants), out
    for cells in rows.values():
        # failures, faults, wrong, in_place, new_comm ... result
        assert cells[8:13] == ["0", str(n), "0", str(n), "0"] and cells[-1] == "ok", cells
    assert f"kill: rank {kill.rank} killed with SIGKILL in iteration {kill.iteration}" in out
    m = re.search(r"^kill: survivors raised EPTimeoutError with lost_ranks \[(\d+)\]: (.*)$", out, re.M)
    assert m and int(m.group(1)) == kill.rank, out
    raised = re.findall(r"rank (\d+) ([0-9.]+) s after the kill", m.group(2))
    assert [int(r) for r, _ in raised] == survivors, m.group(2)
    assert all(float(s) < OP_TIMEOUT + 10 for _, s in raised), m.group(2)
    m = re.search(r"^kill: shrank to ranks (\[.*?\]) in ([0-9.]+) s \(slowest survivor\): (\d+) variant\(s\) went on, "
                  r"not shrinkable here: none$", out, re.M)
    assert m and m.group(1) == str(survivors) and int(m.group(3)) == len(variants), out
    assert float(m.group(2)) < 2 * OP_TIMEOUT + 5
    rest = iters - kill.iteration - 1
    assert (f"kill: after the shrink {rest} iteration(s) x {len(variants)} variant(s) on ranks {survivors}, "
            f"0 failing, {after} fault(s) on surviving ranks") in out
    total = n * len(variants)
    assert (f"stress PASSED: {iters} iteration(s) x {len(variants)} variant(s) on {world} ranks (rank {kill.rank} "
            f"killed in iteration {kill.iteration}: survived, then {rest} iteration(s) on ranks {survivors}), "
            f"0 failing iteration(s), {total} fault(s): {total} survived in place, 0 needed a new communicator, "
            "0 answered wrongly") in out
    assert "MISMATCH" not in out and "WRONGLY" not in out and "NOT SURVIVED" not in out
    assert f"note: rank {kill.rank} was killed with SIGKILL as planned (--kill)" in proc.stderr
    assert "--- rank" not in proc.stderr, proc.stderr


def test_kill_a_middle_rank_survivors_shrink_and_go_on(cli):
    seed, iters, world = 1, 200, 3
    kill = faults.plan_kill(_kill_args(seed=seed, iters=iters), world)
    assert kill.rank == 1  # the seed's draw: a rank that is not the store's host
    proc = cli(["stress", "--nproc", str(world), "--backend", "naive,ag_rs", *SHAPE, "--faults", "--kill",
                "--iters", str(iters), "--seed", str(seed)], timeout=180, **CPU_RANKS)
    _check_run(proc, seed, iters, world, kill, faults.DEFAULT_RATE)


def test_kill_rank_0_the_store_host_with_lenient_ids(cli):
    # the survivors meet in a file store; bad ids are sent as -1, so the faulty calls after the shrink
    # are compared with the oracle over the active ranks too
    seed, iters, world = 2, 200, 3
    kill = faults.plan_kill(_kill_args(seed=seed, iters=iters, kill_rank=0, kill_at=60), world)
    proc = cli(["stress", "--nproc", str(world), "--backend", "naive,ag_rs", *SHAPE, "--faults", "--kill",
                "--kill-rank", "0", "--kill-at", "60", "--fault-rate", "0.3", "--validate-ids", "off",
                "--iters", str(iters), "--seed", str(seed)], timeout=180, **CPU_RANKS)
    _check_run(proc, seed, iters, world, kill, 0.3)


def test_kill_leaves_one_survivor_gloo_agreement(cli):
    seed, iters, world = 1, 60, 2
    kill = faults.plan_kill(_kill_args(seed=seed, iters=iters), world)
    proc = cli(["stress", "--nproc", str(world), "--backend", "naive,ag_rs", "--layout", "standard", *SHAPE,
                "--faults", "--kill", "--iters", str(iters), "--seed", str(seed)], timeout=120,
               **CPU_RANKS, EP_COMM_SHM_AGREE="0")
    _check_run(proc, seed, iters, world, kill, faults.DEFAULT_RATE, layouts=("standard",))


def test_the_kill_switch_fires_once_with_a_whole_record(tmp_path, monkeypatch):
    """The armed timer and the main thread may fire together: one of them writes the record and kills,
    the other never gets to touch the file (it used to interleave its write with the first one's)."""
    kills = []
    monkeypatch.setattr(stress_kill.os, "kill", lambda pid, sig: kills.append(sig))
    switch = stress_kill.KillSwitch(str(tmp_path / "record.json"))
    first = threading.Thread(target=switch.fire)
    first.start()
    first.join(5)
    second = threading.Thread(target=switch.fire, daemon=True)  # blocks for good: the process would be gone
    second.start()
    second.join(0.3)
    assert not first.is_alive() and second.is_alive() and len(kills) == 1
    record = json.loads((tmp_path / "record.json").read_text())
    assert set(record) == {"time", "where"}
