"""Rank-side bodies of the zero-copy tests (kernel backends, standard layout): received rows and expert
outputs stay in the communicator's buffer.  As in ``cases``, each returns ``{case name: [problems]}``."""
from __future__ import annotations

import itertools
import os

import torch

import ep_comm
from ep_comm import oracle
from ep_comm.backends.one_sided.layout import COMBINE_PULL_ENV

from .cases import (
    EXPERTS_PER_RANK,
    PAYLOADS,
    WIDE_HIDDEN,
    backend_matrix,
    combine,
    dispatch,
    graph_capture,
    init_rank,
    input_in_place,
    make_cfg,
    run_case,
    scenarios,
    wide_rows_matrix,
)


# -- zero copy (standard layout): the rows are views of the receive buffer -------------------------------
def zero_copy_case_names(backend: str, in_place: bool = False) -> list[str]:
    """The keys ``zero_copy_matrix`` reports for ``backend``: the standard matrix and the views check
    (``in_place``: and the input buffer's check)."""
    return [f"{backend}/standard/{p}/{s}" for p in PAYLOADS for s in scenarios(2, 16)] + \
        [f"{backend}/standard/zero_copy_views"] + ([f"{backend}/standard/input_in_place"] if in_place else [])


def force_pull(pull: bool) -> None:
    """Zero-copy combines pull (or push) whatever the tests' small max_tokens_per_rank (set in the
    spawned rank before its communicators are made)."""
    os.environ[COMBINE_PULL_ENV] = "1" if pull else "0"


def zero_copy_matrix(backends=("mnnvl",), hooks: bool = False, pull: bool = True, in_place: bool = False) -> dict:
    """The standard matrix with ``zero_copy=True`` (repeated: every call reuses the one half of the
    buffer), then: the returned rows are views of this rank's buffer, and a second dispatch before the
    combine of the first is refused on every rank.  Combines pull unless ``pull`` is False;
    ``in_place``: x is written into ``dispatch_input_buffer`` (and that buffer is checked)."""
    force_pull(pull)
    input_in_place(in_place)
    results = backend_matrix(backends, ("standard",), 2, hooks, zero_copy=True)
    topo, device = init_rank()
    world, rank = topo.world_size, topo.rank
    for backend in backends:
        problems: list[str] = []
        cfg = make_cfg(world, backend, "standard", "fp8", zero_copy=True)
        with ep_comm.Communicator(cfg, device=device) as comm:
            mine = oracle.random_inputs(cfg, world, 5)[rank].to(comm.device)
            d = dispatch(comm, hooks, mine.x, mine.topk_ids, mine.topk_weights)
            buf = comm._impl.buffer.local
            lo, hi = buf.data_ptr(), buf.data_ptr() + buf.numel()
            for name, t in (("x", d.x), ("x_scales", d.x_scales)):
                if not lo <= t.data_ptr() < hi:
                    problems.append(f"{name} is not a view of the receive buffer")
            if d.x.shape != (world * cfg.max_tokens_per_rank, cfg.hidden) or d.x.stride(1) != 1:
                problems.append(f"x shape {tuple(d.x.shape)} stride {d.x.stride()}")
            if d.handle.outputs[0].numel():
                problems.append(f"the op still returned {d.handle.outputs[0].shape[0]} rows of its own")
            try:
                dispatch(comm, hooks, mine.x, mine.topk_ids, mine.topk_weights)
                problems.append("a dispatch before the combine of the previous one was not refused")
            except ep_comm.EPError as exc:
                if "zero_copy" not in str(exc):
                    problems.append(f"unexpected refusal: {exc}")
            torch.cuda.synchronize()
        # an odd number of calls between two dispatches (one Dispatched combined twice is allowed): the
        # rows must still land where the views are (every call uses dispatch half 0)
        with ep_comm.Communicator(cfg, device=device) as comm:
            for seed in (21, 22):
                inputs = oracle.random_inputs(cfg, world, seed)
                mine = inputs[rank].to(comm.device)
                d = dispatch(comm, hooks, mine.x, mine.topk_ids, mine.topk_weights)
                problems += [f"seed {seed} dispatch: {p}" for p in
                             oracle.compare_dispatch(cfg, d, oracle.expected_dispatch(cfg, inputs)[rank])]
                expert_out = oracle.run_experts(cfg, rank, world, d)
                for _ in range(2):
                    y = combine(comm, hooks, expert_out, d)
                    problems += [f"seed {seed} combine: {p}" for p in
                                 oracle.compare_combine(cfg, y, oracle.expected_combine_rank(cfg, inputs, rank))]
            problems += _expert_output_buffer_problems(comm, cfg, world, rank, hooks)
        results[f"{backend}/standard/zero_copy_views"] = problems
        if in_place:
            results[f"{backend}/standard/input_in_place"] = _input_buffer_problems(backend, world, rank, device, hooks)
    return results


