"""Passing POSIX file descriptors between the processes of one host (AF_UNIX + SCM_RIGHTS).

cuMem POSIX_FD handles are file descriptors: a peer can only import one it holds itself.  Each rank
listens on an abstract-namespace AF_UNIX ``SOCK_SEQPACKET`` socket with a random name and hands a dup
of its fds to every same-host peer that connects.  The abstract namespace has no file permissions
and its names are listed in /proc/net/unix, so access is checked instead:

- both sides read the other's credentials (``SO_PEERCRED``) and accept only our own uid; a client
  checks the listener *before* presenting the token, so the token never goes to an impostor;
- the client presents the group token (random, carried by the group's own ``Exchange``); a wrong
  token, an unexpected rank or another uid is answered with a refusal, which the client raises as
  ``FdPassingRefused``, and the server keeps waiting for the real peer;
- every accept/recv has a timeout: a peer that never comes gives ``EPTimeoutError`` naming it.

Wire format (one SEQPACKET message each way): request ``MAGIC | token(32) | rank(u32)``; answer
``b"K" | rank(u32) | count(u32)`` with the fds attached, or ``b"R" | reason``.
"""
from __future__ import annotations

import hmac
import json
import os
import secrets
import socket
import struct
import threading
import time
from typing import Iterable, Optional, Sequence

from ..distributed.exchange import Exchange
from ..distributed.topology import Topology
from ..errors import EPError, EPTimeoutError

__all__ = [
    "FdPassingError", "FdPassingRefused", "FdServer", "fetch_fds", "exchange_fds", "new_token", "TOKEN_BYTES",
]

MAGIC = b"EPFD1"
TOKEN_BYTES = 32
MAX_FDS = 64
_REQUEST = struct.Struct("!5s32sI")
_ANSWER = struct.Struct("!1sII")
_UCRED = struct.Struct("3i")  # struct ucred {pid_t pid; uid_t uid; gid_t gid;}
_POLL_S = 0.1  # accept() wakes this often to notice a stop request
_REQUEST_WAIT_S = 5.0  # a real peer sends its request right after connecting


class FdPassingError(EPError):
    """Handing fds to or from ``peer_rank`` failed (no listener, malformed answer, ...)."""

    def __init__(self, message: str, peer_rank: Optional[int] = None):
        self.peer_rank = peer_rank
        super().__init__(message)


class FdPassingRefused(FdPassingError):
    """The other side refused: wrong token, unexpected rank or another uid (``reason`` says which)."""

    def __init__(self, message: str, peer_rank: Optional[int] = None, reason: str = ""):
        self.reason = reason
        super().__init__(message, peer_rank)


def new_token() -> bytes:
    """A fresh random group token."""
    return secrets.token_bytes(TOKEN_BYTES)


def _peer_uid(sock: socket.socket) -> int:
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    return _UCRED.unpack(raw)[1]


def _new_socket() -> socket.socket:
    return socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)


class FdServer:
    """Listener that hands dups of ``fds`` to authenticated same-host peers.

    ``address`` is an abstract-namespace name (a str starting with NUL).  ``allowed_uid`` defaults to
    our own uid (tests pass another to exercise the refusal path).  The token may be set after
    construction (``token`` attribute), once the group has agreed on one.
    """

    def __init__(self, fds: Sequence[int], rank: int, token: Optional[bytes] = None,
                 allowed_uid: Optional[int] = None):
        self.rank = int(rank)
        self.token = token
        self._fds = [int(f) for f in fds]
        if len(self._fds) > MAX_FDS:
            raise FdPassingError(f"rank {rank}: {len(self._fds)} fds to pass, at most {MAX_FDS}")
        self._uid = os.getuid() if allowed_uid is None else int(allowed_uid)
        self._stop = threading.Event()
        self._sock = _new_socket()
        self.address = "\0ep_comm-fd-" + secrets.token_hex(12)
        try:
            self._sock.bind(self.address)
            self._sock.listen(128)
        except OSError:
            self._sock.close()
            raise

    def stop(self) -> None:
        """Ask a running ``serve`` to return (it notices within ~0.1 s)."""
        self._stop.set()

    def close(self) -> None:
        self._stop.set()
        self._sock.close()

    def __enter__(self) -> FdServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def serve(self, ranks: Iterable[int], timeout_s: float) -> None:
        """Serve until every rank in ``ranks`` got the fds; ``EPTimeoutError`` names those that did not."""
        if self.token is None:
            raise FdPassingError(f"rank {self.rank}: FdServer.serve called before the token was set")
        pending = set(int(r) for r in ranks)
        deadline = time.monotonic() + timeout_s
        while pending:
            if self._stop.is_set():
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise EPTimeoutError(
                    f"rank {self.rank}: same-host peer rank(s) {sorted(pending)} did not fetch its memory "
                    f"handles within {timeout_s:.1f}s",
                    pending,
                )
            self._sock.settimeout(min(remaining, _POLL_S))
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            with conn:
                served = self._answer(conn, pending, min(remaining, _REQUEST_WAIT_S))
            if served is not None:
                pending.discard(served)

    def _answer(self, conn: socket.socket, pending: set[int], timeout_s: float) -> Optional[int]:
        """Handle one connection; return the rank served, or None (refused / gave up on it)."""
        conn.settimeout(max(timeout_s, 0.01))
        try:
            # Read the request before any refusal: closing a unix socket with unread data resets the
            # connection, and the client would see ECONNRESET instead of the reason.
            req = conn.recv(_REQUEST.size + 1)
            uid = _peer_uid(conn)
            if uid != self._uid:
                self._refuse(conn, f"uid {uid} is not allowed (listener accepts uid {self._uid})")
                return None
            if len(req) != _REQUEST.size:
                self._refuse(conn, "malformed request")
                return None
            magic, token, rank = _REQUEST.unpack(req)
            if magic != MAGIC or not hmac.compare_digest(token, self.token or b""):
                self._refuse(conn, "wrong token")
                return None
            if rank not in pending:
                self._refuse(conn, f"rank {rank} is not an expected peer of rank {self.rank}")
                return None
            header = _ANSWER.pack(b"K", self.rank, len(self._fds))
            if self._fds:
                socket.send_fds(conn, [header], self._fds)
            else:  # SCM_RIGHTS with zero fds is not portable; send the bare header
                conn.send(header)
            return rank
        except OSError:  # includes timeouts: a silent or vanished client is not a peer we serve
            return None

    @staticmethod
    def _refuse(conn: socket.socket, reason: str) -> None:
        try:
            conn.send(b"R" + reason.encode()[:1000])
        except OSError:
            pass


