"""The same-host shared-memory agreement (ep_comm.distributed.shm_agree), on two mappings of one file in
one process (the cross-process behaviour is covered by the communicator and peer-failure tests)."""
from __future__ import annotations

import mmap
import os
import struct
import time

import pytest

from ep_comm.distributed import shm_agree
from ep_comm.distributed.shm_agree import SharedAgreement

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")


def _pair(size: int = 2):
    """One view per rank of one shared file (what SharedAgreement.open sets up across processes)."""
    path = os.path.join(shm_agree._DIR, f"ep_comm_agree_test_{os.urandom(6).hex()}")
    nbytes = shm_agree.file_bytes(size)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.ftruncate(fd, nbytes)
    maps = [mmap.mmap(fd, nbytes) for _ in range(size)]
    os.close(fd)
    os.unlink(path)
    return [SharedAgreement(maps[r], r, size) for r in range(size)]


def test_records_meet_and_parity_keeps_the_previous_call_readable():
    a, b = _pair()
    s1 = a.post(1, 0, 0, 5)
    assert b._read(0, s1) == (1, 0, 0, 5)
    assert b.post(1, 0, 0, 7) == s1
    recs, missing, why = a.wait(s1, 1.0, lambda ranks: False)
    assert (missing, why) == ([], "") and recs == [(1, 0, 0, 5), (1, 0, 0, 7)]
    s2 = a.post(2, 0, 0, 5)  # a runs ahead into call 2; b can still read a's call 1 record
    assert b._read(0, s1) == (1, 0, 0, 5) and b._read(0, s2) == (2, 0, 0, 5)
    assert a.last_seen(1) == (1, 0) and b.last_seen(0) == (2, 0)


def test_torn_record_is_not_trusted():
    a, b = _pair()
    seq = a.post(1, 3, 0, 9)
    off = a._offset(0, seq & 1)
    struct.pack_into("<q", a._mm, off + 16, 4)  # epoch changed after the crc was written: a torn write
    assert b._read(0, seq) is None
    assert b.last_seen(0) is None


def test_wait_ends_on_timeout_on_a_closed_peer_and_on_a_dead_one():
    a, b = _pair()
    seq = a.post(1, 0, 0, 1)
    t0 = time.monotonic()
    _, missing, why = a.wait(seq, 0.2, lambda ranks: False)
    assert (missing, why) == ([1], "timeout") and 0.15 < time.monotonic() - t0 < 2
    _, missing, why = a.wait(seq, 5.0, lambda ranks: True)
    assert (missing, why) == ([1], "gone")
    b.mark_closed()
    _, missing, why = a.wait(seq, 5.0, lambda ranks: False)
    assert (missing, why) == ([1], "closed")


def test_record_layout_fits_its_slot():
    assert shm_agree._RECORD.size <= shm_agree._SLOT


def test_peer_that_wrote_then_closed_between_read_and_check_is_not_missing(monkeypatch):
    """The race CI hit: the peer posts its record, sees ours, finishes the call and closes, all between
    our read of its slot and our look at its closed word; its record is there, so the call succeeded."""
    a, b = _pair()
    seq = a.post(2, 3, 0, 1)
    real_read = SharedAgreement._read
    first = {"done": False}

    def read_then_peer_finishes(self, rank, s):
        out = real_read(self, rank, s)
        if rank == 1 and not first["done"]:
            first["done"] = True
            b.post(2, 3, 0, 4)  # between our read and our closed check
            b.mark_closed()
        return out

    monkeypatch.setattr(SharedAgreement, "_read", read_then_peer_finishes)
    recs, missing, why = a.wait(seq, 5.0, lambda ranks: False)
    assert (missing, why) == ([], "") and recs == [(2, 3, 0, 1), (2, 3, 0, 4)]


def test_peer_that_wrote_then_exited_between_read_and_poll_is_not_missing():
    a, b = _pair()
    seq = a.post(1, 0, 0, 1)

    def gone_after_writing(ranks):
        b.post(1, 0, 0, 2)  # it wrote its record and exited just before the liveness poll
        return True

    recs, missing, why = a.wait(seq, 5.0, gone_after_writing)
    assert (missing, why) == ([], "") and recs[1] == (1, 0, 0, 2)


def test_close_marker_outlives_its_writers_view():
    """What a survivor reads when the leaver has exited and the store's host is gone with the victim."""
    a, b, c = _pair(3)
    assert b.marker(2) is None
    c.leave_marker("first")
    c.leave_marker('{"reason": "it failed", "because_of": [0], "aborted": false}')
    c.close()  # the leaver unmaps (as its exit does): its marker stays in the peers' mappings
    assert b.marker(2) == a.marker(2) == '{"reason": "it failed", "because_of": [0], "aborted": false}'
    assert b.marker(0) is None and b.marker(1) is None
    b.close()
    assert b.marker(2) is None  # a closed view answers nothing rather than raising


def test_torn_close_marker_falls_back_to_the_previous_one():
    a, b = _pair()
    b.leave_marker("closed")
    b.leave_marker("closed again")
    off = b._marker_offset(1, b._marker_gen & 1)
    a._mm[off + shm_agree._MARKER_HEAD.size] ^= 0xFF  # the rewrite is not complete yet: crc fails
    assert a.marker(1) == "closed"


def test_largest_close_marker_fits_whole():
    from ep_comm.distributed.evidence import decode_marker, encode_marker

    size, first = 64, 10**6  # every other member lost, each with a long global rank
    members = list(range(first, first + size))
    views = _pair(size)
    # a reason whose every character JSON escapes to 12 bytes (a surrogate pair)
    views[5].leave_marker(encode_marker("\U0001F600" * 400, members[:5] + members[6:], aborted=True))
    reason, blamed, aborted = decode_marker(views[0].marker(5) or "", members)
    assert reason == "\U0001F600" * 300 and blamed == [r for r in range(size) if r != 5] and aborted
