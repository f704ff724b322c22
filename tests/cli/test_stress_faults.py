"""``ep-comm stress --faults``: the fault plan, the faulty inputs, the verdict on every rank's answer,
and whole runs on gloo ranks: naive and ag_rs survive every fault in place (counts checked against
the seed's plan), and a backend that refuses every call after bad input fails the run with its counts."""
from __future__ import annotations

import argparse
import re
import shlex

import pytest
import torch

from ep_comm import EPConfig
from ep_comm.cli import faults, stress, stress_cases
from ep_comm.cli.main import build_parser
from ep_comm.distributed.spawn import spawn_local
from ep_comm.errors import EPError, EPInputError, EPTimeoutError
from ep_comm.layouts import Dispatched
from ep_comm.routing import find_invalid_ids
from ep_comm.validation import validate_combine, validate_dispatch

from .conftest import CPU_RANKS
from .refusing_stand_in import stress_rank

SHAPE = ["--hidden", "128", "--topk", "3", "--max-tokens", "8"]
COLUMNS = ("failures", "faults", "wrong", "in_place", "new_comm", "result")


def _plan(seed: int, rate: float, iters: int, world: int, experts: int, start: int = 0) -> list[faults.Fault]:
    args = argparse.Namespace(seed=seed, fault_rate=rate)
    planned = [faults.plan_fault(args, i, world, experts) for i in range(start, start + iters)]
    return [f for f in planned if f is not None]


def _rows(stdout: str) -> dict[tuple[str, str], dict[str, str]]:
    """The summary table: per (backend, layout) the cells of the fault columns."""
    lines = stdout.splitlines()
    head = next(i for i, ln in enumerate(lines) if ln.startswith("backend ") and "new_comm" in ln)
    names = lines[head].split()
    rows = {}
    for ln in lines[head + 2:]:
        cells = ln.split()
        if len(cells) != len(names):
            break
        rows[(cells[0], cells[1])] = {n: cells[names.index(n)] for n in COLUMNS}
    return rows


# -- the plan and the inputs ---------------------------------------------------------------------------
def test_plan_is_reproducible_and_covers_every_kind():
    planned = _plan(seed=7, rate=0.3, iters=600, world=3, experts=12)
    assert planned == _plan(seed=7, rate=0.3, iters=600, world=3, experts=12)
    assert [f.iteration for f in _plan(7, 0.3, 100, 3, 12, start=250)] == \
        [f.iteration for f in planned if 250 <= f.iteration < 350]  # --start K --iters 1 replays iteration K
    assert 0.2 < len(planned) / 600 < 0.4
    assert {f.kind for f in planned} == set(faults.KINDS)
    assert {len(f.ranks) for f in planned} == {1, 2, 3}
    assert {f.report for f in planned} == set(faults.REPORT_PATHS)
    assert all(f.value < -1 or f.value >= 12 for f in planned)
    assert all(f.stage == ("combine" if f.kind == "expert_out" else "dispatch") for f in planned)
    assert _plan(seed=7, rate=1.0, iters=20, world=2, experts=8) and not _plan(seed=8, rate=0.3, iters=0, world=2,
                                                                                experts=8)


@pytest.mark.parametrize("quant,payload,scales", [(None, "dtype", 0), (None, "dtype", 3), ("fp8", "dtype", 0),
                                                  (None, "uint8", 0)])
