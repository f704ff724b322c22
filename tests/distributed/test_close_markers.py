"""A survivor must not name as lost a peer that left because of another rank's loss and has exited since.

World 3 on one host, rank 0 (which hosts the rendezvous store) killed: the faster survivor (rank 2)
finds rank 0 gone, leaves its close marker, closes and exits; only then does the slower survivor
(rank 1) diagnose.  The store went with rank 0 and ``/proc`` shows rank 2's process gone too, so only
the marker's copy in the host's shared-memory file tells rank 1 that rank 2 left after losing rank 0.
The order, which CI met only under load, is forced here: rank 1 waits until rank 2's process is gone.
"""
from __future__ import annotations

import os
import signal
import time

import pytest

from ep_comm.distributed.spawn import spawn_local

VICTIM, FAST, SLOW = 0, 2, 1


def _wait_gone(ident, what: str, limit_s: float = 60.0) -> None:
    from ep_comm.distributed.liveness import process_gone

    deadline = time.monotonic() + limit_s
    while not process_gone(ident):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} still runs after {limit_s:g} s")
        time.sleep(0.02)


def _follower_exits_first_worker() -> dict:
    from ep_comm.distributed import init_distributed
    from ep_comm.distributed.control import OP_DISPATCH, ControlPlane

    rank = init_distributed(timeout_s=60).rank
    plane = ControlPlane(None, 5.0)
    plane.barrier()
    report = {"agreement": plane.agreement, "token": plane.token}
    if rank == VICTIM:
        os.kill(os.getpid(), signal.SIGKILL)
    _wait_gone(plane.identities[VICTIM], "the victim")
    if rank == SLOW:
        _wait_gone(plane.identities[FAST], "the faster survivor")  # it left, closed and exited
    # what a survivor's failed call does: the transport lost a connection, the plane looks for why
    err = plane.failure(OP_DISPATCH, 7, RuntimeError("Connection closed by peer"))
    report.update(lost=list(err.lost_ranks), missing=list(err.missing_ranks), msg=str(err))
    plane.close(f"closed after {type(err).__name__}")
    return report


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")
@pytest.mark.parametrize("agreement", ["shm", "gloo"])
def test_survivor_that_left_and_exited_is_not_named_lost(agreement: str) -> None:
    env = {"CUDA_VISIBLE_DEVICES": ""} | ({} if agreement == "shm" else {"EP_COMM_SHM_AGREE": "0"})
    results = spawn_local(_follower_exits_first_worker, 3, timeout_s=120, extra_env=lambda r: env,
                          preload=["torch", "ep_comm"])
    assert results[VICTIM].exitcode == -signal.SIGKILL, (results[VICTIM].error, results[VICTIM].traceback)
    for r in (FAST, SLOW):
        res = results[r]
        assert res.ok, f"rank {r}: {res.error_type}: {res.error}\n{res.traceback}"
        rep = res.value
        assert rep["agreement"] == ("shared memory" if agreement == "shm" else "gloo"), rep
        assert rep["lost"] == [VICTIM], f"rank {r}: {rep['msg']}"
        assert f"rank {VICTIM} is gone (its process" in rep["msg"], rep["msg"]
        # the shared file was unlinked once mapped: nothing is left in /dev/shm
        assert not os.path.exists(f"/dev/shm/ep_comm_agree_{rep['token']}"), rep["token"]
    slow = results[SLOW].value
    assert slow["missing"] == [VICTIM, FAST], slow["msg"]
    assert f"rank {FAST} left after losing rank {VICTIM}" in slow["msg"], slow["msg"]
