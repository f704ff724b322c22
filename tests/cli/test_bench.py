"""``ep-comm bench`` on CPU ranks (``CPU_RANKS``: on GPU machines too): table, docs/design.md §2 JSON, oracle
gate, streaming, peers, argument errors, progress, --plot; the GPU table's columns on 2+ GPUs."""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from ep_comm.backends import registered
from ep_comm.cli import bench_plot, bench_report, format_table, resolve_backend_request, split_backends
from ep_comm.cli.bench_measure import remote_sends
from ep_comm.cli.bench_report import Reporter, table_columns
from ep_comm.cli.launcher import RankEnv
from ep_comm.distributed.topology import Topology

from .conftest import CPU_RANKS, REPO, clean_env, collective_backends

SHAPE = ["--hidden", "128", "--experts", "8", "--topk", "2"]
RESULT_KEYS = {"backend": str, "op": str, "layout": str, "tokens": int, "hidden": int, "top_k": int, "experts": int,
               "dtype": str, "p50_us": float, "p90_us": float, "gbps": float, "baseline_nccl_us": float}


HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
#: the per-config progress lines on stderr: "<tokens> tok: <backend>/<layout> (<done>/<total>): ..."
PROGRESS = re.compile(r"(\d+) tok: (\w+)/(standard|batched) \((\d+)/(\d+)\)")


@pytest.fixture(scope="module")
def bench_run(cli, tmp_path_factory):
    """Every backend (the default ``all``) on two CPU ranks, on GPU machines too."""
    out = tmp_path_factory.mktemp("bench")
    plot = ["--plot", str(out / "r.png")] if HAS_MATPLOTLIB else []
    proc = cli(["bench", "--nproc", "2", "--tokens", "8", "16", *SHAPE, "--iters", "4", "--warmup", "1",
                "--sets", "2", "--json", str(out / "r.json"), *plot, "--phase-times"], timeout=240, **CPU_RANKS,
               EP_COMM_COMBINE_GROUPED="0")
    return proc, out


def test_bench_runs_and_prints_one_table(bench_run):
    proc, _ = bench_run
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    headers = [ln for ln in lines if ln.startswith("backend") and "p50_us" in ln]
    assert len(headers) == 1, proc.stdout  # rank 0 prints, the other rank does not
    assert headers[0].split() == ["backend", "layout", "op", "tokens", "p50_us", "p90_us", "gloo_a2a_us", "ratio"]
    rows = [ln.split() for ln in lines if ln.split()[:1] and ln.split()[0] in registered()]
    assert len(rows) == len(collective_backends()) * 2 * 2 * 2  # backends x layouts x token counts x ops
    assert all(len(r) == 8 for r in rows)  # no GPU-only cells (GB/s, SMs, host_us) on CPU ranks
    assert {r[2] for r in rows} == {"dispatch", "combine"}


def test_bench_json_matches_design_schema(bench_run):
    proc, out = bench_run
    assert proc.returncode == 0, proc.stderr
    doc = json.loads((out / "r.json").read_text())
    for key, typ in (("device", str), ("date", str), ("git_commit", str), ("world_size", int), ("results", list)):
        assert isinstance(doc[key], typ), key
    assert doc["world_size"] == 2
    assert len(doc["results"]) == len(collective_backends()) * 8
    for r in doc["results"]:
        for key, typ in RESULT_KEYS.items():
            assert isinstance(r[key], typ), (key, r)
        assert "sms" in r and r["sms"] is None  # collective backends use no dedicated SMs (the key stays)
        assert r["op"] in ("dispatch", "combine") and r["layout"] in ("standard", "batched")
        assert r["tokens"] in (8, 16) and r["hidden"] == 128 and r["top_k"] == 2 and r["experts"] == 8
        assert r["dtype"] == "bf16"
        assert 0 < r["p50_us"] <= r["p90_us"]
        assert r["gbps"] > 0 and r["baseline_nccl_us"] > 0
        assert r["baseline_backend"] == "gloo"
        assert r["phase_s"]["timing"] > 0  # wall time per phase since the previous row (slowest rank)
        assert 0 < r["host_p50_us"]  # eager: the host's own time per call (a table column on GPUs only)
        assert r["agreement"] in ("shared memory", "gloo")  # two ranks of one host
    assert doc["complete"] is True and doc["eager_launch"] is None  # CPU ranks: no GPU to queue behind
    # the switches the numbers ran under (a kernel-form switch set for this run among them)
    assert doc["environment"]["EP_COMM_COMBINE_GROUPED"] == "0"
    assert all(k.startswith(("EP_COMM_", "NCCL_", "NVSHMEM_", "TORCH_SYMM_MEM_")) for k in doc["environment"])
    for phase in ("spawn", "init", "inputs", "baseline", "create", "check", "warmup", "timing"):
        assert doc["phase_times_s"][phase] >= 0, phase