def test_every_dispatch_fault_is_refused_by_the_checks_with_the_precise_words(quant, payload, scales):
    cfg = EPConfig(num_experts=8, top_k=2, hidden=128, max_tokens_per_rank=8, quant=quant)
    case = stress_cases.plan(argparse.Namespace(seed=0, max_tokens=8, inject_fault=False, start=0, iters=1),
                             0, 2, False)
    case.quant, case.payload, case.scales_width, case.tokens = quant, payload, scales, [5, 0]
    inputs = stress_cases.case_inputs(cfg, case)
    for i, kind in enumerate(k for k in faults.KINDS if k != "expert_out"):
        for ranks in ((0,), (1,), (0, 1)):  # rank 1 has no tokens
            fault = faults.Fault(i, kind, ranks, value=8 + i, report="check_errors", seed=100 + i)
            bad = faults.faulty_inputs(cfg, inputs, fault)
            assert [b is inp for b, inp in zip(bad, inputs)] == [r not in ranks for r in range(2)]
            for r in ranks:
                b = bad[r]
                if kind == "bad_id":
                    validate_dispatch(cfg, torch.device("cpu"), b.x, b.topk_ids, b.topk_weights, b.x_scales)
                    assert find_invalid_ids(b.topk_ids, cfg.num_experts)[2] == 8 + i
                    clean = faults.sanitized([b], cfg.num_experts)[0].topk_ids
                    assert find_invalid_ids(clean, cfg.num_experts) is None
                    assert torch.equal(clean == -1, (b.topk_ids == -1) | (b.topk_ids == 8 + i))
                    continue
                with pytest.raises(EPInputError) as err:
                    validate_dispatch(cfg, torch.device("cpu"), b.x, b.topk_ids, b.topk_weights, b.x_scales)
                assert all(w in str(err.value) for w in faults.precise_words(fault, True)), (kind, str(err.value))


@pytest.mark.parametrize("layout", ["standard", "batched"])
def test_wrong_expert_out_is_refused_by_the_combine_checks(layout):
    cfg = EPConfig(num_experts=8, top_k=2, hidden=64, max_tokens_per_rank=4, layout=layout)
    shape = (4, 8, 64) if layout == "batched" else (6, 64)
    d = Dispatched(layout=layout, x=torch.zeros(shape[:-1] + (64,)), num_tokens=3)
    good = torch.zeros(shape, dtype=cfg.dtype)
    validate_combine(cfg, torch.device("cpu"), good, d, None)
    seen = set()
    for seed in range(40):
        fault = faults.Fault(0, "expert_out", (0,), 0, "check_errors", seed)
        wrong = faults.wrong_expert_out(good, fault, 0)
        seen.add(tuple(wrong.shape))
        with pytest.raises(EPInputError, match="expert_out"):
            validate_combine(cfg, torch.device("cpu"), wrong, d, None)
    assert len(seen) == 4


# -- the verdict ---------------------------------------------------------------------------------------
def _trace(*answers: tuple[str, BaseException], seconds: float = 0.01, problems=()) -> faults.Trace:
    return faults.Trace([faults.Answer.of(stage, exc) for stage, exc in answers], list(problems), seconds)


def test_named_ranks():
    assert faults.named_ranks("invalid input on peer rank(s) [1, 12] (rank 1: x)") == {1, 12}
    assert faults.named_ranks("rank 3 abandoned a call") == {3}
    assert faults.named_ranks("no rank here, 4 tokens") == set()


def test_judge_accepts_the_contract_and_names_every_departure_from_it():
    fault = faults.Fault(0, "hidden", (1,), 0, "check_errors", 0)
    precise = ("dispatch", EPInputError("x has shape (2, 129), expected [T, hidden=128]"))
    naming = ("dispatch", EPInputError("invalid input on peer rank(s) [1] (rank 1: ...)"))
    kernel_peer = ("check_errors", EPInputError("invalid input on peer rank(s) [1]: they abandoned dispatch 4"))
    assert faults.judge(fault, [_trace(naming), _trace(precise), _trace(kernel_peer)], True, 10.0) == []

    def problems(traces):
        return [(r, p.split(":")[0]) for r, p in faults.judge(fault, traces, True, 10.0)]

    assert problems([_trace(), _trace(precise)]) == [(0, "no error")]
    assert problems([_trace(("dispatch", RuntimeError("gloo"))), _trace(precise)]) == [(0, "untyped error")]
    assert problems([_trace(("combine", EPTimeoutError("late"))), _trace(precise)]) == \
        [(0, "timed out instead of naming the faulty rank(s)")]
    assert problems([_trace(("dispatch", EPInputError("rank 0 saw a problem"))), _trace(precise)]) == \
        [(0, "does not name faulty rank(s) [1]")]
    assert problems([_trace(naming), _trace(("dispatch", EPError("x is wrong")))]) == \
        [(1, "not the precise EPInputError (naming hidden)")]
    assert problems([_trace(naming, seconds=11.0), _trace(precise)]) == \
        [(0, "answered after 11.0 s, more than --op-timeout 10 s")]

    lenient = faults.Fault(0, "bad_id", (1,), 99, "next call", 0)
    report = ("next call", EPInputError("2 topk_ids outside [-1, num_experts=8) were sent as -1"))
    assert faults.judge(lenient, [_trace(), _trace(report)], False, 10.0) == []
    assert faults.judge(lenient, [_trace(("next call", EPInputError("invalid input on peer rank(s) [1]"))),
                                  _trace(report)], False, 10.0) == []
    assert [r for r, _ in faults.judge(lenient, [_trace(), _trace()], False, 10.0)] == [1]
    assert [r for r, _ in faults.judge(lenient, [_trace(("combine", EPError("odd"))), _trace(report)], False,
                                       10.0)] == [0]
    assert [r for r, _ in faults.judge(lenient, [_trace(problems=["combine differs"]), _trace(report)], False,
                                       10.0)] == [0]
    # validated, a bad id's error must carry its value
    strict = faults.Fault(0, "bad_id", (0,), 99, "next call", 0)
    ok = ("dispatch", EPInputError("topk_ids[0, 1] = 99 on rank 0 is not a valid expert id"))
    vague = ("dispatch", EPInputError("topk_ids outside [-1, 8)"))
    peer = ("dispatch", EPInputError("invalid input on peer rank(s) [0]"))
    assert faults.judge(strict, [_trace(ok), _trace(peer)], True, 10.0) == []
    assert [r for r, _ in faults.judge(strict, [_trace(vague), _trace(peer)], True, 10.0)] == [0]


