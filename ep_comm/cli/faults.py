"""``ep-comm stress --faults``: bad input on random ranks, mixed into the valid rounds.

An iteration is faulty with chance ``--fault-rate``, drawn from ``(--seed, iteration)`` by a random
stream of its own, so the valid cases are the same with or without ``--faults`` and ``--start K
--iters 1`` replays iteration K's fault too.  A faulty iteration picks one kind and one or more ranks,
and on every variant makes one call with that input before the iteration's valid call:

  bad_id         an expert id < -1 or >= num_experts in topk_ids
  hidden         x of cfg.dtype whose width is not hidden
  tokens         T > max_tokens_per_rank
  ids_dtype      topk_ids of a dtype other than int32/int64
  weights_dtype  topk_weights of a dtype other than float32
  expert_out     combine given expert_out of a wrong shape

What every rank must answer (docs/design.md §8, §9):

* a typed ``EPError`` from the faulty call: the faulty rank the precise ``EPInputError`` (it names
  what is wrong), every other rank one naming the faulty rank(s).  A rank whose dispatch and combine
  both returned is asked with ``check_errors()``, where the kernel backends' peers learn of an abort
  at the latest.  No error, an untyped one, an ``EPTimeoutError``, or an answer slower than
  ``--op-timeout`` is a wrong answer;
* with ``--validate-ids off`` a bad id is sent as -1, so the faulty call's results must match the
  oracle with those ids as -1, and the faulty rank must raise an ``EPInputError`` by a later call or
  ``check_errors()`` (the fault draws which of the two the tool tries first); the other ranks may raise
  one naming it, nothing else.

Then the iteration's valid call runs on the same communicator and must match the oracle: the fault
was survived in place.  Where that call raises (a backend that refuses every call after bad input),
the fault was not survived: every rank closes that communicator, creates a new one, makes the valid
call on it, and the run fails.
"""
from __future__ import annotations

import argparse
import dataclasses
import random
import re
import time
from typing import Any, Callable, Optional, Sequence

import torch

from .. import oracle
from ..config import EPConfig
from ..errors import EPError, EPInputError, EPTimeoutError
from ..layouts import Dispatched
from ..routing import invalid_id_mask

KINDS = ("bad_id", "hidden", "tokens", "ids_dtype", "weights_dtype", "expert_out")
#: with --validate-ids off: where the tool looks for the report of dropped ids first
REPORT_PATHS = ("check_errors", "next call")
DEFAULT_RATE = 0.2

#: words the faulty rank's own error must contain, per kind (a bad id's value is added when validated)
_PRECISE = {
    "bad_id": ("topk_ids",),
    "hidden": ("hidden",),
    "tokens": ("max_tokens_per_rank",),
    "ids_dtype": ("topk_ids", "dtype"),
    "weights_dtype": ("topk_weights", "dtype"),
    "expert_out": ("expert_out",),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--faults", action="store_true",
                   help="mix bad input on random ranks into the rounds (bad expert id, hidden size, T > max, "
                        "ids/weights dtype, expert_out shape); every rank must raise a typed error and the next "
                        "call on the same communicator must match the oracle")
    p.add_argument("--fault-rate", type=float, default=None, metavar="P",
                   help=f"with --faults: chance that an iteration is faulty (default: {DEFAULT_RATE})")
    p.add_argument("--validate-ids", choices=("on", "off"), default="on",
                   help="EPConfig.validate_ids (default: on); off: bad ids are sent as -1 and raised by a later "
                        "call or check_errors()")
    p.add_argument("--kill", action="store_true",
                   help="kill one rank with SIGKILL in the middle of an iteration; the survivors must raise "
                        "EPTimeoutError naming it in lost_ranks, shrink every communicator and run the remaining "
                        "iterations over the survivors (ranks spawned by ep-comm itself: torchrun, mpirun and srun "
                        "end the job when a rank dies)")
    p.add_argument("--kill-rank", type=int, default=None, metavar="R",
                   help="with --kill: the rank killed (default: drawn from --seed)")
    p.add_argument("--kill-at", type=int, default=None, metavar="K",
                   help="with --kill: the iteration it dies in (default: drawn from --seed, in the middle half of "
                        "the run)")