def test_bench_phase_times_and_progress_on_stderr(bench_run):
    proc, _ = bench_run
    assert "phase times (s, slowest rank): spawn" in proc.stderr
    assert "naive/standard (1/" in proc.stderr  # progress: what is running
    assert "phase times" not in proc.stdout


def test_bench_progress_numbers_only_the_backends_that_run(bench_run):
    """Progress lines count over the rows that run; a backend that cannot run is one note, with its reason."""
    proc, _ = bench_run
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ran = collective_backends()
    seen = [(int(t), b, lay, int(i), int(n)) for t, b, lay, i, n in PROGRESS.findall(proc.stderr)]
    total = len(ran) * 2 * 2  # backends x layouts x token counts
    assert [s[3] for s in seen] == list(range(1, total + 1)), proc.stderr
    assert {s[4] for s in seen} == {total}
    assert {s[1] for s in seen} == set(ran)  # no line names a backend that is then skipped
    for name in set(registered()) - set(ran):  # the kernel backends: on CPU ranks they cannot run
        assert name not in " ".join(s[1] for s in seen)
        notes = [ln for ln in proc.stdout.splitlines() if ln.startswith("note: ") and name in ln]
        assert len(notes) == 1, proc.stdout
        assert re.search(r"skipped, cannot run on every rank here \(.+\)$", notes[0]), notes[0]
    doc = json.loads((bench_run[1] / "r.json").read_text())
    assert not doc["failures"]  # skipped by "all": notes, not failures


def test_bench_explicit_backend_that_cannot_run_fails_once_and_the_rest_runs(cli, tmp_path):
    path = tmp_path / "r.json"
    proc = cli(["bench", "--nproc", "2", "--tokens", "8", "16", *SHAPE, "--iters", "2", "--warmup", "0", "--sets", "1",
                "--backend", "mnnvl,ag_rs", "--json", str(path)], timeout=180, **CPU_RANKS)
    assert proc.returncode == 1, proc.stdout + proc.stderr  # a backend asked for by name failed
    failed = [ln for ln in proc.stdout.splitlines() if ln.startswith("FAILED")]
    assert len(failed) == 1 and failed[0].startswith("FAILED: backend mnnvl cannot run on every rank here ("), failed
    assert "1 requested backend(s) cannot run here" in proc.stdout
    seen = PROGRESS.findall(proc.stderr)
    assert [(b, lay, i, n) for _, b, lay, i, n in seen] == [
        ("ag_rs", "standard", "1", "4"), ("ag_rs", "batched", "2", "4"),
        ("ag_rs", "standard", "3", "4"), ("ag_rs", "batched", "4", "4")]
    doc = json.loads(path.read_text())
    assert [(f["backend"], f["layout"], f["tokens"]) for f in doc["failures"]] == [("mnnvl", None, None)]
    assert {r["backend"] for r in doc["results"]} == {"ag_rs"} and len(doc["results"]) == 8


