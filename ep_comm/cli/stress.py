"""``ep-comm stress``: many random dispatch/combine rounds, every one checked against the oracle.

Each iteration draws, from ``(--seed, iteration)`` alone (so any iteration can be replayed with
``--start K --iters 1``): tokens per rank in ``[0, --max-tokens]`` (zero-token ranks included),
uniform or skewed routing, -1 and duplicate expert ids, fp8 quantisation or an opaque uint8 payload
some of the time, and optional per-token scales.  The same inputs then go through every selected
backend × layout; dispatch and combine are both compared with ``ep_comm.oracle``.

One communicator per backend × layout × quant is created up front and reused for every iteration,
which is also what catches state leaking from one call into the next (epochs, reused buffers).
On a mismatch the failing case (seed, iteration, rank, backend, layout, tokens per rank, the oracle's
problem strings) is printed with a command that replays it, and the exit code is 1.

``--faults`` mixes bad input on random ranks into the rounds (``ep_comm.cli.faults`` says which and
what every rank must answer); the summary then counts per variant the faults injected, those answered
wrongly, those survived in place and those that needed a new communicator.  A fault not survived in
place fails the run, though the run goes on with a new communicator.

``--kill`` (with or without ``--faults``) kills one rank with SIGKILL in the middle of one iteration
(``ep_comm.cli.faults``: which rank and when): every survivor must raise ``EPTimeoutError`` naming it in
``lost_ranks``; then each calls ``shrink()`` on every communicator and on the results' control plane
and the run goes on over the survivors, every valid result compared with the oracle over the active
ranks and ``Dispatched.inactive_pairs`` with the oracle's count.  A variant whose backend cannot
shrink here (``EPError``) is reported and dropped.  The summary says who died when, how long the
survivors took to raise and to shrink, and what ran after; the killed rank's death is no failure.
"""
from __future__ import annotations

import argparse
import dataclasses
import time
from typing import Any, Optional, Union

import torch