def check_arguments(args: argparse.Namespace) -> Optional[str]:
    if args.fault_rate is not None and not args.faults:
        return "--fault-rate needs --faults"
    if args.fault_rate is None:
        args.fault_rate = DEFAULT_RATE
    if not 0.0 < args.fault_rate <= 1.0:
        return f"--fault-rate must be in (0, 1], got {args.fault_rate}"
    return check_kill_arguments(args)


def check_kill_arguments(args: argparse.Namespace) -> Optional[str]:
    if not getattr(args, "kill", False):
        if getattr(args, "kill_rank", None) is not None or getattr(args, "kill_at", None) is not None:
            return "--kill-rank and --kill-at need --kill"
        return None
    from .launcher import default_nproc, external_launch

    launched = external_launch()
    if launched is not None:
        return (f"--kill needs ranks started by ep-comm itself (--nproc): {launched.launcher} ends the whole job "
                "when one rank dies")
    world = args.nproc if args.nproc is not None else default_nproc()
    if world < 2:
        return "--kill needs at least 2 ranks (one to kill, one to go on)"
    if args.kill_rank is not None and not 0 <= args.kill_rank < world:
        return f"--kill-rank must be in [0, {world}), got {args.kill_rank}"
    if args.kill_at is not None and not args.start <= args.kill_at < args.start + args.iters:
        return f"--kill-at must be one of the run's iterations [{args.start}, {args.start + args.iters}), got " \
               f"{args.kill_at}"
    return None


@dataclasses.dataclass(frozen=True)
class Kill:
    """The rank killed, the iteration it dies in, and when in that iteration (a fraction of an
    iteration's mean duration after it starts; it dies at the iteration's last call at the latest)."""

    rank: int
    iteration: int
    fraction: float