@pytest.mark.skipif(not HAS_MATPLOTLIB, reason="needs matplotlib (the plot extra)")
def test_bench_plot_written(bench_run):
    proc, out = bench_run
    assert f"wrote {out / 'r.png'}" in proc.stdout
    png = out / "r.png"
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


#: runs ``ep-comm`` (``argv`` from the command line) in a process where ``import matplotlib`` fails
NO_MATPLOTLIB = "import sys; sys.modules['matplotlib'] = None; from ep_comm.cli.main import main; sys.exit(main())"


def test_bench_plot_without_matplotlib_exits_2_before_anything_runs(tmp_path):
    png = tmp_path / "x.png"
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", NO_MATPLOTLIB, "bench", "--nproc", "2", "--tokens", "8", *SHAPE,
                           "--plot", str(png)], cwd=REPO, env=clean_env(**CPU_RANKS), capture_output=True, text=True,
                          timeout=120)
    took = time.monotonic() - t0
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "--plot needs matplotlib" in proc.stderr
    assert "pip install 'ep-comm[plot]'" in proc.stderr and "pip install matplotlib" in proc.stderr
    assert proc.stdout == ""  # no rank started: no header, no table
    assert not png.exists()
    assert took < 60, took  # refused at argument time, not after a run


def test_plot_title_names_device_world_size_and_shape():
    doc = {"device": "NVIDIA H200", "world_size": 8, "mode": "graph", "quant": "fp8", "baseline_backend": "nccl",
           "results": [{**_row("mnnvl", "standard", op, 5.0), "tokens": t, "hidden": 7168, "top_k": 8,
                        "experts": 256, "dtype": "bf16"} for t in (4096, 128) for op in ("dispatch", "combine")]}
    title = bench_plot.title(doc)
    for part in ("NVIDIA H200", "world size 8", "hidden 7168", "top-8 of 256 experts", "bf16", "fp8 dispatch",
                 "tokens per rank 128, 4096", "graph mode"):
        assert part in title, (part, title)
    if HAS_MATPLOTLIB:
        import matplotlib.pyplot as plt

        fig = bench_plot.figure(doc)
        try:
            assert fig.get_suptitle() == title  # the title is on the figure, not only computed
        finally:
            plt.close(fig)


def test_table_columns_gpu_only_on_gpus():
    def headers(gpu: bool, mode: str) -> list[str]:
        return [c[0] for c in table_columns(gpu, mode, recv_hook=False, with_peer=False, baseline_backend="x")]

    gpu_only = {"GB/s", "SMs", "host_us"}
    for mode in ("eager", "graph"):
        assert not gpu_only & set(headers(False, mode))
        assert {"p50_us", "p90_us", "x_a2a_us", "ratio"} <= set(headers(False, mode))
    assert gpu_only <= set(headers(True, "eager"))
    assert {"GB/s", "SMs"} <= set(headers(True, "graph")) and "host_us" not in headers(True, "graph")


@pytest.mark.parametrize("gpu", [False, True])
def test_reporter_table_drops_gpu_columns_on_cpu_and_json_keeps_every_key(tmp_path, capsys, monkeypatch, gpu):
    path = tmp_path / "r.json"
    args = argparse.Namespace(json=str(path), plot=None, mode="graph", routing="uniform", quant="none", iters=2,
                              warmup=0, sets=1)
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    monkeypatch.setattr(bench_report, "device_name", lambda env: "a GPU" if gpu else "cpu")  # no CUDA needed
    env = RankEnv(0, 2, device, None, Topology.from_host_ids(0, ["h", "h"]), "spawn")
    rep = Reporter(env, args, "nccl" if gpu else "gloo", with_peer=False)
    rep.start()
    rep.rows([{**_row("mnnvl", "standard", "dispatch", 5.0), "gbps": 12.5, "sms": 20}])
    header, _, line = capsys.readouterr().out.splitlines()
    cells = dict(zip(header.split(), line.split()))
    if gpu:
        assert cells["GB/s"] == "12.5" and cells["SMs"] == "20"
    else:
        assert "GB/s" not in cells and "SMs" not in cells and len(cells) == len(line.split())
    (result,) = json.loads(path.read_text())["results"]
    assert result["gbps"] == 12.5 and result["sms"] == 20  # the JSON's schema does not depend on the device