from .. import oracle
from ..communicator import Communicator
from ..config import FP8_BLOCK, EPConfig
from ..distributed.control import ControlPlane
from ..errors import EPConfigError, EPError, EPTimeoutError, EPTopologyError
from . import (
    DTYPES,
    default_backends,
    faults,
    resolve_backend_request,
    stress_cases,
    stress_kill,
    stress_report,
    written_to_input_buffer,
)
from .launcher import PeerWatch, RankEnv, agree_exit_code, cuda_device_count, say, setup_rank, teardown


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--iters", type=int, default=200, help="iterations (default: 200)")
    p.add_argument("--seed", type=int, default=0, help="base seed; iteration i draws from (seed, i)")
    p.add_argument("--start", type=int, default=0, help="first iteration number (replay one with --iters 1)")
    p.add_argument("--backend", nargs="+", default=None, metavar="NAME",
                   help="backend(s), comma or space separated, 'auto', or 'all' (every usable built backend; the "
                        "default, or 'auto' when $EP_COMM_BACKEND is set)")
    p.add_argument("--layout", choices=("standard", "batched", "both"), default="both", help="(default: both)")
    p.add_argument("--hidden", type=int, default=256, help="hidden size (default: 256; fp8 needs a multiple of 128)")
    p.add_argument("--experts", type=int, default=16, help="global experts (default: 16)")
    p.add_argument("--topk", type=int, default=4, help="experts per token (default: 4)")
    p.add_argument("--max-tokens", type=int, default=32, help="max tokens per rank (default: 32)")
    p.add_argument("--num-sms", type=int, default=None,
                   help="SMs the kernel backends run on (default: the library's, by --max-tokens, or "
                        "$EP_COMM_NUM_SMS); few SMs and a few hundred tokens put the prefill kernels in play "
                        "(rows laid out while sending, the grouped combine from 512 tokens at 3+ ranks)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="activation dtype (default: bf16)")
    p.add_argument("--zero-copy", action="store_true",
                   help="EPConfig.zero_copy for the standard layout (received rows left in the buffer, viewed; every "
                        "other iteration writes x into Communicator.dispatch_input_buffer())")
    p.add_argument("--share-gpus", action="store_true",
                   help="let --nproc exceed the GPUs: the ranks form a gloo job and take GPU rank %% count, so "
                        "a 2-GPU machine runs 4 or 8 ranks; only the mnnvl backend runs so (NCCL and NVSHMEM need "
                        "a GPU per rank; the default --backend becomes mnnvl). Correctness only: ranks sharing a "
                        "GPU say nothing about speed")
    p.add_argument("--keep-going", action="store_true",
                   help="run every iteration even after a mismatch or a fault answered wrongly")
    faults.add_arguments(p)
    p.add_argument("--inject-fault", action="store_true", help=argparse.SUPPRESS)  # tests: one wrong combine
    # tests: the last rank raises a plain Python exception between a dispatch and its combine
    p.add_argument("--inject-exception", action="store_true", help=argparse.SUPPRESS)


def check_arguments(args: argparse.Namespace) -> Optional[str]:
    if args.share_gpus and not args.backend:
        args.backend = ["mnnvl"]
    args.backend = default_backends(args.backend)
    names, _, err = resolve_backend_request(args.backend)
    if err:
        return err
    if args.share_gpus and (names != ["mnnvl"] or args.kill):
        return ("--share-gpus runs the mnnvl backend only (NCCL and NVSHMEM need a GPU per rank) and no "
                f"--kill; got --backend {' '.join(args.backend)}{' and --kill' if args.kill else ''}")
    if args.share_gpus and not cuda_device_count():
        return "--share-gpus needs CUDA GPUs, and none is visible"
    if args.iters < 1 or args.start < 0:
        return "--iters must be >= 1 and --start >= 0"
    problem = faults.check_arguments(args)
    if problem:
        return problem
    try:
        EPConfig(num_experts=args.experts, top_k=args.topk, hidden=args.hidden, max_tokens_per_rank=args.max_tokens,
                 dtype=DTYPES[args.dtype], num_sms=args.num_sms)
    except EPConfigError as exc:
        return str(exc)
    return None


def planned_victim(args: argparse.Namespace, world: int) -> Optional[int]:
    """The rank ``--kill`` kills (the launcher then counts its SIGKILL as planned), else None."""
    kill = faults.plan_kill(args, world)
    return None if kill is None else kill.rank


class InjectedError(RuntimeError):
    """What ``--inject-exception`` raises: an ordinary bug in the caller, between two calls."""


# -- the worker -------------------------------------------------------------------------------------------
def worker(args: argparse.Namespace) -> int:
    env = setup_rank(max(300.0, 3 * args.op_timeout), share_gpus=args.share_gpus)
    try:
        code = _stress(env, args)
        # after a kill the default group holds a dead rank: the survivors agreed over their own plane
        return code if getattr(args, "kill", False) else agree_exit_code(env, code)
    finally:
        teardown()


@dataclasses.dataclass
class Stats:
    iterations: int = 0
    fp8: int = 0
    uint8: int = 0
    skewed: int = 0
    zero_token_ranks: int = 0
    tokens: int = 0
    failures: int = 0
    seconds: float = 0.0
    faults: faults.Counts = dataclasses.field(default_factory=faults.Counts)


def _make_comms(env: RankEnv, args: argparse.Namespace, fp8_ok: bool) -> tuple[dict, list[str], int]:
    """One communicator per (backend, layout, quant); returns (comms, notes, exit code so far)."""
    names, explicit, _ = resolve_backend_request(args.backend)
    layouts = ["standard", "batched"] if args.layout == "both" else [args.layout]
    quants = [None, "fp8"] if fp8_ok else [None]
    comms: dict[tuple[str, str, Optional[str]], Communicator] = {}
    notes: list[str] = []
    code = 0
    for name in names:
        for layout in layouts:
            for quant in quants:
                cfg = EPConfig(num_experts=args.experts, top_k=args.topk, hidden=args.hidden,
                               max_tokens_per_rank=args.max_tokens, dtype=DTYPES[args.dtype], layout=layout,
                               backend=name, quant=quant, timeout_s=args.op_timeout,
                               zero_copy=bool(getattr(args, "zero_copy", False)) and layout == "standard",
                               validate_ids=faults.validating(args), num_sms=args.num_sms)
                try:
                    comm = _new_comm(env, cfg)
                except EPTopologyError as exc:
                    msg = f"{name}: not usable here ({exc})"
                    if msg not in notes:
                        notes.append(msg)
                    code = 2 if explicit else code
                    break
                key = (comm.backend, layout, quant)
                if key in comms:  # e.g. "auto" resolved to a backend that is also listed by name
                    comm.close()
                else:
                    comms[key] = comm
    return comms, notes, code


def _new_comm(env: RankEnv, cfg: EPConfig) -> Communicator:
    """Every communicator of the run is made here (collective: a refusal is raised alike on every rank), on
    the rank's device (a GPU on a gloo group with --share-gpus)."""
    return Communicator(cfg, device=env.device)


def _stress(env: RankEnv, args: argparse.Namespace) -> int:
    world = env.world_size
    if args.experts % world:
        say(env, f"error: --experts {args.experts} is not divisible by the world size {world}")
        return 2
    fp8_ok = args.hidden % FP8_BLOCK == 0
    kill = faults.plan_kill(args, world)
    if kill is not None and not 0 <= kill.rank < world:
        say(env, f"error: --kill-rank {kill.rank} is not a rank of the {world}")
        return 2
    # the per-iteration gather of results goes over a control plane too: a peer that dies there is
    # named in a typed error within --op-timeout instead of hanging in the default group.  A faulty
    # iteration may keep a rank in up to three bounded waits (the fault, the next call, a new
    # communicator) while its peers already wait here
    results_plane = ControlPlane(env.cpu_group, args.op_timeout * (3 if args.faults else 1))
    comms: dict = {}
    progress: Optional[stress_report.Progress] = None
    reason = "closed"
    try:
        comms, notes, code = _make_comms(env, args, fp8_ok)
        for note in notes:
            say(env, f"note: {note}")
        if code or not comms:
            say(env, "error: a requested backend is not usable" if comms else "error: no requested backend is usable")
            return code or 2
        # a survivor stuck where no error reaches it (a device sync behind a dead peer's NCCL kernel)
        # ends itself; on CPU the pending gloo call fails at once, so there it is only a late backstop.
        # The planned victim's death gives the survivors time to raise (kernel backends: timeout_s + a
        # few s) and to meet for the shrink (up to 2 x timeout_s + 5 s each)
        watch = PeerWatch(results_plane, "ep-comm stress",
                          grace_s=2.0 if env.device.type == "cuda" else args.op_timeout + 5,
                          expected=() if kill is None else (kill.rank,), expected_grace_s=6 * args.op_timeout + 60)
        variants = sorted({(b, lay) for b, lay, _ in comms})
        where = f"{env.device.type}, GPUs shared" if args.share_gpus else env.device.type
        say(env, f"ep-comm stress: {world} ranks ({env.launcher}, {where}), {args.iters} iterations from "
                 f"{args.start}, seed {args.seed}, hidden {args.hidden}, top-{args.topk} of {args.experts} experts, "
                 f"max {args.max_tokens} tokens/rank, {args.dtype}; variants: "
                 + ", ".join(f"{b}/{lay}" for b, lay in variants) + ("" if fp8_ok else "; fp8 off (hidden % 128 != 0)")
                 + (f"; faults in {args.fault_rate:g} of the iterations, validate_ids {args.validate_ids}"
                    if args.faults else "")
                 + (f"; rank {kill.rank} is killed in iteration {kill.iteration}" if kill is not None else ""))
        stats = {v: Stats() for v in variants}
        failed_cases: list[tuple[stress_cases.Case, list]] = []
        injected: list[faults.Fault] = []
        shown: set = set()  # variants whose first fault not survived in place was printed
        active = list(range(world))
        lead = env.is_root  # prints: rank 0, or the lowest survivor once rank 0 is killed
        outcome: Optional[stress_kill.KillOutcome] = None
        switch = (stress_kill.KillSwitch(stress_kill.kill_record_path(results_plane))
                  if kill is not None and env.rank == kill.rank else None)
        progress = stress_report.Progress(args.iters, enabled=lead)
        t_start = time.perf_counter()
        for it in range(args.start, args.start + args.iters):
            if not variants:  # every variant was dropped (no new communicator after a fault, or no shrink)
                break
            case = stress_cases.plan(args, it, world, fp8_ok)
            killing = kill is not None and outcome is None and it == kill.iteration
            fault = faults.plan_fault(args, it, world, args.experts, active) if args.faults and not killing else None
            records: list = []
            t_iter = time.time()
            if killing and switch is not None and kill is not None:
                done = it - args.start
                switch.arm(kill.fraction * ((time.perf_counter() - t_start) / done if done else 0.01))
            try:
                _run_case(env, args, comms, variants, case, stats, fault, active, records)
                if killing and switch is not None:
                    switch.fire()  # the timer has not fired yet: die before this iteration's results are shared
                stress_kill.at("the results gather")
                everyone = results_plane.gather_objects(records)  # [(backend, layout, [problems], trace)] per rank
            except EPTimeoutError as exc:
                if not killing or kill is None:
                    raise
                results_plane, outcome = stress_kill.survive_kill(env, args, kill, exc, t_iter, comms, variants,
                                                                  results_plane)
                watch.rebind(results_plane)
                active = list(results_plane.labels)
                if results_plane.me == active[0] and not lead:
                    lead = progress.enabled = True
                    progress.done = it - args.start
                if lead:
                    progress.clear()
                    stress_kill.print_kill(outcome)
                everyone = results_plane.gather_objects(records)
            labels = results_plane.labels
            bad = [(labels[i], b, lay, ps) for i, recs in enumerate(everyone) for b, lay, ps, _ in recs if ps]
            wrong: list = []
            if fault is not None:
                injected.append(fault)
                counts = {v: st.faults for v, st in stats.items()}
                wrong, renew = faults.verdicts(fault, everyone, counts, faults.validating(args), args.op_timeout,
                                               labels)
                fresh = [(v, errors) for v, errors in renew if v not in shown]
                if fresh and lead:
                    progress.clear()
                    stress_report.print_not_survived(env, args, fault, fresh)
                shown.update(v for v, _ in renew)
                if renew:
                    again = _renew(env, args, comms, variants, [v for v, _ in renew], case, active)
                    bad += [(labels[i], b, lay, ps) for i, recs in enumerate(results_plane.gather_objects(again))
                            for b, lay, ps in recs if ps]
            for variant in {(b, lay) for _, b, lay, _ in bad}:
                stats[variant].failures += 1
            failing = bool(bad or wrong)
            if outcome is not None and it > outcome.kill.iteration:
                outcome.iterations += 1
                outcome.failing += failing
                outcome.faults += fault is not None
            progress.update(len(failed_cases) + failing)
            if failing:
                failed_cases.append((case, bad + wrong))
                if lead:
                    progress.clear()
                    stress_report.print_failure(env, args, case, fault, bad, wrong)
                if not args.keep_going:
                    break
        watch.stop()  # from here on, a peer that finished first and exited is no failure
        if progress is not None:
            progress.close()
        elapsed = time.perf_counter() - t_start
        if lead:
            stress_report.print_summary(env, args, stats, failed_cases, elapsed, injected, kill, outcome)
        not_survived = any(st.faults.new_comm for st in stats.values())
        kill_failed = kill is not None and (outcome.wrong() if outcome is not None else not failed_cases)
        code = 1 if failed_cases or not_survived or kill_failed else 0
        if kill is not None:
            code = max(int(c) for c in results_plane.gather_objects(code))
        return code
    except BaseException as exc:
        # a lost peer (EPTimeoutError) or a bug here: this rank fails, and the reason it leaves with
        # reaches the peers still waiting on it
        reason = f"closed after {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        raise
    finally:
        if progress is not None:
            progress.close()
        for comm in comms.values():
            comm.close(reason)
        results_plane.close(reason)


def _run_case(env: RankEnv, args: argparse.Namespace, comms: dict, variants: list, case: stress_cases.Case, stats: dict,
              fault: Optional[faults.Fault], active: list[int],
              records: list[tuple[str, str, list[str], Optional[faults.Trace]]]) -> None:
    """Every variant on this case (after the fault, if any); appends this rank's (backend, layout,
    problems, fault trace) records to ``records`` as each variant ends (a call that raises leaves
    those of the variants before it)."""
    rank, world = env.rank, env.world_size
    cfg = next(c.cfg for (_, _, q), c in comms.items() if q == case.quant)
    inputs = stress_cases.case_inputs(cfg, case)
    expected = _expected(cfg, inputs, rank, active)
    mine = inputs[rank].to(env.device)
    bad_inputs = faults.faulty_inputs(cfg, inputs, fault) if fault is not None else []
    for i, (backend, layout) in enumerate(variants):
        comm = comms[(backend, layout, case.quant)]
        st = stats[(backend, layout)]
        st.iterations += 1
        st.fp8 += case.quant == "fp8"
        st.uint8 += case.payload == "uint8"
        st.skewed += case.routing == "skewed"
        st.zero_token_ranks += case.tokens.count(0)
        st.tokens += sum(case.tokens)
        t0 = time.perf_counter()
        trace: Optional[faults.Trace] = None
        if fault is None:
            problems = _checked_call(env, args, comm, case, i, mine, expected)
        else:
            stress_kill.at(f"{backend}/{layout} faulty call")
            trace = faults.attempt(comm, fault, rank, world, bad_inputs, faults.validating(args))
            problems = _after_fault(env, args, comm, case, i, mine, expected, fault, trace)
        st.seconds += time.perf_counter() - t0
        records.append((backend, layout, problems, trace))


def _expected(cfg: EPConfig, inputs: list[oracle.RankInput], rank: int,
              active: list[int]) -> tuple[oracle.ExpectedRank, torch.Tensor, Optional[int]]:
    """This rank's expected dispatch, combine and ``inactive_pairs`` (None while every rank is active;
    then a rank's combine output needs only its own inputs)."""
    if len(active) == len(inputs):
        return oracle.expected_dispatch(cfg, inputs)[rank], oracle.expected_combine_rank(cfg, inputs, rank), None
    return (oracle.expected_dispatch(cfg, inputs, active)[rank],
            oracle.expected_combine_rank(cfg, inputs, rank, active_ranks=active),
            oracle.expected_inactive_pairs(cfg, inputs, active)[rank])


def _valid_call(env: RankEnv, args: argparse.Namespace, comm: Communicator, case: stress_cases.Case, i: int,
                mine: oracle.RankInput, expected: tuple) -> list[str]:
    """One dispatch + combine of the case on ``comm``, compared with the oracle; the library's errors pass."""
    rank, world = env.rank, env.world_size
    expected_d, expected_y, expected_pairs = expected
    tag = f"{comm.backend}/{comm.cfg.layout}"
    # every other iteration x is written into the input buffer (kernel backends: sent in place)
    x = written_to_input_buffer(comm, mine.x) if comm.cfg.zero_copy and case.iteration % 2 else mine.x
    stress_kill.at(f"{tag} dispatch")
    d = comm.dispatch(x, mine.topk_ids, mine.topk_weights, mine.x_scales)
    stress_kill.at(f"{tag} checking the dispatch")
    problems = [f"dispatch: {p}" for p in oracle.compare_dispatch(comm.cfg, d, expected_d)]
    problems += _inactive_pairs_problems(d, expected_pairs)
    if args.inject_exception and case.iteration == stress_cases.fault_iteration(args) and i == 0 and rank == world - 1:
        raise InjectedError(f"injected by --inject-exception on rank {rank} in iteration {case.iteration}, "
                            f"between dispatch and combine, at unix time {time.time():.3f}")
    expert_out = oracle.run_experts(comm.cfg, rank, world, d)
    stress_kill.at(f"{tag} combine")
    y = comm.combine(expert_out, d)
    stress_kill.at(f"{tag} checking the combine")
    if args.inject_fault and case.iteration == stress_cases.fault_iteration(args) and i == 0 and rank == world - 1:
        y[0] += 1.0  # deliberate corruption: proves a wrong combine fails the run
    problems += [f"combine: {p}" for p in oracle.compare_combine(comm.cfg, y, expected_y)]
    return problems


def _inactive_pairs_problems(d: Any, expected: Optional[int]) -> list[str]:
    got = getattr(d, "inactive_pairs", None)
    if expected is None:
        return [] if got is None else [f"dispatch: inactive_pairs is {got!r} while every rank is active"]
    if not isinstance(got, torch.Tensor) or got.dim() != 0 or got.dtype != torch.int64:
        return [f"dispatch: inactive_pairs is {got!r}, expected a 0-dim int64 tensor holding {expected}"]
    count = int(got)
    return [] if count == expected else [f"dispatch: inactive_pairs {count}, expected {expected}"]


def _checked_call(env: RankEnv, args: argparse.Namespace, comm: Communicator, case: stress_cases.Case, i: int,
                  mine: oracle.RankInput, expected: tuple) -> list[str]:
    """``_valid_call`` with the library's errors as problems, but for a lost peer."""
    try:
        return _valid_call(env, args, comm, case, i, mine, expected)
    except (EPTimeoutError, InjectedError):
        raise  # a peer is gone (or this rank is the one failing): no further collective can work
    except Exception as exc:  # noqa: BLE001 - any failure of the library is a finding, reported with its case
        return [f"{type(exc).__name__}: {exc}"]


def _after_fault(env: RankEnv, args: argparse.Namespace, comm: Communicator, case: stress_cases.Case, i: int,
                 mine: oracle.RankInput, expected: tuple, fault: faults.Fault, trace: faults.Trace) -> list[str]:
    """The valid call on the communicator that just had the fault.  Where it raises, ``trace`` says so
    (the fault was not survived in place) and it is made again on a new communicator (``_renew``)."""
    validate = faults.validating(args)
    outcome = _attempt(env, args, comm, case, i, mine, expected)
    if isinstance(outcome, BaseException) and faults.reported_by_next_call(fault, validate, trace, outcome):
        trace.answers.append(faults.Answer.of("next call", outcome))
        outcome = _attempt(env, args, comm, case, i, mine, expected)
    if isinstance(outcome, BaseException):
        trace.recovery_error = f"{type(outcome).__name__}: {outcome}"
        return []
    faults.backstop(comm, fault, validate, trace)
    return [f"next call after the fault: {p}" for p in outcome]


def _attempt(env: RankEnv, args: argparse.Namespace, comm: Communicator, case: stress_cases.Case, i: int,
             mine: oracle.RankInput, expected: tuple) -> Union[list[str], Exception]:
    """``_valid_call``'s problems, or what it raised; a timeout naming lost ranks ends the run."""
    try:
        return _valid_call(env, args, comm, case, i, mine, expected)
    except InjectedError:
        raise
    except EPTimeoutError as exc:
        if exc.lost_ranks:
            raise
        return exc
    except Exception as exc:  # noqa: BLE001 - the verdict on the fault reads it
        return exc


def _renew(env: RankEnv, args: argparse.Namespace, comms: dict, variants: list, renew: list,
           case: stress_cases.Case, active: list[int]) -> list[tuple[str, str, list[str]]]:
    """Replace the communicators that did not survive the fault (closed, then created again: collective,
    in the same order on every rank) and make the case's valid call on each; returns this rank's
    (backend, layout, problems) records.  After a kill no new communicator can be made (creating one
    is collective over the default group, dead rank included): the variant is dropped."""
    cfg = next(c.cfg for (_, _, q), c in comms.items() if q == case.quant)
    inputs = stress_cases.case_inputs(cfg, case)
    expected = _expected(cfg, inputs, env.rank, active)
    mine = inputs[env.rank].to(env.device)
    records = []
    for backend, layout in renew:
        key = (backend, layout, case.quant)
        old = comms.pop(key)
        old.close("closed after a fault it did not survive")
        if len(active) < env.world_size:
            records.append((backend, layout, ["no new communicator after the fault: a rank was killed, and a new "
                                              "one needs every rank of the default group; variant dropped"]))
            for k in [k for k in comms if k[:2] == (backend, layout)]:
                comms.pop(k).close("its variant was dropped")
            variants.remove((backend, layout))
            continue
        try:
            comms[key] = _new_comm(env, dataclasses.replace(old.cfg, backend=backend))
        except EPTimeoutError:
            raise
        except EPError as exc:
            # creation is all-or-nothing: every rank drops the variant alike
            records.append((backend, layout, [f"no new communicator after the fault: {type(exc).__name__}: {exc}"]))
            for k in [k for k in comms if k[:2] == (backend, layout)]:
                comms.pop(k).close("its variant was dropped")
            variants.remove((backend, layout))
            continue
        problems = _checked_call(env, args, comms[key], case, variants.index((backend, layout)), mine, expected)
        records.append((backend, layout, [f"on a new communicator after the fault: {p}" for p in problems]))
    return records