def _input_buffer_problems(backend: str, world: int, rank: int, device, hooks: bool) -> list[str]:
    """``dispatch_input_buffer`` with zero copy: this rank's own rows of the receive buffer, the same
    every call, taken in place by dispatch (T = max, max - 1, 1); x overlapping it any other way
    (shifted by a row) is copied first and still dispatched right; with fp8 quantisation it is a
    tensor of its own."""
    problems: list[str] = []
    cfg = make_cfg(world, backend, "standard", None, zero_copy=True)
    m = cfg.max_tokens_per_rank
    with ep_comm.Communicator(cfg, device=device) as comm:
        local = comm._impl.buffer.local
        inside = lambda t: local.data_ptr() <= t.data_ptr() < local.data_ptr() + local.numel()  # noqa: E731
        buf = comm.dispatch_input_buffer()
        if tuple(buf.shape) != (m, cfg.hidden) or buf.dtype != cfg.dtype or not inside(buf):
            return [f"input buffer: shape {tuple(buf.shape)} dtype {buf.dtype} inside the buffer {inside(buf)}"]
        for seed, shift, t in ((61, 0, m), (62, 1, m - 1), (63, 0, 1), (64, 0, m - 1)):
            inputs = oracle.random_inputs(cfg, world, seed, tokens=[t] * world)
            mine = inputs[rank].to(comm.device)
            x = buf[shift: shift + t]
            x.copy_(mine.x)
            # sent in place, or (shifted: overlapping the own rows it would write) copied first
            if (comm._impl._apart_from_buffer(x) is x) != (shift == 0):
                problems.append(f"seed {seed} shift {shift}: x {'not ' if shift == 0 else ''}taken in place")
            d = dispatch(comm, hooks, x, mine.topk_ids, mine.topk_weights)
            problems += [f"seed {seed} shift {shift} dispatch: {p}" for p in
                         oracle.compare_dispatch(cfg, d, oracle.expected_dispatch(cfg, inputs)[rank])]
            y = combine(comm, hooks, oracle.run_experts(cfg, rank, world, d), d)
            problems += [f"seed {seed} shift {shift} combine: {p}" for p in
                         oracle.compare_combine(cfg, y, oracle.expected_combine_rank(cfg, inputs, rank))]
        if comm.dispatch_input_buffer().data_ptr() != buf.data_ptr():
            problems.append("the input buffer moved between calls")
    with ep_comm.Communicator(make_cfg(world, backend, "standard", "fp8", zero_copy=True), device=device) as comm:
        local = comm._impl.buffer.local
        if local.data_ptr() <= comm.dispatch_input_buffer().data_ptr() < local.data_ptr() + local.numel():
            problems.append("fp8: the input buffer is inside the receive buffer "
                            "(the quantised rows would overwrite it)")
    return problems


def zero_copy_matrix_pushing(backends=("mnnvl",)) -> dict:
    """``zero_copy_matrix`` with ``$EP_COMM_COMBINE_PULL=0``: zero-copy rows, partials pushed."""
    return zero_copy_matrix(backends, pull=False)


def _other_expert(xf: torch.Tensor, expert: int) -> torch.Tensor:
    return -0.5 * oracle.test_expert(xf, expert) + 0.03