def test_bench_refuses_to_time_a_wrong_backend(cli):
    proc = cli(["bench", "--nproc", "2", "--tokens", "8", *SHAPE, "--iters", "2", "--warmup", "0",
                "--backend", "ag_rs", "--layout", "batched", "--inject-fault"], timeout=180, **CPU_RANKS)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAILED oracle check: backend ag_rs, layout batched, tokens 8" in proc.stdout
    assert "combine differs from oracle" in proc.stdout
    assert "dispatch " not in proc.stdout.split("FAILED")[-1]  # no timing row for the failed config


@pytest.mark.parametrize("argv, message", [
    (["--backend", "nosuch"], "unknown backend 'nosuch'"),
    (["--tokens", "0"], "--tokens must be >= 1"),
    (["--quant", "fp8", "--hidden", "100"], "hidden"),
    (["--env", "NCCL_ALGO=Ring"], "--env expects NAME=V1,V2,... with an EP_COMM_* variable"),
    (["--env", "EP_COMM_COMBINE_GROUPED"], "--env expects NAME=V1,V2"),
    (["--env", "EP_COMM_COMBINE_GROUPED=0,,1"], "non-empty values"),
])
def test_bench_argument_errors_exit_2_without_spawning(cli, argv, message):
    proc = cli(["bench", *argv], timeout=60)
    assert proc.returncode == 2
    assert message in proc.stderr


def test_bench_env_variants_share_one_run_and_name_their_rows(cli, tmp_path):
    """--env: each value gets its own communicator, oracle check and rows in the same run (one baseline,
    the same inputs); a value the communicator refuses fails alone."""
    path = tmp_path / "v.json"
    proc = cli(["bench", "--nproc", "2", "--tokens", "8", *SHAPE, "--iters", "2", "--warmup", "0", "--sets", "1",
                "--backend", "naive", "--layout", "standard", "--env", "EP_COMM_COMBINE_GROUPED=-,0,bogus",
                "--json", str(path)], timeout=180, **CPU_RANKS)
    assert proc.returncode == 1, proc.stdout + proc.stderr  # the config of "bogus" failed
    doc = json.loads(path.read_text())
    assert doc["variant_of"] == "EP_COMM_COMBINE_GROUPED"
    assert [(r["variant"], r["op"]) for r in doc["results"]] == [(None, "dispatch"), (None, "combine"),
                                                                 ("0", "dispatch"), ("0", "combine")]
    assert len({r["baseline_nccl_us"] for r in doc["results"]}) == 1  # one baseline for every value
    assert [(f["variant"], f["problems"][0][:15]) for f in doc["failures"]] == [("bogus", "cannot create: ")]
    assert "EP_COMM_COMBINE_GROUPED" in doc["failures"][0]["problems"][0]
    header = next(ln for ln in proc.stdout.splitlines() if ln.startswith("backend"))
    assert header.split()[:3] == ["backend", "variant", "layout"]
    assert [ln.split()[1] for ln in proc.stdout.splitlines() if ln.startswith("naive")] == ["unset"] * 2 + ["0"] * 2
    assert "$EP_COMM_COMBINE_GROUPED=bogus; not timed" in proc.stdout
    assert "$EP_COMM_COMBINE_GROUPED=(unset) (1/3)" in proc.stderr  # progress names the value


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_bench_graph_mode_needs_cuda(cli):
    proc = cli(["bench", "--mode", "graph"], timeout=60)
    assert proc.returncode == 2
    assert "needs CUDA" in proc.stderr


