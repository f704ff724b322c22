"""Same-host fast path of the per-call agreement: records in a shared-memory file instead of gloo.

On GPU machines the gloo all-gather of the four-number call record, plus the arrival record in the
rendezvous store, costs a large part of a millisecond per eager call (docs/performance.md).  When
every rank of a control plane runs on one host, each rank instead writes its record into its own slot
of a small file in /dev/shm mapped by all of them, and spins until every peer's record for the same
call is there: a few µs.

Slots are double-buffered by the parity of the call's sequence number (a rank can start call n + 2
only after every peer wrote call n + 1, which each does only after seeing call n complete), so a fast
peer never overwrites a record a slower one has yet to read.  Each record carries a CRC, so a reader
never trusts a torn or half-visible record (hosts with weak memory ordering, e.g. Grace).  A peer that
closed its end sets its ``closed`` word; a peer whose process died is found by ``/proc`` polls during
the wait; anything else that keeps a peer away ends at ``timeout_s``.  The caller turns each of these
into the same typed errors as the gloo path.

The same file also holds each rank's close marker (why it left, whom it lost; ``evidence``), beside
the copy in the rendezvous store: the mapping outlives the writer, so a peer on this host can still
read why a rank left after that rank has exited and the store's host is gone with the rank that
hosted it.  That is why the control plane maps the file on one host even when it agrees over gloo.
"""
from __future__ import annotations

import mmap
import os
import secrets
import struct
import time
import zlib
from typing import Callable, Optional, Sequence

__all__ = ["SharedAgreement", "SHM_AGREE_ENV"]

SHM_AGREE_ENV = "EP_COMM_SHM_AGREE"  # "0": always agree over gloo
_DIR = "/dev/shm"
_HEADER = struct.Struct("<16sq")  # nonce, size
_RECORD = struct.Struct("<qqqqqI")  # seq, op, epoch, status, num_tokens, crc32 of the first 40 bytes
_SLOT = 64  # bytes per (rank, parity) record; the closed word follows the 2 records of a rank
_RANK_BYTES = 2 * _SLOT + 64
_MARKER_HEAD = struct.Struct("<qII")  # generation, length, crc32 of the text
_POLL_LIVENESS_S = 0.02
_GRACE_S = 0.002  # before a wait ends without a record: look again for this long


def _marker_bytes(size: int) -> int:
    """Room for one copy of a rank's close marker: a whole ``evidence.encode_marker`` text, whose reason
    (at most 300 characters, at most 12 bytes each once JSON escapes them) and cause (at most every
    other member's global rank) fit with room to spare."""
    return _MARKER_HEAD.size + 4096 + 24 * size


def file_bytes(size: int) -> int:
    """The size of a plane's shared file: header, each rank's records, each rank's two marker copies."""
    return _HEADER.size + size * (_RANK_BYTES + 2 * _marker_bytes(size))


