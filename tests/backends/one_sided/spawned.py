"""Parent-side helpers of the kernel backends' multi-rank GPU tests: spawn the ranks (one per GPU, or
$EP_COMM_TEST_WORLD ranks spread over the GPUs, tests/backends/cases.py: ``kernel_test_world``), and
keep each worker's merged ``{case: [problems]}`` for the module, so that every case is its own test
while the worker runs once."""
from __future__ import annotations

from typing import Any, Callable

import torch

from ep_comm.distributed.spawn import RankResult, raise_on_failure, spawn_local

from .. import cases

PRELOAD = ("torch", "torch.distributed")


def kernel_spawn(fn: Callable, *args: Any, timeout_s: float = 600.0) -> list[Any]:
    """``fn(*args)`` on every rank of the kernel tests' world; each rank's return value, in rank order."""
    ngpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    world, env = cases.kernel_test_world(ngpu)
    # ranks forked from a server that imported torch once, as the CLI's are: a module's tests spawn
    # several worlds, each rank of which would otherwise import torch afresh
    results: list[RankResult] = spawn_local(fn, world, args=args, timeout_s=timeout_s, extra_env=env,
                                            preload=PRELOAD)
    return raise_on_failure(results)


class CaseResults:
    """Workers' results by name, each worker spawned once."""

    def __init__(self) -> None:
        self._by_name: dict[str, dict] = {}

    def results(self, name: str, fn: Callable, *args: Any) -> dict:
        if name not in self._by_name:
            self._by_name[name] = cases.merge_ranks(kernel_spawn(fn, *args))
        return self._by_name[name]

    def assert_clean(self, case: str, name: str, fn: Callable, *args: Any) -> None:
        """``case`` is among the cases ``fn`` ran (on every rank) and had no problems."""
        results = self.results(name, fn, *args)
        assert case in results, sorted(results)[:8]
        assert results[case] == [], "\n".join(results[case])
