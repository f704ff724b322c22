"""Peer libraries timed in the same ``ep-comm bench`` run: ``--peer deepep`` (and a probe for ``nccl_ep``).

A peer runs in the bench's own processes, on the same inputs as ours: its oracle check uses the
``OracleGate``'s check inputs (every rank's, one seed) and its timing the same run sets.  It is
checked against ``ep_comm.oracle`` like a backend of ours, and only a peer that passes is timed.

DeepEP (V1 API, ``deep_ep.Buffer``) is mapped onto our two layouts:

* normal mode (``get_dispatch_layout`` + ``dispatch``, then ``combine``; 24 SMs, bf16 rows, or fp8
  rows pre-quantised by the caller with ``--quant fp8``) returns one row per (token, receiving rank)
  with local expert ids, -1 elsewhere, and its combine sums rows without weights: that is our
  *standard* layout and its combine semantics;
* low-latency mode (``low_latency_dispatch`` / ``low_latency_combine``, ``T <= --peer-ll-max-tokens``)
  returns ``[L, world × T, hidden]`` packed per expert with counts, and its combine applies the
  weights: our *batched* layout.  Dispatch is timed with bf16 and with fp8 payloads (labelled).

Whatever goes wrong inside a peer (an import, a buffer, a kernel launch, a wrong result) becomes one
line and the bench goes on.  Every step is agreed over the CLI's gloo group (with a timeout), so a
rank whose peer call raised does not leave the others waiting in the next one.
"""
from __future__ import annotations

import argparse
import functools
import os
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from .. import oracle
from ..layouts import Dispatched
from ..quant import quantize_fp8
from .bench_measure import (
    CheckCase,
    OracleGate,
    RunSet,
    Timer,
    eager_queued,
    expert_outputs,
    percentiles,
    split_iters,
)
from .launcher import RankEnv, align_devices, gather_objects, host_barrier

PEERS = ("deepep", "nccl_ep")
NORMAL_SMS = 24  # DeepEP normal kernels' SMs (Buffer.set_num_sms): the prefill SM budget ep_comm is held to


def _first_error(env: RankEnv, error: Optional[str]) -> Optional[str]:
    """Every rank's error agreed: None when all succeeded, else the first one with its rank."""
    errors = gather_objects(env, error)
    bad = [(r, e) for r, e in enumerate(errors) if e]
    return None if not bad else f"rank {bad[0][0]}: {bad[0][1]}"


def _one_reason(reasons: list[str]) -> str:
    """One reason when every rank gave the same, else the distinct ones with their ranks."""
    distinct = sorted({r for r in reasons if r})
    if len(distinct) == 1 and all(reasons):
        return distinct[0]
    return "; ".join(f"rank {i}: {r}" for i, r in enumerate(reasons) if r)


def _guarded(env: RankEnv, fn: Callable[[], Any]) -> tuple[Any, Optional[str]]:
    """``fn()`` on every rank, then agree: ``(result, None)`` or ``(None, "rank r: error")``."""
    result, error = None, None
    try:
        result = fn()
    except Exception as exc:  # noqa: BLE001 - a peer's failure is a finding, never a crash of the bench
        error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    error = _first_error(env, error)
    return (None, error) if error else (result, None)