def pull_reuse(backends=("mnnvl",)) -> dict:
    """Pulling combines that give a peer time to read late: one ``Dispatched`` combined twice with
    different expert outputs written into ``expert_output_buffer`` in between, by a rank without
    tokens (nothing of its own to sum, so it reaches its next write first) while the others sum
    slowly (1 SM, wide rows); the second write must wait until every peer has read the first.
    Then float32 expert outputs (cast into the buffer).  Keys ``<backend>/pull_reuse``,
    ``<backend>/pull_fp32_expert_out``."""
    force_pull(True)
    topo, device = init_rank()
    world, rank = topo.world_size, topo.rank
    results: dict[str, list[str]] = {}
    for backend in backends:
        problems: list[str] = []
        cfg = make_cfg(world, backend, "standard", None, zero_copy=True, hidden=WIDE_HIDDEN, num_sms=1)
        tokens = [0] + [cfg.max_tokens_per_rank] * (world - 1)
        with ep_comm.Communicator(cfg, device=device) as comm:
            for seed in (51, 52):
                inputs = oracle.random_inputs(cfg, world, seed, tokens=tokens)
                mine = inputs[rank].to(comm.device)
                d = comm.dispatch(mine.x, mine.topk_ids, mine.topk_weights)
                buf = comm.expert_output_buffer(d)
                for name, fn in (("first", oracle.test_expert), ("second", _other_expert)):
                    buf.copy_(oracle.run_experts(cfg, rank, world, d, expert_fn=fn))
                    y = comm.combine(buf, d)
                    problems += [f"seed {seed} {name} combine: {p}" for p in oracle.compare_combine(
                        cfg, y, oracle.expected_combine_rank(cfg, inputs, rank, expert_fn=fn))]
        results[f"{backend}/pull_reuse"] = problems
        problems = []
        cfg = make_cfg(world, backend, "standard", None, zero_copy=True)
        with ep_comm.Communicator(cfg, device=device) as comm:
            inputs = oracle.random_inputs(cfg, world, 53)
            mine = inputs[rank].to(comm.device)
            d = comm.dispatch(mine.x, mine.topk_ids, mine.topk_weights)
            y = comm.combine(oracle.run_experts(cfg, rank, world, d).float(), d)
            problems += [f"float32 expert_out: {p}" for p in
                         oracle.compare_combine(cfg, y, oracle.expected_combine_rank(cfg, inputs, rank))]
        results[f"{backend}/pull_fp32_expert_out"] = problems
    return results


def _expert_output_buffer_problems(comm, cfg, world: int, rank: int, hooks: bool) -> list[str]:
    """Experts that write into ``expert_output_buffer``: the same buffer every call (a view of the
    communicator's buffer when combine pulls), combined in place, against the oracle."""
    problems: list[str] = []
    pulls = comm.capabilities.combine_in_place
    if comm.capabilities.recv_hooks and pulls != (os.environ.get(COMBINE_PULL_ENV) == "1"
                                                  and not comm._impl.layout.put_mode):
        problems.append(f"combine pulls: {pulls}, against ${COMBINE_PULL_ENV} and put mode")
    seen = []
    for seed in (31, 32, 33):
        inputs = oracle.random_inputs(cfg, world, seed)
        mine = inputs[rank].to(comm.device)
        d = dispatch(comm, hooks, mine.x, mine.topk_ids, mine.topk_weights)
        buf = comm.expert_output_buffer(d)
        seen.append(buf.data_ptr())
        if tuple(buf.shape) != (d.x.shape[0], cfg.hidden) or buf.dtype != cfg.dtype or not buf.is_contiguous():
            problems.append(f"expert_output_buffer: shape {tuple(buf.shape)} dtype {buf.dtype}")
            continue
        if pulls:
            local = comm._impl.buffer.local
            if not local.data_ptr() <= buf.data_ptr() < local.data_ptr() + local.numel():
                problems.append("expert_output_buffer is not a view of the communicator's buffer")
        buf.copy_(oracle.run_experts(cfg, rank, world, d))  # (as an expert kernel writing its output there)
        y = combine(comm, hooks, buf, d)
        problems += [f"seed {seed} combine from expert_output_buffer: {p}" for p in
                     oracle.compare_combine(cfg, y, oracle.expected_combine_rank(cfg, inputs, rank))]
    if pulls and len(set(seen)) != 1:
        problems.append(f"expert_output_buffer moved between calls: {seen}")
    return problems