def test_remote_sends_counts_distinct_remote_ranks():
    # 4 experts over 2 ranks: experts 0,1 on rank 0, 2,3 on rank 1
    ids = torch.tensor([[0, 1], [2, 3], [0, 2], [-1, 3], [-1, -1], [1, 1]])
    assert remote_sends(ids, rank=0, world=2, num_experts=4) == 3  # rows 1, 2, 3
    assert remote_sends(ids, rank=1, world=2, num_experts=4) == 3  # rows 0, 2, 5
    assert remote_sends(torch.empty(0, 2, dtype=torch.long), 0, 2, 4) == 0


def _row(backend: str, layout: str, op: str, p50: float) -> dict:
    return {"backend": backend, "layout": layout, "op": op, "tokens": 8, "p50_us": p50, "p90_us": p50 * 2,
            "gbps": 1.0, "sms": None, "baseline_nccl_us": 10.0, "ratio": p50 / 10}


def test_reporter_streams_rows_and_keeps_the_json_whole(tmp_path, capsys):
    """Every row is in the JSON (a complete document) before it is printed, in order, as it comes."""
    path = tmp_path / "r.json"
    args = argparse.Namespace(json=str(path), plot=None, mode="eager", routing="uniform", quant="none", iters=2,
                              warmup=0, sets=1)
    env = RankEnv(0, 2, torch.device("cpu"), None, Topology.from_host_ids(0, ["h", "h"]), "spawn")
    seen = []
    rep = Reporter(env, args, "gloo", with_peer=False, on_write=lambda doc: seen.append(json.loads(path.read_text())
                                                                                   if path.exists() else None))
    rep.start()
    assert json.loads(path.read_text())["results"] == [] and "backend" in capsys.readouterr().out
    batches = [[_row("naive", "standard", "dispatch", 5.0), _row("naive", "standard", "combine", 6.0)],
               [_row("ag_rs", "batched", "dispatch", 7.0), _row("ag_rs", "batched", "combine", 8.0)]]
    for i, batch in enumerate(batches):
        rep.rows(batch, {"timing": 0.5 * (i + 1)})
        doc = json.loads(path.read_text())  # valid JSON after every row: a killed run keeps its rows
        assert [r["p50_us"] for r in doc["results"]] == [r["p50_us"] for b in batches[: i + 1] for r in b]
        assert doc["complete"] is False and doc["phase_times_s"] == {"timing": 0.5 * (i + 1)}
        printed = [ln.split() for ln in capsys.readouterr().out.splitlines()]
        assert [(ln[0], ln[2]) for ln in printed] == [(r["backend"], r["op"]) for r in batch]
    rep.failure("naive", "batched", 8, ["rank 1: combine: differs"])
    rep.finish({"timing": 1.0}, show_phases=False)
    doc = json.loads(path.read_text())
    assert doc["complete"] is True and len(doc["results"]) == 4 and doc["failures"][0]["backend"] == "naive"
    assert not [p for p in os.listdir(tmp_path) if ".tmp" in p]  # the temporary file was renamed over
    assert len(seen) == 5  # start, two batches, the failure, finish


def test_bench_killed_after_its_first_row_keeps_it(tmp_path):
    """Stop a real run as soon as its first row is printed: the JSON on disk holds that row."""
    path = tmp_path / "r.json"
    proc = subprocess.Popen([sys.executable, "-m", "ep_comm", "bench", "--nproc", "2", "--tokens", "8", "16", *SHAPE,
                             "--iters", "4", "--warmup", "1", "--sets", "2", "--json", str(path)],
                            cwd=REPO, env=clean_env(**CPU_RANKS), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True, start_new_session=True)
    try:
        first = None
        for line in proc.stdout:
            if line.split()[:1] and line.split()[0] in registered():
                first = line.split()
                break
        assert first is not None, "no row was printed"
        doc = json.loads(path.read_text())
        assert doc["complete"] is False and doc["results"]
        assert (doc["results"][0]["backend"], doc["results"][0]["op"]) == (first[0], first[2])
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    doc = json.loads(path.read_text())  # still a complete document after the kill
    assert len(doc["results"]) >= 2


