"""``ep-comm bench --recv-hook`` on CPU ranks: the flag, the skip line of a backend without hooks, and
the check / eager timing / rows of the split path on a hooks-capable CPU stand-in (``split_stand_in``).

The real split path (mnnvl, eager and CUDA-graph timing) is the last test: it needs 2+ GPUs.
"""
from __future__ import annotations

import argparse
import json

import pytest
import torch

from ep_comm.cli import bench, bench_report
from ep_comm.cli.bench_measure import HALF_OPS
from ep_comm.cli.bench_report import Reporter
from ep_comm.cli.launcher import RankEnv
from ep_comm.cli.main import build_parser
from ep_comm.distributed.spawn import spawn_local
from ep_comm.distributed.topology import Topology

from .split_stand_in import BROKEN_ENV, bench_rank

SHAPE = ["--hidden", "128", "--experts", "8", "--topk", "2"]
QUICK = ["--nproc", "2", "--tokens", "8", *SHAPE, "--iters", "3", "--warmup", "1", "--sets", "1"]
FULL_OPS = ["dispatch", "combine"]


def test_recv_hook_flag_is_parsed_and_off_by_default():
    parser = build_parser()
    assert parser.parse_args(["bench"]).recv_hook is False
    args = parser.parse_args(["bench", "--recv-hook", "--backend", "naive"])
    assert args.recv_hook is True
    del args.module
    assert bench.check_arguments(args) is None  # the flag refuses nothing by itself: skipping is per backend


