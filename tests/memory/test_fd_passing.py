"""POSIX fd passing over AF_UNIX/SCM_RIGHTS: between spawned ranks, and the refusal/timeout paths."""
from __future__ import annotations

import os
import random
import socket
import threading

import pytest

from ep_comm.distributed.spawn import raise_on_failure, spawn_local
from ep_comm.errors import EPTimeoutError
from ep_comm.memory.fd_passing import FdPassingError, FdPassingRefused, FdServer, fetch_fds, new_token

SIZE = 4096


def _content(seed: int, rank: int) -> bytes:
    return random.Random(seed * 1009 + rank).randbytes(SIZE)


def _tag(seed: int, writer: int, owner: int) -> bytes:
    return random.Random(seed * 31 + writer * 7 + owner * 100003).randbytes(16)


def _fd_worker(seed: int) -> dict:
    from ep_comm.distributed import gather_topology, init_distributed
    from ep_comm.distributed.exchange import TorchExchange
    from ep_comm.memory.fd_passing import exchange_fds

    init_distributed()
    topo = gather_topology()
    ex = TorchExchange()
    fd = os.memfd_create(f"ep_comm_test_{ex.rank}")
    os.write(fd, _content(seed, ex.rank))
    got = exchange_fds([fd], ex, topo, timeout_s=20)
    seen = {}
    for peer, fds in got.items():
        if len(fds) != 1:
            raise RuntimeError(f"expected one fd from {peer}, got {fds}")
        seen[peer] = os.pread(fds[0], SIZE, 0) == _content(seed, peer)
        # write into the peer's file through our dup: the peer must see it (shared, not copied)
        os.pwrite(fds[0], _tag(seed, ex.rank, peer), SIZE + 16 * ex.rank)
    ex.barrier()
    tags_ok = {p: os.pread(fd, 16, SIZE + 16 * p) == _tag(seed, p, ex.rank) for p in got}
    for fds in got.values():
        os.close(fds[0])
    os.close(fd)
    return {"rank": ex.rank, "peers": sorted(got), "content_ok": seen, "tags_ok": tags_ok}


def test_fds_reach_every_same_host_peer() -> None:
    seed = random.randrange(1 << 30)
    values = raise_on_failure(spawn_local(_fd_worker, 3, args=(seed,), timeout_s=120))
    for v in values:
        others = [r for r in range(3) if r != v["rank"]]
        assert v["peers"] == others
        assert v["content_ok"] == {p: True for p in others}
        assert v["tags_ok"] == {p: True for p in others}


def test_fds_never_cross_hosts() -> None:
    """Ranks {0,1} on host 'a' and {2,3} on host 'b': each only gets its host mate's fd."""
    seed = random.randrange(1 << 30)
    results = spawn_local(_fd_worker, 4, args=(seed,), timeout_s=120,
                          extra_env=lambda r: {"EP_COMM_HOST_ID": "a" if r < 2 else "b"})
    values = raise_on_failure(results)
    mates = {0: [1], 1: [0], 2: [3], 3: [2]}
    for v in values:
        assert v["peers"] == mates[v["rank"]]
        assert all(v["content_ok"].values()) and all(v["tags_ok"].values())


def _serve_in_thread(server: FdServer, ranks, timeout_s: float):
    errors: list[BaseException] = []

    def run() -> None:
        try:
            server.serve(ranks, timeout_s)
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, errors


@pytest.fixture
def memfd():
    fd = os.memfd_create("ep_comm_test")
    data = random.randbytes(64)
    os.write(fd, data)
    yield fd, data
    os.close(fd)


def test_wrong_token_refused_then_right_token_served(memfd) -> None:
    fd, data = memfd
    token = new_token()
    with FdServer([fd], rank=0, token=token) as server:
        t, errors = _serve_in_thread(server, [1], timeout_s=10)
        with pytest.raises(FdPassingRefused, match="wrong token") as info:
            fetch_fds(server.address, new_token(), my_rank=1, peer_rank=0, timeout_s=5)
        assert info.value.peer_rank == 0
        got = fetch_fds(server.address, token, my_rank=1, peer_rank=0, timeout_s=5)
        t.join(10)
    assert not errors and not t.is_alive()
    assert len(got) == 1 and got[0] != fd
    assert os.pread(got[0], 64, 0) == data
    os.close(got[0])


def test_unexpected_rank_refused(memfd) -> None:
    fd, _ = memfd
    token = new_token()
    with FdServer([fd], rank=0, token=token) as server:
        t, errors = _serve_in_thread(server, [1], timeout_s=1.0)
        with pytest.raises(FdPassingRefused, match="not an expected peer"):
            fetch_fds(server.address, token, my_rank=5, peer_rank=0, timeout_s=5)
        t.join(10)
    # the real peer never came: the server names it
    assert len(errors) == 1 and isinstance(errors[0], EPTimeoutError)
    assert errors[0].missing_ranks == (1,)


def test_server_refuses_other_uid(memfd) -> None:
    fd, _ = memfd
    token = new_token()
    with FdServer([fd], rank=0, token=token, allowed_uid=os.getuid() + 1) as server:
        t, errors = _serve_in_thread(server, [1], timeout_s=1.0)
        with pytest.raises(FdPassingRefused, match="uid"):
            fetch_fds(server.address, token, my_rank=1, peer_rank=0, timeout_s=5)
        t.join(10)
    assert len(errors) == 1 and isinstance(errors[0], EPTimeoutError)


def test_client_refuses_listener_of_other_uid_before_sending_token(memfd) -> None:
    fd, _ = memfd
    token = new_token()
    with FdServer([fd], rank=0, token=token) as server:
        t, errors = _serve_in_thread(server, [1], timeout_s=1.0)
        with pytest.raises(FdPassingRefused, match="token not sent"):
            fetch_fds(server.address, token, my_rank=1, peer_rank=0, timeout_s=5, allowed_uid=os.getuid() + 1)
        t.join(10)
    assert len(errors) == 1 and isinstance(errors[0], EPTimeoutError)


def test_silent_listener_times_out_naming_the_peer() -> None:
    """A listener that accepts nothing: connect succeeds (backlog), the answer never comes."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    address = "\0ep_comm-test-silent-" + os.urandom(6).hex()
    sock.bind(address)
    sock.listen(4)
    try:
        with pytest.raises(EPTimeoutError) as info:
            fetch_fds(address, new_token(), my_rank=0, peer_rank=3, timeout_s=0.5)
        assert info.value.missing_ranks == (3,)
        assert "rank 3" in str(info.value)
    finally:
        sock.close()


def test_missing_listener_is_a_typed_error() -> None:
    with pytest.raises(FdPassingError, match="no fd listener of rank 2"):
        fetch_fds("\0ep_comm-test-nobody-" + os.urandom(6).hex(), new_token(), 0, 2, timeout_s=1)


def test_server_without_fds_sends_empty_answer() -> None:
    token = new_token()
    with FdServer([], rank=4, token=token) as server:
        t, errors = _serve_in_thread(server, [2], timeout_s=5)
        assert fetch_fds(server.address, token, my_rank=2, peer_rank=4, timeout_s=5) == []
        t.join(10)
    assert not errors
