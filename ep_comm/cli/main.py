"""``ep-comm`` entry point: argument parsing and dispatch to the subcommands.

    ep-comm bench  [--nproc N] [--tokens 128 4096] [--backend all] [--json out.json] ...
    ep-comm stress [--nproc N] [--iters 200] ...
    ep-comm info   [--nproc N]

Under torchrun / mpirun / srun (world size > 1) every process is one rank and ``--nproc`` is ignored;
otherwise ``--nproc`` local ranks are spawned (default: one per visible GPU, 2 on a CPU-only host).
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

#: multicast / NVLS stays off on the shared GPU hosts this runs on (docs/operations.md, multicast); these are only
#: defaults: a value already in the environment wins, so a site that wants NVLS can export it.
NVLS_OFF_DEFAULTS = (("NCCL_NVLS_ENABLE", "0"), ("NVSHMEM_DISABLE_NVLS", "1"),
                     ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"))

EPILOG = """\
examples:
  ep-comm info
  ep-comm bench --tokens 128 4096 --json bench.json      # table + JSON (docs/design.md §2), all usable backends
  ep-comm bench --nproc 2 --tokens 32 --hidden 512 --experts 16 --topk 4 --backend ag_rs --layout batched
  ep-comm stress --nproc 4 --iters 200
  torchrun --nproc-per-node 8 -m ep_comm bench --mode graph
"""


def build_parser() -> argparse.ArgumentParser:
    from . import bench, info, stress

    parser = argparse.ArgumentParser(
        prog="ep-comm", description="Expert-parallel MoE dispatch/combine: environment report, benchmark, stress test.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from .. import __version__

    parser.add_argument("--version", action="version", version=f"ep_comm {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{bench,stress,info}")
    for name, module, help_text in (
        ("bench", bench, "dispatch/combine latency, GB/s and the all_to_all baseline per backend × layout"),
        ("stress", stress, "random rounds (0-token ranks, -1/duplicate ids, fp8, uint8) checked against the oracle"),
        ("info", info, "topology, GPUs, P2P/NVLink, usable backends and why the others are not, memory layer"),
    ):
        # the module docstring is the subcommand's manual; drop the reST quoting for the terminal
        p = sub.add_parser(name, help=help_text, description=(module.__doc__ or "").strip().replace("``", ""),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(p)
        _add_launch_arguments(p)
        p.set_defaults(module=module)
    return parser


def _add_launch_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("ranks")
    g.add_argument("--nproc", type=int, default=None,
                   help="local ranks to spawn when not started by torchrun/mpirun/srun "
                        "(default: one per visible CUDA GPU, else 2)")
    g.add_argument("--timeout", type=float, default=3600.0,
                   help="seconds before spawned ranks are killed (self-spawn only; default: 3600)")
    g.add_argument("--op-timeout", type=float, default=100.0,
                   help="EPConfig.timeout_s: how long a dispatch/combine waits for a missing peer (default: 100)")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run the subcommand on every rank, return the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        return 2
    for var, value in NVLS_OFF_DEFAULTS:
        os.environ.setdefault(var, value)
    module = args.module
    del args.module  # modules do not pickle; the children get plain options only
    if args.op_timeout <= 0 or args.timeout <= 0:
        print(f"ep-comm {args.command}: error: --timeout and --op-timeout must be > 0", file=sys.stderr)
        return 2
    problem = module.check_arguments(args)
    if problem:
        print(f"ep-comm {args.command}: error: {problem}", file=sys.stderr)
        return 2
    from .launcher import run_ranks

    # once a rank fails, the others get --op-timeout (their own typed errors) plus a margin to end
    return run_ranks(module.worker, args, args.nproc, args.timeout, failure_grace_s=args.op_timeout + 15.0,
                     planned_victim=getattr(module, "planned_victim", None),
                     share_gpus=getattr(args, "share_gpus", False))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