def test_bench_peer_not_installed_is_one_line(cli):
    proc = cli(["bench", "--nproc", "2", "--tokens", "8", *SHAPE, "--iters", "2", "--warmup", "0", "--sets", "1",
                "--backend", "ag_rs", "--layout", "standard", "--peer", "deepep", "nccl_ep"], timeout=180,
               **CPU_RANKS)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("peer ")]
    assert len(lines) == 2, proc.stdout
    assert lines[0].startswith("peer deepep: not available (") and "deep_ep" in lines[0]
    assert lines[1].startswith("peer nccl_ep: ")  # not installed here (or found, with no adapter: still one line)
    header = next(ln for ln in proc.stdout.splitlines() if ln.startswith("backend"))
    assert header.split()[-3:] == ["peer", "peer_p50_us", "vs_peer"]


def test_backend_list_parsing():
    assert split_backends(["naive,ag_rs", "auto", "naive"]) == ["naive", "ag_rs", "auto"]
    names, explicit, err = resolve_backend_request(["all"])
    assert names == list(registered()) and not explicit and err is None
    names, explicit, err = resolve_backend_request(["ag_rs"])
    assert names == ["ag_rs"] and explicit and err is None
    assert "unknown backend" in resolve_backend_request(["x"])[2]


def test_format_table_aligns_columns():
    text = format_table(["a", "num"], [["xx", 1], ["y", 22]], right=[1])
    assert text.splitlines() == ["a   num", "--  ---", "xx    1", "y    22"]


FAKE_PEERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fake_peers")