def zero_copy_wide_rows(backends=("mnnvl",), hooks: bool = False, in_place: bool = False) -> dict:
    """``cases.wide_rows_matrix`` in the standard layout with zero copy (keys:
    ``cases.wide_rows_case_names``): combines pull; ``in_place``: x is written into
    ``dispatch_input_buffer``."""
    force_pull(True)
    input_in_place(in_place)
    return wide_rows_matrix(backends, hooks, ("standard",), zero_copy=True)


ZERO_COPY_TOP_K = (1, 3, 6, 8)  # k % 4 != 0 takes the receive pass's 4-byte path, the others its 16-byte one
SHAPES_MAX_TOKENS = 600  # on one SM (16 warps) every warp's receive pass and combine go round several times


def zero_copy_shapes_case_names(backend: str) -> list[str]:
    """The keys ``zero_copy_shapes`` reports for ``backend``."""
    return [f"{backend}/zero_copy_shapes/k{k}/{mode}" for k in ZERO_COPY_TOP_K
            for mode in ("pull", "push", "pull_equals_push")]


def zero_copy_shapes(backends=("mnnvl",)) -> dict:
    """Zero copy with top_k in ``ZERO_COPY_TOP_K`` and ``SHAPES_MAX_TOKENS`` rows per rank on one SM,
    -1 and duplicate ids, pulled and pushed combines: what the matrix's top-4, 16-row shape does not
    reach (the receive pass's 4-byte path, rows past a warp's first lane, several rows per warp).
    ``.../pull_equals_push``: both combines of the same inputs are bitwise equal (the standard
    layout's partial is the expert row itself, and both sum this rank's row, then the peers' rows in
    the order of the token's destinations)."""
    topo, device = init_rank()
    world, rank = topo.world_size, topo.rank
    tokens = [SHAPES_MAX_TOKENS, SHAPES_MAX_TOKENS - 83, 0, 311][:world] + [SHAPES_MAX_TOKENS] * max(0, world - 4)
    results: dict[str, list[str]] = {}
    combined: dict = {}
    for backend, k, pull in itertools.product(backends, ZERO_COPY_TOP_K, (True, False)):
        force_pull(pull)
        key = f"{backend}/zero_copy_shapes/k{k}/{'pull' if pull else 'push'}"
        seed = 3000 + 10 * k  # the same inputs pulled and pushed
        cfg = make_cfg(world, backend, "standard", None, max_tokens=SHAPES_MAX_TOKENS, zero_copy=True, top_k=k,
                       num_experts=max(EXPERTS_PER_RANK, k) * world, num_sms=1)
        with ep_comm.Communicator(cfg, device=device) as comm:
            if comm.backend != backend:
                results[key] = [f"resolved backend {comm.backend}"]
                continue
            problems: list[str] = []
            ys: list = []
            for spec in (dict(tokens=tokens), dict(tokens=tokens[::-1], p_minus_one=0.2, p_duplicate=0.2)):
                seed += 1
                problems += [f"seed {seed}: {p}" for p in
                             run_case(comm, cfg, world, rank, seed, "bf16+scales", spec, outputs=ys)]
            results[key] = problems
            combined[(backend, k, pull)] = ys
        if not pull and (backend, k, True) in combined:
            pulled, pushed = combined[(backend, k, True)], combined[(backend, k, False)]
            results[f"{backend}/zero_copy_shapes/k{k}/pull_equals_push"] = [
                f"call {i}: {int((a != b).sum())} of {a.numel()} elements differ" for i, (a, b) in
                enumerate(zip(pulled, pushed)) if not torch.equal(a, b)]
    return results


def zero_copy_graphs(backends=("mnnvl",), hooks: bool = False, in_place: bool = False) -> dict:
    """``graph_capture`` of the standard layout with ``zero_copy=True``: replays read the rows in place
    and combines pull; ``in_place``: the captured x is ``dispatch_input_buffer``'s rows, rewritten
    before each replay."""
    force_pull(True)
    input_in_place(in_place)
    return graph_capture(backends, ("standard",), 3, hooks, zero_copy=True)