class DeepEPPeer:
    """DeepEP V1 normal and low-latency kernels behind a small check/time interface."""

    name = "deepep"
    #: DeepEP's kernels run on CUDA devices only, so CPU ranks are refused before any buffer is made (a
    #: stand-in of its API that runs on CPU ranks, as the tests' does, sets this False)
    needs_cuda = True

    def __init__(self, env: RankEnv, args: argparse.Namespace):
        import deep_ep

        self.ep, self.env, self.args = deep_ep, env, args
        self.world, self.rank = env.world_size, env.rank
        self.idx_dtype = getattr(deep_ep, "topk_idx_t", torch.int64)
        self.normal: Any = None
        self.ll: Any = None

    @staticmethod
    def probe(env: RankEnv) -> str:
        """Why this rank cannot run DeepEP ("" when it can)."""
        try:
            import deep_ep  # noqa: F401
        except Exception as exc:  # noqa: BLE001 - ImportError, or a broken build's OSError
            return f"import deep_ep: {type(exc).__name__}: {exc}"
        if env.device.type != "cuda" and DeepEPPeer.needs_cuda:
            return "needs CUDA GPUs (this run is on CPU ranks)"
        if env.topology.num_hosts != 1:
            return "ep-comm bench runs DeepEP's intranode (NVLink) kernels only; this job spans several hosts"
        return ""

    # -- buffers (collective) ----------------------------------------------------------------------------
    def setup_normal(self) -> None:
        buf = self.ep.Buffer
        buf.set_num_sms(NORMAL_SMS)
        self.dispatch_cfg = buf.get_dispatch_config(self.world)
        self.combine_cfg = buf.get_combine_config(self.world)
        row_bytes = self.args.hidden * 2  # bf16 rows; fp8 rows and their scales are smaller
        nvl = max(c.get_nvl_buffer_size_hint(row_bytes, self.world) for c in (self.dispatch_cfg, self.combine_cfg))
        self.normal = buf(dist.group.WORLD, nvl, 0, explicitly_destroy=True)

    def setup_low_latency(self, max_tokens: int) -> None:
        # one host: NVSHMEM moves data over NVLink P2P and needs no NIC transport (fails without a NIC)
        os.environ.setdefault("NVSHMEM_REMOTE_TRANSPORT", "none")
        a = self.args
        rdma = self.ep.Buffer.get_low_latency_rdma_size_hint(max_tokens, a.hidden, self.world, a.experts)
        self.ll = self.ep.Buffer(dist.group.WORLD, 0, rdma, low_latency_mode=True,
                                 num_qps_per_rank=a.experts // self.world, explicitly_destroy=True)
        self.ll_max_tokens = max_tokens

    def close(self) -> None:
        for buf in (self.normal, self.ll):
            if buf is not None:
                buf.destroy()
        self.normal = self.ll = None

    # -- the calls -----------------------------------------------------------------------------------------
    def _normal_dispatch(self, x: Any, ids: torch.Tensor, w: torch.Tensor):
        per_rank, _, per_expert, in_rank, _ = self.normal.get_dispatch_layout(ids, self.args.experts)
        recv_x, recv_ids, recv_w, _, handle, _ = self.normal.dispatch(
            x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            topk_idx=ids, topk_weights=w, config=self.dispatch_cfg)
        return recv_x, recv_ids, recv_w, handle

    def _normal_combine(self, expert_out: torch.Tensor, handle: Any) -> torch.Tensor:
        return self.normal.combine(expert_out, handle, config=self.combine_cfg)[0]

    def _ll_dispatch(self, x: torch.Tensor, ids: torch.Tensor, tokens: int, fp8: bool):
        recv, counts, handle, _, _ = self.ll.low_latency_dispatch(x, ids, tokens, self.args.experts, use_fp8=fp8)
        return recv, counts, handle

    def _ll_combine(self, expert_out: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, handle: Any) -> torch.Tensor:
        return self.ll.low_latency_combine(expert_out, ids, w, handle)[0]

    def _payload(self, x: torch.Tensor, fp8: bool) -> Any:
        """Normal mode takes fp8 rows already quantised (with our recipe) as ``(q, scales)``."""
        return quantize_fp8(x) if fp8 else x

    def variants(self, tokens: int) -> list[tuple[str, str, bool]]:
        """``(label, matching layout of ours, fp8 dispatch)`` that apply at ``tokens`` per rank."""
        out = [("normal", "standard", False)]
        if self.args.quant == "fp8":
            out.append(("normal-fp8", "standard", True))
        if self.ll is not None and tokens <= self.ll_max_tokens:
            out += [("ll", "batched", False), ("ll-fp8", "batched", True)]
        return out

    # -- oracle check ----------------------------------------------------------------------------------------
    def check(self, variant: str, fp8: bool, tokens: int, case: CheckCase) -> list[str]:
        """This rank's problems with DeepEP's results on the check inputs (empty: matches the oracle)."""
        cfg, mine = case.cfg, case.mine  # case.cfg: standard layout, quant as DeepEP's payload here
        ids = mine.topk_ids.to(self.idx_dtype)
        x = mine.x
        if variant.startswith("normal"):
            recv_x, recv_ids, recv_w, handle = self._normal_dispatch(self._payload(x, fp8), ids, mine.topk_weights)
            q, s = recv_x if isinstance(recv_x, tuple) else (recv_x, None)
            # DeepEP leaves weights of -1 slots unspecified; our layout contract says 0 (not a DeepEP bug)
            w = torch.where(recv_ids >= 0, recv_w, torch.zeros_like(recv_w))
            d = Dispatched("standard", x=q, x_scales=s, topk_ids=recv_ids.to(torch.int32), topk_weights=w,
                           num_tokens=mine.x.shape[0])
            problems = [f"dispatch: {p}" for p in oracle.compare_dispatch(cfg, d, case.expected_dispatch)]
            y = self._normal_combine(oracle.run_experts(cfg, self.rank, self.world, d, poison=False), handle)
        else:
            recv, counts, handle = self._ll_dispatch(x, ids, tokens, fp8)
            q, s = recv if fp8 else (recv, None)
            d = Dispatched("batched", x=q, x_scales=None if s is None else s.contiguous(), expert_num_tokens=counts,
                           num_tokens=mine.x.shape[0])
            bcfg = cfg.replace(layout="batched")
            if fp8:
                # DeepEP quantises inside its kernel: bytes may differ from our recipe in the last bit, so
                # check the counts here and the values through combine (within the oracle's tolerance)
                want = [sum(c.values()) for c in case.expected_dispatch.per_expert]
                got = counts.tolist()
                problems = [] if got == want else [f"dispatch: expert_num_tokens {got}, expected {want}"]
            else:
                problems = [f"dispatch: {p}" for p in oracle.compare_dispatch(bcfg, _cut(d), case.expected_dispatch)]
            eo = expert_outputs(bcfg, self.rank, self.world, d, padding=0.0)
            y = self._ll_combine(eo, ids, mine.topk_weights, handle)
        return problems + [f"combine: {p}" for p in oracle.compare_combine(cfg, y, case.expected_combine)]

    # -- timing -------------------------------------------------------------------------------------------------
    def time(self, variant: str, fp8: bool, tokens: int, sets: list[RunSet]) -> tuple[list[float], list[float]]:
        """Per-op µs (dispatch, combine) over the run sets, events around each call like our ops."""
        env, args = self.env, self.args
        hide_gap = hide_peer_launch(env, args)  # like our graph replays and queued eager calls
        prepared = []
        for rs in sets:  # conversions outside the timed region (DeepEP wants int64 ids)
            ids = rs.inp.topk_ids.to(self.idx_dtype)
            x = self._payload(rs.inp.x, fp8) if variant.startswith("normal") else rs.inp.x
            prepared.append((x, ids, rs.inp.topk_weights))
        cache: dict = {}

        def pair(x: Any, ids: torch.Tensor, w: torch.Tensor, timer: Optional[Timer]) -> None:
            def between() -> tuple[Any, Any]:  # dispatch's end stamp, combine's start stamp
                if timer is None:
                    return None, None
                end = timer.stamp()
                align_devices(env, hide_gap)
                return end, timer.stamp()

            if timer is not None:
                t0 = timer.stamp()
            if variant.startswith("normal"):
                recv_x, _, _, handle = self._normal_dispatch(x, ids, w)
                rows = (recv_x[0] if isinstance(recv_x, tuple) else recv_x).shape[0]
                eo = cache.get(rows)
                if eo is None:
                    eo = cache[rows] = torch.zeros(rows, args.hidden, dtype=torch.bfloat16, device=env.device)
                t1, t2 = between()
                self._normal_combine(eo, handle)
            else:
                _, _, handle = self._ll_dispatch(x, ids, tokens, fp8)
                eo = cache.get("ll")
                if eo is None:
                    shape = (args.experts // self.world, self.world * tokens, args.hidden)
                    eo = cache["ll"] = torch.zeros(shape, dtype=torch.bfloat16, device=env.device)
                t1, t2 = between()
                self._ll_combine(eo, ids, w, handle)
            if timer is not None:
                timer.add([t0, t1, t2, timer.stamp()])

        for _ in range(args.warmup):
            pair(*prepared[0], None)
        timer = Timer(env.device)
        for prep, n in zip(prepared, split_iters(args)):
            for _ in range(n):
                host_barrier(env, hide_gap)
                pair(*prep, timer)
        disp, _gap, comb = timer.sections_us()
        return disp, comb


def _percentiles_of(timer: Callable[..., tuple[list[float], list[float]]], *args: Any) -> list[tuple[float, float]]:
    """(p50, p90) of each op's samples that ``timer(*args)`` returns."""
    return [percentiles(s) for s in timer(*args)]


def hide_peer_launch(env: RankEnv, args: argparse.Namespace) -> bool:
    """The peer's calls are issued behind a GPU busy-wait whenever ours are (graph replays, queued eager)."""
    return args.mode == "graph" or eager_queued(env, args)


def _cut(d: Dispatched) -> Dispatched:
    """Batched ``d`` cut to its longest expert (the oracle copies rows to the host)."""
    counts = d.filled("expert_num_tokens")
    longest = int(counts.max()) if counts.numel() else 0
    return Dispatched("batched", x=d.x[:, :longest], expert_num_tokens=counts, num_tokens=d.num_tokens)


def nccl_ep_probe() -> str:
    """NCCL EP (``nccl-extensions`` wheel, ``import nccl.ep``): found or why not; no adapter yet."""
    try:
        import nccl.ep as ncclep  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        return f"not available (import nccl.ep: {type(exc).__name__}: {exc})"
    version = getattr(ncclep, "get_lib_version", lambda: "?")
    try:
        found = f"nccl.ep {version()}"
    except Exception:  # noqa: BLE001
        found = "nccl.ep"
    return f"{found} imports, but ep-comm bench has no NCCL EP adapter yet; not timed"


class PeerSuite:
    """The ``--peer`` libraries of this run: set up once, then checked and timed per token count."""

    def __init__(self, env: RankEnv, args: argparse.Namespace, note: Callable[[str], None]):
        self.env, self.args, self.note = env, args, note
        self.deepep: Optional[DeepEPPeer] = None
        for name in args.peer or ():
            if name == "nccl_ep":
                # every rank imports, rank 0 speaks: availability can differ per host
                reasons = gather_objects(env, nccl_ep_probe())
                self.note(f"peer nccl_ep: {reasons[0]}")
            elif name == "deepep":
                self._open_deepep()

    def _open_deepep(self) -> None:
        env, args = self.env, self.args
        reasons = gather_objects(env, DeepEPPeer.probe(env))
        if not any(reasons) and args.dtype != "bf16":
            reasons = ["DeepEP moves bf16 (or fp8) tokens; run with --dtype bf16"]
        if any(reasons):
            self.note(f"peer deepep: not available ({_one_reason(reasons)})")
            return
        peer, error = _guarded(env, lambda: DeepEPPeer(env, args))
        if error is None:
            _, error = _guarded(env, peer.setup_normal)
        if error:
            self.note(f"peer deepep failed: buffer (normal mode): {error}")
            return
        ll_tokens = max((t for t in args.tokens if t <= args.peer_ll_max_tokens), default=0)
        if ll_tokens:
            _, error = _guarded(env, lambda: peer.setup_low_latency(ll_tokens))
            if error:
                peer.ll = None
                self.note(f"peer deepep failed: buffer (low-latency mode), only normal mode is timed: {error}")
        self.deepep = peer

    def run(self, tokens: int, sets: list[RunSet], gate: OracleGate, mean_remote: float) -> list[dict]:
        """Check then time every applicable DeepEP variant at ``tokens``; the agreed rows."""
        peer, env, args = self.deepep, self.env, self.args
        if peer is None:
            return []
        rows: list[dict] = []
        for variant, layout, fp8 in peer.variants(tokens):
            label = f"deepep {variant}"
            # the check cases of DeepEP's payload: bf16 rows, or fp8 (our recipe) for its fp8 dispatch
            case = gate.case(tokens, "fp8" if fp8 else None)
            problems, error = _guarded(env, functools.partial(peer.check, variant, fp8, tokens, case))
            if error:
                self.note(f"peer {label} failed at {tokens} tok: {error}")
                continue
            bad = [f"rank {r}: {p}" for r, ps in enumerate(gather_objects(env, problems)) for p in ps]
            if bad:
                self.note(f"peer {label} FAILED the oracle check at {tokens} tok; not timed: " + "; ".join(bad[:3]))
                continue
            timed, error = _guarded(env, functools.partial(_percentiles_of, peer.time, variant, fp8, tokens, sets))
            if error:
                self.note(f"peer {label} failed while timed at {tokens} tok: {error}")
                continue
            stats = gather_objects(env, timed)
            for i, op in enumerate(("dispatch", "combine")):
                p50, p90 = max(s[i][0] for s in stats), max(s[i][1] for s in stats)
                per_token = (args.hidden + args.hidden // 128 * 4) if (fp8 and op == "dispatch") else args.hidden * 2
                rows.append({
                    "backend": "deepep", "peer_variant": variant, "layout": variant, "matches_layout": layout,
                    "op": op, "tokens": tokens, "hidden": args.hidden, "top_k": args.topk, "experts": args.experts,
                    "dtype": "fp8" if (fp8 and op == "dispatch") else "bf16",
                    "p50_us": round(p50, 3), "p90_us": round(p90, 3),
                    "gbps": float(f"{mean_remote * per_token / (p50 * 1e-6) / 1e9:.4g}") if p50 > 0 else None,
                    "sms": NORMAL_SMS if variant.startswith("normal") else None,
                    "mode": "eager, launch gap hidden" if hide_peer_launch(env, args) else "eager",
                })
        return rows

    def close(self) -> None:
        if self.deepep is not None:
            _guarded(self.env, self.deepep.close)
            self.deepep = None


def match_peer(row: dict, peer_rows: list[dict], fp8: bool) -> Optional[dict]:
    """The peer row our ``row`` is compared with: same tokens and op; standard ↔ DeepEP normal mode,
    batched ↔ low-latency mode where it ran (else normal); the fp8 variant for an fp8 dispatch."""
    want_fp8 = fp8 and row["op"] == "dispatch"
    candidates = [p for p in peer_rows if p["tokens"] == row["tokens"] and p["op"] == row["op"]
                  and p["peer_variant"].endswith("-fp8") == want_fp8]
    for mode in (("ll", "normal") if row["layout"] == "batched" else ("normal",)):
        for p in candidates:
            if p["peer_variant"].split("-")[0] == mode:
                return p
    return None