def _with_fake_deepep() -> str:
    return os.pathsep.join([FAKE_PEERS, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)


def test_bench_peer_deepep_adapter_with_a_cpu_stand_in(cli, tmp_path):
    """The adapter's calls, checks, timing and peer columns, against a CPU stand-in of DeepEP's API."""
    path = tmp_path / "p.json"
    proc = cli(["bench", "--nproc", "2", "--tokens", "8", "16", *SHAPE, "--iters", "2", "--warmup", "1", "--sets", "1",
                "--peer", "deepep", "--peer-ll-max-tokens", "8", "--json", str(path)], timeout=240,
               PYTHONPATH=_with_fake_deepep(), **CPU_RANKS)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(path.read_text())
    ran = {(p["peer_variant"], p["op"], p["tokens"]) for p in doc["peers"]}
    want = {(v, op, t) for op in ("dispatch", "combine") for v, t in
            (("normal", 8), ("normal", 16), ("ll", 8), ("ll-fp8", 8))}  # low-latency only up to 8 tokens
    assert ran == want, doc["notes"]
    assert all(p["p50_us"] > 0 and p["backend"] == "deepep" for p in doc["peers"])
    for r in doc["results"]:
        expect = "deepep ll" if (r["layout"] == "batched" and r["tokens"] == 8) else "deepep normal"
        assert r["peer"] == expect, r
        assert r["vs_peer"] == pytest.approx(r["p50_us"] / r["peer_p50_us"], rel=1e-2)
    assert [ln.split()[1] for ln in proc.stdout.splitlines() if ln.startswith("deepep ")][:2] == ["normal", "normal"]


@pytest.mark.parametrize("mode, message", [
    ("wrong", "peer deepep normal FAILED the oracle check at 8 tok; not timed: rank 1: combine: combine differs"),
    ("raise", "peer deepep ll failed at 8 tok: rank 0: RuntimeError: DeepEP error: fake low-latency failure"),
])
def test_bench_peer_failures_are_notes_not_crashes(cli, mode, message):
    proc = cli(["bench", "--nproc", "2", "--tokens", "8", *SHAPE, "--iters", "2", "--warmup", "0", "--sets", "1",
                "--backend", "ag_rs", "--peer", "deepep"], timeout=180,
               PYTHONPATH=_with_fake_deepep(), EP_COMM_FAKE_DEEPEP=mode, **CPU_RANKS)
    assert proc.returncode == 0, proc.stdout + proc.stderr  # a peer's failure is not ours
    assert message in proc.stdout
    assert len([ln for ln in proc.stdout.splitlines() if ln.startswith("ag_rs ")]) == 4  # our rows all timed


def test_slow_host_rows_are_named_in_a_note():
    """Queued eager timing hides the host's issue time only while it is shorter than the GPU's busy-wait."""
    from ep_comm.cli.bench import slow_host_notes

    rows = [{"backend": "naive", "layout": "batched", "op": "dispatch", "tokens": 128, "host_p50_us": 1400.0},
            {"backend": "naive", "layout": "batched", "op": "combine", "tokens": 128, "host_p50_us": 300.0},
            {"backend": "mnnvl", "layout": "standard", "op": "dispatch_recv", "tokens": 128, "host_p50_us": None}]
    notes = slow_host_notes(rows, 1010.0)
    assert len(notes) == 1
    assert "naive/batched dispatch at 128 tok" in notes[0] and "1400 µs" in notes[0] and "1010 µs" in notes[0]
    assert slow_host_notes(rows, 2000.0) == []


@pytest.mark.parametrize("attrs", [{}, {"EP_COMM_TEST_FAKE": True}])
def test_deepep_probe_refuses_cpu_ranks_whatever_the_module_holds(monkeypatch, attrs):
    """DeepEP is driven through its public API only: no attribute of the module lifts the CUDA requirement."""
    import types

    from ep_comm.cli.peers import DeepEPPeer

    module = types.ModuleType("deep_ep")
    for key, value in attrs.items():
        setattr(module, key, value)
    monkeypatch.setitem(sys.modules, "deep_ep", module)
    env = RankEnv(0, 2, torch.device("cpu"), None, Topology.from_host_ids(0, ["h", "h"]), "spawn")
    assert DeepEPPeer.needs_cuda is True
    assert DeepEPPeer.probe(env) == "needs CUDA GPUs (this run is on CPU ranks)"


@pytest.mark.multigpu
def test_bench_gpu_table_keeps_gpu_columns(cli, tmp_path):
    """On GPU ranks the table shows what only GPUs have: host time per eager call, GB/s and SMs."""
    path = tmp_path / "r.json"
    proc = cli(["bench", "--nproc", "2", "--tokens", "8", *SHAPE, "--iters", "2", "--warmup", "1", "--sets", "1",
                "--backend", "ag_rs", "--layout", "standard", "--json", str(path)], timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    header = next(ln for ln in proc.stdout.splitlines() if ln.startswith("backend"))
    assert header.split() == ["backend", "layout", "op", "tokens", "p50_us", "p90_us", "host_us", "GB/s", "SMs",
                              "nccl_a2a_us", "ratio"]
    rows = [ln.split() for ln in proc.stdout.splitlines() if ln.startswith("ag_rs ")]
    assert len(rows) == 2 and all(len(r) == len(header.split()) for r in rows)
    assert all(float(r[7]) > 0 and r[8] == "-" for r in rows)  # GB/s; ag_rs occupies no SMs of its own
    assert json.loads(path.read_text())["baseline_backend"] == "nccl"


def test_git_commit_given_in_the_environment_wins(monkeypatch):
    from ep_comm.cli import bench_report

    monkeypatch.setenv("EP_COMM_GIT_COMMIT", "0123abc")
    assert bench_report.git_commit() == ("0123abc", None)
    monkeypatch.delenv("EP_COMM_GIT_COMMIT")
    commit, _ = bench_report.git_commit()
    assert commit != "0123abc" and commit