def plan_kill(args: argparse.Namespace, world: int) -> Optional[Kill]:
    """``--kill``'s plan from ``--seed`` (and ``--kill-rank`` / ``--kill-at``), the same in every process."""
    if not getattr(args, "kill", False):
        return None
    rng = random.Random(f"ep-comm-stress-kill:{args.seed}")
    rank = rng.randrange(world)  # every draw is made, so --kill-rank leaves the iteration drawn as it was
    lo = args.start + args.iters // 4
    iteration = rng.randint(lo, max(lo, args.start + (3 * args.iters) // 4 - 1))
    fraction = rng.random()
    return Kill(args.kill_rank if args.kill_rank is not None else rank,
                args.kill_at if args.kill_at is not None else iteration, fraction)


def validating(args: argparse.Namespace) -> bool:
    return getattr(args, "validate_ids", "on") == "on"


@dataclasses.dataclass(frozen=True)
class Fault:
    """One faulty call, the same on every rank and every variant of its iteration."""

    iteration: int
    kind: str
    ranks: tuple[int, ...]
    value: int  # bad_id: the out-of-range id written into topk_ids
    report: str  # bad_id with validation off: "check_errors" or "next call" (REPORT_PATHS)
    seed: int  # the corrupted tensors' data

    @property
    def stage(self) -> str:
        return "combine" if self.kind == "expert_out" else "dispatch"

    def lenient(self, validate: bool) -> bool:
        """Bad ids sent as -1 (validation off): the call succeeds and a later one reports them."""
        return self.kind == "bad_id" and not validate

    def describe(self, validate: bool) -> str:
        what = {
            "bad_id": f"topk_ids holding {self.value}",
            "hidden": "x whose width is not hidden",
            "tokens": "T > max_tokens_per_rank",
            "ids_dtype": "topk_ids of a wrong dtype",
            "weights_dtype": "topk_weights of a wrong dtype",
            "expert_out": "combine with expert_out of a wrong shape",
        }[self.kind]
        tail = f", validate_ids off, reported by {self.report} first" if self.lenient(validate) else ""
        return f"fault {self.kind} on rank(s) {list(self.ranks)}: {what}{tail}"


def plan_fault(args: argparse.Namespace, iteration: int, world: int, num_experts: int,
               active: Optional[Sequence[int]] = None) -> Optional[Fault]:
    """The iteration's fault or None, from ``(seed, iteration)`` only (every draw is made whatever the
    outcome, so the stream does not depend on the kind).  ``active``: the ranks a fault may fall on
    (after a shrink; default every rank, which draws the same stream as ``range(world)``)."""
    pool = list(range(world)) if active is None else sorted(active)
    rng = random.Random(f"ep-comm-stress-faults:{args.seed}:{iteration}")
    faulty = rng.random() < args.fault_rate
    kind = rng.choice(KINDS)
    n = len(pool)
    count = 1 if n == 1 or rng.random() < 0.75 else rng.randint(2, n)
    ranks = tuple(sorted(rng.sample(pool, count)))
    value = rng.choice((-2, -2**31, num_experts, 2**31 - 1, -3 - rng.randrange(1000),
                        num_experts + 1 + rng.randrange(1000)))
    report = rng.choice(REPORT_PATHS)
    seed = rng.randrange(2**31)
    return Fault(iteration, kind, ranks, value, report, seed) if faulty else None


# -- the faulty input -----------------------------------------------------------------------------------
def faulty_inputs(cfg: EPConfig, inputs: Sequence[oracle.RankInput], fault: Fault) -> list[oracle.RankInput]:
    """Every rank's dispatch arguments of the faulty call: the valid case's, corrupted on the faulty
    ranks for a dispatch fault (deterministic: every rank builds the same list)."""
    out = list(inputs)
    if fault.stage != "dispatch":
        return out
    for r in fault.ranks:
        out[r] = _corrupted(cfg, inputs[r], fault, random.Random(f"{fault.seed}:{r}"),
                            torch.Generator().manual_seed(fault.seed + r))
    return out


def _corrupted(cfg: EPConfig, inp: oracle.RankInput, fault: Fault, rng: random.Random,
               g: torch.Generator) -> oracle.RankInput:
    x, ids, w, s = inp.x, inp.topk_ids, inp.topk_weights, inp.x_scales
    t, k = ids.shape
    if fault.kind == "bad_id":
        if t == 0:  # a bad id needs a token: one with the case's payload and valid ids
            x, w = torch.zeros(1, x.shape[1], dtype=x.dtype), torch.full((1, k), 1.0 / k)
            ids = (torch.arange(k) % cfg.num_experts).to(ids.dtype).unsqueeze(0)
            s = None if s is None else torch.zeros(1, s.shape[1], dtype=s.dtype)
            t = 1
        ids = ids.clone()
        for flat in rng.sample(range(t * k), min(t * k, rng.randint(1, 3))):
            ids[flat // k, flat % k] = fault.value
        return oracle.RankInput(x, ids, w, s)
    if fault.kind == "hidden":
        # of cfg.dtype, which every config takes as activations (fp8 quantises from it): only the width is wrong
        h = cfg.hidden
        width = rng.choice([n for n in (h + 1, h + 128, h - 1, h // 2) if n >= 1 and n != h])
        return oracle.RankInput(torch.randn(t, width, generator=g).to(cfg.dtype), ids, w, s)
    if fault.kind == "tokens":
        n = cfg.max_tokens_per_rank + rng.randint(1, 8)
        x2 = torch.zeros(n, x.shape[1], dtype=x.dtype)
        ids2 = torch.randint(0, cfg.num_experts, (n, k), generator=g).to(ids.dtype)
        s2 = None if s is None else torch.zeros(n, s.shape[1], dtype=s.dtype)
        return oracle.RankInput(x2, ids2, torch.rand(n, k, generator=g) + 0.05, s2)
    if fault.kind == "ids_dtype":
        return oracle.RankInput(x, ids.to(rng.choice((torch.int16, torch.int8, torch.float32, torch.float64))), w, s)
    if fault.kind == "weights_dtype":
        return oracle.RankInput(x, ids, w.to(rng.choice((torch.float16, torch.bfloat16, torch.float64))), s)
    raise ValueError(f"not a dispatch fault: {fault.kind}")


def wrong_expert_out(expert_out: torch.Tensor, fault: Fault, rank: int) -> torch.Tensor:
    """``expert_out`` of a shape combine must refuse (a row or a channel more or less, or one dim more or
    fewer)."""
    rng = random.Random(f"{fault.seed}:{rank}")
    shape = list(expert_out.shape)
    choice = rng.randrange(4)
    if choice == 0:
        shape[-1] += 1
    elif choice == 1:
        shape[-1] = shape[-1] - 1 if shape[-1] > 1 else 2
    elif choice == 2:
        shape[0] += 1
    else:
        shape = [1, *shape] if len(shape) == 2 else [shape[0] * shape[1], shape[2]]
    return torch.zeros(shape, dtype=expert_out.dtype, device=expert_out.device)


def sanitized(inputs: Sequence[oracle.RankInput], num_experts: int) -> list[oracle.RankInput]:
    """The inputs with out-of-range ids as -1: what a call with validation off sends."""
    out = []
    for inp in inputs:
        ids = inp.topk_ids
        if ids.dtype in (torch.int32, torch.int64) and ids.numel():
            ids = torch.where(invalid_id_mask(ids, num_experts), torch.full_like(ids, -1), ids)
        out.append(oracle.RankInput(inp.x, ids, inp.topk_weights, inp.x_scales))
    return out


# -- one rank's side ------------------------------------------------------------------------------------
@dataclasses.dataclass
class Answer:
    """An error a rank raised for the fault (picklable: the traces are gathered on every rank)."""

    stage: str  # "dispatch", "combine", "check_errors", "next call"
    error: str  # its class name
    message: str
    typed: bool  # an EPError
    input_error: bool  # an EPInputError
    timeout: bool  # an EPTimeoutError

    @classmethod
    def of(cls, stage: str, exc: BaseException) -> Answer:
        return cls(stage, type(exc).__name__, str(exc), isinstance(exc, EPError), isinstance(exc, EPInputError),
                   isinstance(exc, EPTimeoutError))

    def line(self, limit: int = 400) -> str:
        text = f"{self.stage} raised {self.error}: {self.message}"
        return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclasses.dataclass
class Trace:
    """One rank's side of a fault on one variant."""

    answers: list[Answer]
    problems: list[str]  # results of the faulty call that differ from the oracle (bad ids sent as -1)
    seconds: float  # spent in the faulty call's dispatch, combine and check_errors()
    recovery_error: Optional[str] = None  # the valid call after the fault raised this: not survived in place


def attempt(comm, fault: Fault, rank: int, world: int, inputs: Sequence[oracle.RankInput], validate: bool) -> Trace:
    """Make the faulty call on this rank (``inputs``: every rank's, from ``faulty_inputs``)."""
    cfg = comm.cfg
    trace = Trace([], [], 0.0)
    # results are defined where nothing is refused: a combine fault's dispatch, and bad ids sent as -1
    checked = fault.stage == "combine" or fault.lenient(validate)
    active = list(getattr(comm, "active_ranks", range(world)))
    if checked:
        clean = sanitized(inputs, cfg.num_experts)
        if len(active) == world:
            expected_d = oracle.expected_dispatch(cfg, clean)[rank]
            expected_y = oracle.expected_combine_rank(cfg, clean, rank)
        else:  # after a shrink: the experts of inactive ranks are removed
            expected_d = oracle.expected_dispatch(cfg, clean, active)[rank]
            expected_y = oracle.expected_combine_rank(cfg, clean, rank, active_ranks=active)
    mine = inputs[rank].to(comm.device)
    d = _answered(trace, "dispatch", lambda: comm.dispatch(mine.x, mine.topk_ids, mine.topk_weights, mine.x_scales))
    if isinstance(d, Dispatched):
        if checked:
            trace.problems += [f"dispatch: {p}" for p in oracle.compare_dispatch(cfg, d, expected_d)]
            expert_out = oracle.run_experts(cfg, rank, world, d)
        else:
            expert_out = _zeros_out(cfg.hidden, cfg.dtype, d)
            if d.x.device.type == "cuda":
                # as on the valid path, where the oracle reads the dispatch before the combine is issued
                _answered(trace, "dispatch", lambda: torch.cuda.synchronize(d.x.device))
        if fault.stage == "combine" and rank in fault.ranks:
            expert_out = wrong_expert_out(expert_out, fault, rank)
        y = _answered(trace, "combine", lambda: comm.combine(expert_out, d))
        if isinstance(y, torch.Tensor) and fault.lenient(validate):
            trace.problems += [f"combine: {p}" for p in oracle.compare_combine(cfg, y, expected_y)]
    if not trace.answers and not (fault.lenient(validate) and fault.report == "next call"):
        _answered(trace, "check_errors", comm.check_errors)
    return trace


def reported_by_next_call(fault: Fault, validate: bool, trace: Trace, exc: BaseException) -> bool:
    """Whether ``exc``, raised by the valid call right after the fault, is the fault's report: bad ids sent
    as -1 on a rank that had not answered yet (the collective backends raise it on every rank in the next
    dispatch, before it sends).  The valid call is then made again."""
    return fault.lenient(validate) and not trace.answers and isinstance(exc, EPInputError)


def backstop(comm, fault: Fault, validate: bool, trace: Trace) -> None:
    """Bad ids sent as -1 and looked for in the next call first: ``check_errors()`` raises them in any case."""
    if fault.lenient(validate) and fault.report == "next call":
        _answered(trace, "check_errors", comm.check_errors)


def _answered(trace: Trace, stage: str, call: Callable[[], Any]) -> Any:
    """``call()``'s result, or None with its error added to ``trace.answers``; its time is added to
    ``trace.seconds``.  A timeout naming lost ranks is raised: a peer is gone and the run ends, as
    without faults."""
    t0 = time.perf_counter()
    try:
        return call()
    except EPTimeoutError as exc:
        if exc.lost_ranks:
            raise
        trace.answers.append(Answer.of(stage, exc))
    except Exception as exc:  # noqa: BLE001 - whatever it is, the judge decides whether it was right
        trace.answers.append(Answer.of(stage, exc))
    finally:
        trace.seconds += time.perf_counter() - t0
    return None


def _zeros_out(hidden: int, dtype: torch.dtype, d: Dispatched) -> torch.Tensor:
    """Expert outputs of the right shape (the faulty call's combine results are not compared)."""
    shape = (*d.x.shape[:2], hidden) if d.layout == "batched" else (d.x.shape[0], hidden)
    return torch.zeros(shape, dtype=dtype, device=d.x.device)


# -- the verdict, from every rank's trace ---------------------------------------------------------------
_RANK_LIST = re.compile(r"\branks?(?:\(s\))? \[([0-9, ]*)\]")
_RANK_ONE = re.compile(r"\branks? (\d+)\b")


def named_ranks(message: str) -> set[int]:
    """The ranks a message names ("rank 3", "rank(s) [1, 2]")."""
    named = {int(m) for m in _RANK_ONE.findall(message)}
    for group in _RANK_LIST.findall(message):
        named |= {int(n) for n in group.replace(",", " ").split()}
    return named


def precise_words(fault: Fault, validate: bool) -> tuple[str, ...]:
    words = _PRECISE[fault.kind]
    return (*words, str(fault.value)) if fault.kind == "bad_id" and validate else words


def judge(fault: Fault, traces: Sequence[Trace], validate: bool, op_timeout: float,
          ranks: Optional[Sequence[int]] = None) -> list[tuple[int, str]]:
    """``(rank, problem)`` for every way a rank's answer differs from what the contract says.
    ``ranks``: the rank of each trace (after a shrink: the active ranks; default their index)."""
    out: list[tuple[int, str]] = []
    for i, tr in enumerate(traces):
        r = i if ranks is None else ranks[i]
        faulty = r in fault.ranks
        out += [(r, f"faulty call's results: {p}") for p in tr.problems]
        if tr.seconds > op_timeout:
            out.append((r, f"answered after {tr.seconds:.1f} s, more than --op-timeout {op_timeout:g} s"))
        for a in tr.answers:
            if not a.typed:
                out.append((r, f"untyped error: {a.line()}"))
            elif a.timeout:
                out.append((r, f"timed out instead of naming the faulty rank(s): {a.line()}"))
        typed = [a for a in tr.answers if a.typed and not a.timeout]
        if fault.lenient(validate):
            if faulty and not any(a.input_error and "topk_ids" in a.message for a in typed):
                out.append((r, "no EPInputError for the ids sent as -1 by the next call or check_errors()"))
            for a in typed:
                if not a.input_error or not (faulty or set(fault.ranks) <= named_ranks(a.message)):
                    out.append((r, f"unexpected error: {a.line()}"))
            continue
        if not tr.answers:
            out.append((r, "no error: dispatch, combine and check_errors() all returned"))
            continue
        first = tr.answers[0]
        if not first.typed or first.timeout:
            continue  # said above
        if faulty:
            words = precise_words(fault, validate)
            if not first.input_error or not all(w in first.message for w in words):
                out.append((r, f"not the precise EPInputError (naming {', '.join(words)}): {first.line()}"))
        else:
            missing = set(fault.ranks) - named_ranks(first.message)
            if missing:
                out.append((r, f"does not name faulty rank(s) {sorted(missing)}: {first.line()}"))
    return out


@dataclasses.dataclass
class Counts:
    """Faults on one variant."""

    injected: int = 0
    wrong: int = 0  # some rank did not answer as the contract says
    in_place: int = 0  # the next call on the same communicator worked
    new_comm: int = 0  # it raised: a new communicator was created
    lost: list[Fault] = dataclasses.field(default_factory=list)  # the faults behind new_comm


def verdicts(fault: Fault, everyone: Sequence[Sequence[tuple]], counts: dict[tuple[str, str], Counts], validate: bool,
             op_timeout: float, ranks: Optional[Sequence[int]] = None) -> tuple[list, list]:
    """Every variant's verdict on the fault, the same on every rank (it reads only the gathered records
    ``[(backend, layout, problems, trace)]`` per rank), added to ``counts``.  Returns the wrong answers as
    ``(rank, backend, layout, [problem])`` and the variants whose next call raised, with each rank's error.
    ``ranks``: the rank of each entry of ``everyone`` (as in ``judge``)."""
    label = (lambda i: i) if ranks is None else (lambda i: ranks[i])
    traces: dict[tuple[str, str], list[Trace]] = {}
    for recs in everyone:
        for backend, layout, _, trace in recs:
            traces.setdefault((backend, layout), []).append(trace)
    wrong: list[tuple[int, str, str, list[str]]] = []
    renew: list[tuple[tuple[str, str], list[tuple[int, str]]]] = []
    for variant, per_rank in traces.items():
        c = counts[variant]
        c.injected += 1
        problems = judge(fault, per_rank, validate, op_timeout, ranks)
        c.wrong += bool(problems)
        wrong += [(r, *variant, [f"fault: {p}"]) for r, p in problems]
        errors = [(label(i), t.recovery_error) for i, t in enumerate(per_rank) if t.recovery_error]
        if errors:
            c.new_comm += 1
            c.lost.append(fault)
            renew.append((variant, errors))
        else:
            c.in_place += 1
    return wrong, renew


def tally_kinds(faults: Sequence[Fault]) -> str:
    """``bad_id 12, hidden 9, ...`` in KINDS order."""
    counts = {k: 0 for k in KINDS}
    for f in faults:
        counts[f.kind] += 1
    return ", ".join(f"{k} {n}" for k, n in counts.items())