def fetch_fds(address: str, token: bytes, my_rank: int, peer_rank: int, timeout_s: float,
              allowed_uid: Optional[int] = None) -> list[int]:
    """Connect to ``peer_rank``'s ``FdServer`` at ``address`` and return dups of its fds (ours to close)."""
    want_uid = os.getuid() if allowed_uid is None else int(allowed_uid)
    sock = _new_socket()
    sock.settimeout(timeout_s)
    fds: list[int] = []
    try:
        try:
            sock.connect(address)
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            raise FdPassingError(
                f"rank {my_rank}: no fd listener of rank {peer_rank} at {address!r} ({exc}); are both ranks "
                "really on one host and in one network namespace?",
                peer_rank,
            ) from exc
        uid = _peer_uid(sock)
        if uid != want_uid:  # checked before the token leaves this process
            raise FdPassingRefused(
                f"rank {my_rank}: the listener for rank {peer_rank} belongs to uid {uid}, not {want_uid}; "
                "token not sent",
                peer_rank, "listener uid mismatch",
            )
        sock.send(_REQUEST.pack(MAGIC, bytes(token), int(my_rank)))
        msg, fds, flags, _ = socket.recv_fds(sock, 4096, MAX_FDS)
    except ConnectionResetError as exc:
        _close_all(fds)
        raise FdPassingError(f"rank {my_rank}: rank {peer_rank} reset the connection ({exc})", peer_rank) from exc
    except TimeoutError as exc:
        _close_all(fds)
        raise EPTimeoutError(
            f"rank {my_rank}: rank {peer_rank} did not hand over its memory handles within {timeout_s:.1f}s",
            [peer_rank],
        ) from exc
    except BaseException:
        _close_all(fds)
        raise
    finally:
        sock.close()
    if msg[:1] == b"R":
        _close_all(fds)
        reason = msg[1:].decode(errors="replace")
        raise FdPassingRefused(f"rank {my_rank}: rank {peer_rank} refused the fd request: {reason}",
                               peer_rank, reason)
    if flags & getattr(socket, "MSG_CTRUNC", 0) or len(msg) != _ANSWER.size or msg[:1] != b"K":
        _close_all(fds)
        raise FdPassingError(f"rank {my_rank}: malformed fd answer from rank {peer_rank}", peer_rank)
    _, srv_rank, count = _ANSWER.unpack(msg)
    if srv_rank != peer_rank or count != len(fds):
        _close_all(fds)
        raise FdPassingError(
            f"rank {my_rank}: expected fds of rank {peer_rank}, got {len(fds)} fd(s) announced as "
            f"{count} from rank {srv_rank}",
            peer_rank,
        )
    return list(fds)


def _close_all(fds: Iterable[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def exchange_fds(fds: Sequence[int], exchange: Exchange, topology: Topology,
                 timeout_s: float = 60.0) -> dict[int, list[int]]:
    """Collective over ``exchange``: every rank offers its ``fds``; returns ``{peer: [dup fds]}``.

    Only same-host peers (per ``topology``) are contacted; ranks with none still take part in the
    one all-gather.  The returned fds are new descriptors the caller must close; the caller's own
    ``fds`` stay open.  The group token is rank 0's random token, carried by ``exchange``.
    """
    me = exchange.rank
    if topology.world_size != exchange.size or topology.rank != me:
        raise EPError(
            f"exchange_fds: topology (rank {topology.rank} of {topology.world_size}) does not match the "
            f"exchange (rank {me} of {exchange.size})"
        )
    peers = [r for r in topology.ranks_by_host[topology.host_of(me)] if r != me]
    server = FdServer(fds, me) if peers else None
    try:
        mine = {"address": server.address if server else "", "token": new_token().hex()}
        infos = [json.loads(raw.decode()) for raw in exchange.allgather_bytes(json.dumps(mine).encode())]
        token = bytes.fromhex(infos[0]["token"])
        if server is None:
            return {}
        server.token = token
        errors: list[BaseException] = []

        def run() -> None:
            try:
                server.serve(peers, timeout_s)
            except BaseException as exc:  # re-raised on the calling thread below
                errors.append(exc)

        thread = threading.Thread(target=run, name=f"ep_comm-fd-server-{me}", daemon=True)
        thread.start()
        got: dict[int, list[int]] = {}
        deadline = time.monotonic() + timeout_s
        try:
            for p in peers:
                remaining = max(deadline - time.monotonic(), 0.01)
                got[p] = fetch_fds(infos[p]["address"], token, me, p, remaining)
        except BaseException:
            server.stop()
            thread.join()
            for fl in got.values():
                _close_all(fl)
            raise
        thread.join()
        if errors:
            for fl in got.values():
                _close_all(fl)
            raise errors[0]
        return got
    finally:
        if server is not None:
            server.close()