def test_fault_arguments_are_checked():
    parser = build_parser()

    def problem(*argv: str):
        args = parser.parse_args(["stress", "--backend", "naive", *argv])
        del args.module
        return stress.check_arguments(args)

    assert problem() is None and problem("--faults") is None and problem("--faults", "--fault-rate", "1") is None
    assert "needs --faults" in problem("--fault-rate", "0.5")
    assert "(0, 1]" in problem("--faults", "--fault-rate", "0")
    args = parser.parse_args(["stress", "--faults"])
    del args.module
    stress.check_arguments(args)
    assert args.fault_rate == faults.DEFAULT_RATE and args.validate_ids == "on"


# -- whole runs ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("world,extra", [(2, ["--iters", "250", "--seed", "11"]),
                                         (3, ["--iters", "250", "--seed", "12", "--fault-rate", "0.3"]),
                                         (3, ["--iters", "150", "--seed", "13", "--fault-rate", "0.4",
                                              "--validate-ids", "off", "--layout", "batched"])])
def test_collective_backends_survive_every_fault_in_place(cli, world, extra):
    proc = cli(["stress", "--nproc", str(world), "--backend", "naive,ag_rs", *SHAPE, "--experts", "12", "--faults",
                *extra], timeout=240, **CPU_RANKS)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    opts = dict(zip(extra[::2], extra[1::2]))
    iters, rate = int(opts["--iters"]), float(opts.get("--fault-rate", faults.DEFAULT_RATE))
    planned = _plan(int(opts["--seed"]), rate, iters, world, 12)
    n = len(planned)
    assert n > 30 and {f.kind for f in planned} == set(faults.KINDS) and any(len(f.ranks) > 1 for f in planned)
    rows = _rows(proc.stdout)
    layouts = [opts["--layout"]] if "--layout" in opts else ["batched", "standard"]
    assert set(rows) == {(b, lay) for b in ("ag_rs", "naive") for lay in layouts}
    for row in rows.values():
        assert row == {"failures": "0", "faults": str(n), "wrong": "0", "in_place": str(n), "new_comm": "0",
                       "result": "ok"}
    assert f"faults: {n} of {iters} iteration(s) faulty, each fault made on every variant " \
           f"({faults.tally_kinds(planned)})" in proc.stdout
    total = n * len(rows)
    verdict = (f"stress PASSED: {iters} iteration(s) x {len(rows)} variant(s) on {world} ranks, "
               f"0 failing iteration(s), {total} fault(s): {total} survived in place, 0 needed a new communicator, "
               "0 answered wrongly")
    assert verdict in proc.stdout
    assert "NOT SURVIVED" not in proc.stdout and "MISMATCH" not in proc.stdout