class SharedAgreement:
    """One mapped file per control plane; ``rank`` writes its slot, reads every other."""

    def __init__(self, mm: mmap.mmap, rank: int, size: int):
        self._mm = mm
        self.rank = rank
        self.size = size
        self.seq = 0
        self._marker_gen = 0

    # -- setup (collective through ``exchange``, the control plane's gloo all-gather) ---------------------
    @classmethod
    def open(cls, rank: int, size: int, token: str, exchange: Callable[[object], list]) -> Optional[SharedAgreement]:
        """The shared file for this plane, or None on every rank when any rank cannot map it (another
        /dev/shm, no permission): the caller then agrees over gloo.  Collective."""
        path = os.path.join(_DIR, f"ep_comm_agree_{token}")
        nbytes = file_bytes(size)
        nonce = secrets.token_bytes(16) if rank == 0 else b""
        mm, err = None, ""
        if rank == 0:
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
                try:
                    os.ftruncate(fd, nbytes)
                    mm = mmap.mmap(fd, nbytes)
                finally:
                    os.close(fd)
                _HEADER.pack_into(mm, 0, nonce, size)
            except OSError as exc:
                err = f"{type(exc).__name__}: {exc}"
        nonces = exchange(nonce if not err else None)
        if rank != 0 and nonces[0] is not None:
            try:
                fd = os.open(path, os.O_RDWR)
                try:
                    mm = mmap.mmap(fd, nbytes)
                finally:
                    os.close(fd)
                if _HEADER.unpack_from(mm, 0) != (nonces[0], size):
                    err = "another file under that name"
            except (OSError, ValueError) as exc:
                err = f"{type(exc).__name__}: {exc}"
        ok = exchange(mm is not None and not err)
        if rank == 0 and mm is not None:
            try:
                os.unlink(path)  # the mappings keep it alive; nothing is left behind after a crash
            except OSError:
                pass
        if mm is None or not all(ok):  # without a mapping this rank's own vote is False
            if mm is not None:
                mm.close()
            return None
        return cls(mm, rank, size)

    # -- records --------------------------------------------------------------------------------------
    def _offset(self, rank: int, parity: int) -> int:
        return _HEADER.size + rank * _RANK_BYTES + parity * _SLOT

    def _closed_offset(self, rank: int) -> int:
        return _HEADER.size + rank * _RANK_BYTES + 2 * _SLOT

    def post(self, op: int, epoch: int, status: int, num_tokens: int) -> int:
        """Write this rank's record of its next call; returns the call's sequence number."""
        self.seq += 1
        body = struct.pack("<qqqqq", self.seq, op, epoch, status, num_tokens)
        off = self._offset(self.rank, self.seq & 1)
        self._mm[off: off + _RECORD.size] = body + struct.pack("<I", zlib.crc32(body))
        return self.seq

    def _read(self, rank: int, seq: int) -> Optional[tuple[int, int, int, int]]:
        """``rank``'s record of call ``seq`` (op, epoch, status, num_tokens) when fully there, else None."""
        off = self._offset(rank, seq & 1)
        raw = self._mm[off: off + _RECORD.size]
        s, op, epoch, status, tokens, crc = _RECORD.unpack(raw)
        if s != seq or zlib.crc32(raw[:40]) != crc:
            return None
        return op, epoch, status, tokens

    def last_seen(self, rank: int) -> Optional[tuple[int, int]]:
        """(op, epoch) of the latest complete record of ``rank``, if any."""
        best = None
        for parity in (0, 1):
            raw = self._mm[self._offset(rank, parity): self._offset(rank, parity) + _RECORD.size]
            s, op, epoch, _, _, crc = _RECORD.unpack(raw)
            if s > 0 and zlib.crc32(raw[:40]) == crc and (best is None or s > best[0]):
                best = (s, op, epoch)
        return None if best is None else (best[1], best[2])

    def mark_closed(self) -> None:
        try:
            struct.pack_into("<q", self._mm, self._closed_offset(self.rank), 1)
        except ValueError:  # already unmapped
            pass

    def closed(self, rank: int) -> bool:
        return struct.unpack_from("<q", self._mm, self._closed_offset(rank))[0] != 0

    # -- close markers ---------------------------------------------------------------------------------
    # Two copies per rank, written alternately: a reader that meets a copy being rewritten (torn: its
    # crc fails) still finds the previous complete marker in the other one.
    def _marker_offset(self, rank: int, copy: int) -> int:
        return _HEADER.size + self.size * _RANK_BYTES + (2 * rank + copy) * _marker_bytes(self.size)

    def leave_marker(self, text: str) -> None:
        """Publish this rank's close marker (replacing an earlier one) to the peers on this host."""
        raw = text.encode()[: _marker_bytes(self.size) - _MARKER_HEAD.size]  # fits whole: see _marker_bytes
        self._marker_gen += 1
        off = self._marker_offset(self.rank, self._marker_gen & 1)
        try:
            _MARKER_HEAD.pack_into(self._mm, off, 0, 0, 0)  # no copy claims this generation until complete
            self._mm[off + _MARKER_HEAD.size: off + _MARKER_HEAD.size + len(raw)] = raw
            _MARKER_HEAD.pack_into(self._mm, off, self._marker_gen, len(raw), zlib.crc32(raw))
        except ValueError:  # already unmapped (closed): the store's copy is all there is
            pass

    def marker(self, rank: int) -> Optional[str]:
        """``rank``'s latest complete close marker, None when it left none (or this view is closed)."""
        best: tuple[int, str] = (0, "")
        try:
            for copy in (0, 1):
                off = self._marker_offset(rank, copy)
                gen, n, crc = _MARKER_HEAD.unpack_from(self._mm, off)
                raw = self._mm[off + _MARKER_HEAD.size: off + _MARKER_HEAD.size + n]
                if gen > best[0] and n == len(raw) and zlib.crc32(raw) == crc:
                    best = (gen, raw.decode(errors="replace"))
        except ValueError:  # this rank's view is closed
            return None
        return best[1] if best[0] else None

    def wait(self, seq: int, timeout_s: float, gone: Callable[[Sequence[int]], bool]) -> tuple[list, list[int], str]:
        """Every rank's record of call ``seq``: ``(records, missing, why)``; ``missing`` is empty on
        success, else the ranks whose record did not come and ``why`` says what ended the wait
        (``"closed"``, ``"gone"`` when ``gone(missing)`` found a dead process, or ``"timeout"``)."""
        records: list = [None] * self.size
        pending = list(range(self.size))
        start = time.monotonic()
        deadline, long_wait, next_poll = start + timeout_s, start + 0.05, start + _POLL_LIVENESS_S
        spins = 0

        def read_pending() -> list[int]:
            for r in pending:
                records[r] = self._read(r, seq)
            return [r for r in pending if records[r] is None]

        while True:
            pending = read_pending()
            if not pending:
                return records, [], ""
            now = time.monotonic()
            poll = now >= next_poll
            if poll:
                next_poll = now + _POLL_LIVENESS_S
            why = ("closed" if any(self.closed(r) for r in pending) else
                   "gone" if poll and gone(pending) else
                   "timeout" if now >= deadline else "")
            if why:
                # A peer writes its record before it closes or exits, and may have done both since the
                # read above (it saw our record and moved on): only a record still absent now is missing.
                # The grace covers hosts whose stores may become visible out of order (aarch64).
                grace = time.monotonic() + _GRACE_S
                pending = read_pending()
                while pending and time.monotonic() < grace:
                    time.sleep(0)
                    pending = read_pending()
                return records, pending, why if pending else ""
            spins += 1
            if spins > 200:  # give the peers the cores on busy hosts; a long wait (a slow peer) naps longer
                time.sleep(0 if spins < 5000 else 0.0002 if now < long_wait else 0.001)

    def close(self) -> None:
        self.mark_closed()
        try:
            self._mm.close()
        except (BufferError, ValueError):
            pass