def test_recv_hook_on_a_backend_without_hooks_is_one_line_and_no_half_rows(cli, tmp_path):
    path = tmp_path / "r.json"
    proc = cli(["bench", *QUICK, "--backend", "naive", "--recv-hook", "--json", str(path)], timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    skips = [ln for ln in proc.stderr.splitlines() if "--recv-hook rows skipped" in ln]
    assert len(skips) == 1, proc.stderr  # one line per backend, not per layout
    assert "naive: no receive hooks" in skips[0]
    doc = json.loads(path.read_text())
    assert doc["recv_hook"] is True and doc["complete"] is True
    assert [(r["layout"], r["op"]) for r in doc["results"]] == [(lay, op) for lay in ("standard", "batched")
                                                                 for op in FULL_OPS]
    assert not doc["failures"]
    rows = [ln.split() for ln in proc.stdout.splitlines() if ln.startswith("naive ")]
    assert [r[2] for r in rows] == FULL_OPS * 2
    assert not any(op in proc.stdout for op in HALF_OPS)


def test_without_recv_hook_no_skip_line(cli):
    proc = cli(["bench", *QUICK, "--backend", "naive", "--layout", "standard"], timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "receive hooks" not in proc.stderr


def _stand_in_bench(tmp_path, broken: bool) -> tuple[list, dict]:
    """``ep-comm bench --recv-hook`` on two gloo ranks whose communicators are ``SplitStandIn``s."""
    path = tmp_path / "r.json"
    args = build_parser().parse_args(["bench", *QUICK, "--backend", "naive", "--recv-hook", "--json", str(path)])
    del args.module
    assert bench.check_arguments(args) is None
    results = spawn_local(bench_rank, 2, (args,), timeout_s=120, preload=("torch", "torch.distributed"),
                          extra_env=lambda rank: {BROKEN_ENV: "1" if broken else "0"})
    assert all(r.ok for r in results), [r.traceback for r in results]
    return [r.value for r in results], json.loads(path.read_text())


def test_split_calls_are_checked_timed_and_reported_per_half(tmp_path):
    codes, doc = _stand_in_bench(tmp_path, broken=False)
    assert codes == [0, 0], doc["failures"]
    ops = FULL_OPS + list(HALF_OPS)
    assert [(r["layout"], r["op"]) for r in doc["results"]] == [(lay, op) for lay in ("standard", "batched")
                                                                 for op in ops]
    for r in doc["results"]:
        assert set(r) == set(doc["results"][0]), r  # the halves have every column of a whole call
        assert 0 < r["p50_us"] <= r["p90_us"], r
        assert r["baseline_nccl_us"] > 0
        # stored to significant digits, so even a receive half far shorter than the baseline keeps its ratio
        assert r["ratio"] == pytest.approx(r["p50_us"] / r["baseline_nccl_us"], rel=1e-2), r
        if r["op"] in HALF_OPS:
            assert r["gbps"] is None  # a half's time is no transfer time of its own
        else:
            assert r["gbps"] > 0
    assert not [n for n in doc["notes"] if "hook" in n]


def test_split_calls_that_do_not_deliver_fail_the_check_and_are_not_timed(tmp_path):
    codes, doc = _stand_in_bench(tmp_path, broken=True)
    assert codes == [1, 1]
    assert doc["results"] == []  # not even the whole calls: the config failed
    assert [(f["backend"], f["layout"]) for f in doc["failures"]] == [("naive", "standard"), ("naive", "batched")]
    for f in doc["failures"]:
        assert any("dispatch (recv hook): " in p for p in f["problems"]), f["problems"]


def test_reporter_widens_op_for_half_rows_and_prints_no_bandwidth(tmp_path, capsys, monkeypatch):
    """A GPU table (mnnvl's halves run on GPUs only): the GB/s column is there, and empty for the halves."""
    args = argparse.Namespace(json=str(tmp_path / "r.json"), plot=None, mode="eager", routing="uniform",
                              quant="none", iters=2, warmup=0, sets=1, recv_hook=True)
    monkeypatch.setattr(bench_report, "device_name", lambda env: "a GPU")  # the table needs no CUDA to print
    env = RankEnv(0, 2, torch.device("cuda", 0), None, Topology.from_host_ids(0, ["h", "h"]), "spawn")
    rep = Reporter(env, args, "nccl", with_peer=False)
    rep.start()
    rep.rows([{"backend": "mnnvl", "layout": "standard", "op": op, "tokens": 8, "p50_us": 5.0, "p90_us": 6.0,
               "gbps": None, "sms": 20, "baseline_nccl_us": 10.0, "ratio": 0.5} for op in HALF_OPS])
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[2] == "-" * len("dispatch_send")  # the op column fits the halves' names
    column = lines[0].index("op ")
    gbps = lines[0].split().index("GB/s")
    for ln, op in zip(lines[2:], HALF_OPS):
        assert ln.index(op) == column and ln[column + len("dispatch_send")] == " "  # aligned, not shifted
        cells = ln.split()
        assert cells[2] == op and cells[gbps] == "-"
    assert json.loads((tmp_path / "r.json").read_text())["results"][0]["gbps"] is None


@pytest.mark.multigpu
@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_mnnvl_halves_are_checked_and_timed_on_gpus(cli, tmp_path, mode):
    """The path the flag is for: mnnvl's split calls, oracle-checked (and, in graph mode, four graphs
    checked against the eager hook path), then one row per half next to the whole calls."""
    path = tmp_path / "r.json"
    proc = cli(["bench", "--tokens", "8", *SHAPE, "--iters", "4", "--warmup", "1", "--sets", "2", "--backend", "mnnvl",
                "--mode", mode, "--recv-hook", "--json", str(path)], timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(path.read_text())
    assert not doc["failures"] and "receive hooks" not in proc.stderr
    assert [(r["layout"], r["op"]) for r in doc["results"]] == [(lay, op) for lay in ("standard", "batched")
                                                                 for op in FULL_OPS + list(HALF_OPS)]
    for r in doc["results"]:
        assert r["mode"] == mode and 0 < r["p50_us"] <= r["p90_us"], r
        assert (r["gbps"] is None) == (r["op"] in HALF_OPS), r
        if mode == "eager":  # whole calls carry the host's time per call, the halves none
            assert (r["host_p50_us"] is None) == (r["op"] in HALF_OPS), r
            assert r["op"] in HALF_OPS or r["host_p50_us"] > 0, r
    assert doc["eager_launch"] == ("queued" if mode == "eager" else None)