def _stand_in_run(tmp_path, argv: list[str], mode: str = "refuse") -> tuple[list[int], str]:
    args = build_parser().parse_args(["stress", *argv])
    del args.module
    assert stress.check_arguments(args) is None
    out = tmp_path / "rank0.txt"
    results = spawn_local(stress_rank, args.nproc, (args, str(out), mode), timeout_s=180,
                          preload=("torch", "torch.distributed"))
    assert all(r.ok for r in results), [r.traceback for r in results]
    return [r.value for r in results], out.read_text()


def test_a_backend_that_refuses_calls_after_bad_input_fails_the_run_and_is_counted(tmp_path):
    argv = ["--nproc", "2", "--backend", "naive", "--layout", "standard", *SHAPE, "--experts", "8", "--iters", "40",
            "--seed", "4", "--faults", "--fault-rate", "0.3"]
    codes, out = _stand_in_run(tmp_path, argv)
    assert codes == [1, 1], out
    planned = _plan(4, 0.3, 40, 2, 8)
    n = len(planned)
    assert n >= 5
    # every fault answered as the contract says, none survived in place, every valid call right
    assert _rows(out) == {("naive", "standard"): {"failures": "0", "faults": str(n), "wrong": "0", "in_place": "0",
                                                  "new_comm": str(n), "result": "FAIL"}}
    assert f"faults not survived in place (the next call raised; a new communicator was created):\n" \
           f"  naive/standard: {n} of {n} ({faults.tally_kinds(planned)})\n" in out
    assert f"stress FAILED: 40 iteration(s) x 1 variant(s) on 2 ranks, 0 failing iteration(s), {n} fault(s): " \
           f"0 survived in place, {n} needed a new communicator, 0 answered wrongly" in out
    first = planned[0]
    assert out.count("FAULT NOT SURVIVED") == 1  # the first one per variant; the rest are counted
    assert f"FAULT NOT SURVIVED in iteration {first.iteration} (seed 4): fault {first.kind} on rank(s) " \
           f"{list(first.ranks)}" in out
    assert "rank 0: EPError: communicator unusable" in out and "rank 1: EPError: communicator unusable" in out
    replay = re.search(r"replay: (ep-comm stress .*)", out).group(1)
    assert f"--start {first.iteration} --iters 1" in replay and "--faults --fault-rate 0.3" in replay

    # the replay reproduces that fault alone
    codes, again = _stand_in_run(tmp_path, shlex.split(replay)[2:] + ["--layout", "standard"])
    assert codes == [1, 1], again
    assert _rows(again)[("naive", "standard")]["new_comm"] == "1"
    assert f"FAULT NOT SURVIVED in iteration {first.iteration} (seed 4)" in again


def test_untyped_answers_fail_the_run_at_the_first_fault(tmp_path):
    argv = ["--nproc", "2", "--backend", "naive", "--layout", "standard", *SHAPE, "--experts", "8", "--iters", "40",
            "--seed", "4", "--faults", "--fault-rate", "0.3"]
    codes, out = _stand_in_run(tmp_path, argv, mode="untyped")
    assert codes == [1, 1], out
    first = _plan(4, 0.3, 40, 2, 8)[0]
    assert out.count("FAULT ANSWERED WRONGLY") == 1  # without --keep-going the run stops there
    assert f"FAULT ANSWERED WRONGLY in iteration {first.iteration} (seed 4): " in out
    assert f"  fault {first.kind} on rank(s) {list(first.ranks)}" in out
    for rank in range(2):
        assert f"rank {rank}, backend naive, layout standard: fault: untyped error: {first.stage} raised " \
               "RuntimeError: " in out
    assert _rows(out) == {("naive", "standard"): {"failures": "0", "faults": "1", "wrong": "1", "in_place": "1",
                                                  "new_comm": "0", "result": "FAIL"}}
    assert f"stress FAILED: {first.iteration + 1} iteration(s) x 1 variant(s) on 2 ranks, 1 failing iteration(s), " \
           "1 fault(s): 1 survived in place, 0 needed a new communicator, 1 answered wrongly" in out
    assert f"replay: ep-comm stress --nproc 2 --seed 4 --start {first.iteration} --iters 1 --backend naive" in out
