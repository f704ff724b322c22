"""A CPU stand-in for a backend with receive hooks, so ``ep-comm bench --recv-hook``'s check, eager
timing and rows run on gloo ranks (the only backend with hooks, mnnvl, needs GPUs).

``SplitStandIn`` wraps a real ``naive`` ``Communicator``.  With ``return_recv_hook=True`` a call does
the whole exchange but hands back results zeroed until the hook runs, and a pending hook refuses the
next call, as ``Communicator`` does: a bench that read a result before its hook, or skipped a hook,
gets wrong data or an error, not a pass.  ``$EP_COMM_TEST_BROKEN_HOOK=1`` makes the hooks do nothing
(the check must then fail the config).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Callable, Optional, Union

import torch

from ep_comm import Communicator, EPConfig
from ep_comm.errors import EPError
from ep_comm.layouts import Dispatched

BROKEN_ENV = "EP_COMM_TEST_BROKEN_HOOK"


class SplitStandIn:
    """A naive communicator whose calls split at a receive hook (see the module docstring)."""

    def __init__(self, cfg: EPConfig):
        self._comm = Communicator(cfg)
        self.backend = self._comm.backend
        # what the bench reads of the backend: it splits calls at a receive hook, no dedicated SMs
        self.capabilities = dataclasses.replace(self._comm.capabilities, recv_hooks=True, num_sms=None)
        self.cfg = cfg
        self._pending = False
        self._broken = os.environ.get(BROKEN_ENV) == "1"

    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 x_scales: Optional[torch.Tensor] = None,
                 return_recv_hook: bool = False) -> Union[Dispatched, tuple[Dispatched, Callable[[], None]]]:
        self._check_no_pending_hook()
        d = self._comm.dispatch(x, topk_ids, topk_weights, x_scales)
        if not return_recv_hook:
            return d
        held = [(t, t.clone()) for t in (d.x, d.x_scales, d.topk_ids, d.topk_weights, d.expert_num_tokens)
                if t is not None]
        for t, _ in held:
            t.zero_()  # zero ids are valid expert 0 and zero counts empty experts: wrong, not merely padding

        def receive() -> None:
            for t, full in held:
                t.copy_(full)
        return d, self._hook(receive)

    def combine(self, expert_out: torch.Tensor, dispatched: Dispatched, out: Optional[torch.Tensor] = None,
                return_recv_hook: bool = False) -> Union[torch.Tensor, tuple[torch.Tensor, Callable[[], None]]]:
        self._check_no_pending_hook()
        y = self._comm.combine(expert_out, dispatched, out)
        if not return_recv_hook:
            return y
        full = y.clone()
        y.zero_()
        return y, self._hook(lambda: y.copy_(full))

    def expert_output_buffer(self, dispatched: Dispatched) -> torch.Tensor:
        return self._comm.expert_output_buffer(dispatched)

    def check_errors(self) -> None:
        self._comm.check_errors()

    def close(self, reason: str = "closed") -> None:
        self._comm.close(reason)

    def _check_no_pending_hook(self) -> None:
        if self._pending:
            raise EPError("the receive hook of the previous call has not run")

    def _hook(self, receive: Callable[[], None]) -> Callable[[], None]:
        self._pending = True

        def hook() -> None:
            self._pending = False
            if not self._broken:
                receive()
        return hook


def bench_rank(args: argparse.Namespace) -> int:
    """One rank of ``ep-comm bench`` (``args`` as ``check_arguments`` left them) on the stand-in."""
    from ep_comm.cli import bench

    bench.Communicator = SplitStandIn  # this rank's process only: the bench creates its communicators here
    return bench.worker(args)
