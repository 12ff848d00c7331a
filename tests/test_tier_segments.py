"""Unit tests for the segment store (kvstore/tiers/segments.py): payloads in
value files, index records in RocksDB, reclaim, corruption, kill -9 order."""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap

import pytest
from rocksdict import Rdict

from kvstore.tiers.segments import (FILE_HEADER, STEPS, Location, SegmentStore,
                                    read_into, segment_name)


def payload(i: int, n: int) -> bytes:
    return bytes([(i * 7 + j) % 251 for j in range(min(n, 251))]) * (n // 251) + bytes(n % 251)


@pytest.fixture
def opened(tmp_path):
    made = []

    def open_store(**kw):
        db = Rdict(str(tmp_path / "index"))
        store = SegmentStore(str(tmp_path / "segs"), db, **kw)
        made.append((store, db))
        return store

    def close_all():
        while made:
            store, db = made.pop()
            store.close()
            db.close()

    open_store.close_all = close_all
    yield open_store
    close_all()


def test_put_get_into_round_trip_and_overwrite(opened):
    store = opened()
    for i, n in enumerate((0, 1, 4096, 256 << 10, (1 << 20) + 3)):
        data = payload(i, n)
        loc = store.put(b"k%d" % i, data, b"extra")
        assert loc.length == n
        buf = bytearray(n + 10)
        assert store.get_into(b"k%d" % i, buf) == n
        assert bytes(buf[:n]) == data
        assert store.locate(b"k%d" % i)[1] == b"extra"
    store.put(b"k2", b"new")
    assert store.get(b"k2") == b"new"
    assert store.get(b"missing") is None
    assert store.delete(b"k2") and not store.delete(b"k2")
    assert store.get(b"k2") is None


def test_read_into_is_one_preadv_into_the_callers_buffer(opened):
    store = opened()
    data = payload(3, 300_000)
    loc = store.put(b"k", data)
    fd = os.open(os.path.join(store.dir, segment_name(loc.segment)), os.O_RDONLY)
    try:
        import numpy as np
        dest = np.zeros(300_000, dtype=np.uint8)
        assert read_into(fd, loc, dest) == 300_000
        assert dest.tobytes() == data
        bad = Location(loc.segment, loc.offset + 1, loc.length, loc.checksum)
        assert read_into(fd, bad, dest) is None
    finally:
        os.close(fd)


def test_restart_reads_the_index_and_starts_a_new_segment(opened):
    store = opened()
    for i in range(20):
        store.put(b"k%d" % i, payload(i, 10_000))
    first = store.segments()
    opened.close_all()
    store = opened()
    assert store.segments() == first + [first[-1] + 1]
    for i in range(20):
        assert store.get(b"k%d" % i) == payload(i, 10_000)


def test_segments_roll_and_orphans_go_at_open(opened, tmp_path):
    store = opened(segment_bytes=64 << 10)
    for i in range(10):
        store.put(b"k", payload(i, 30_000))         # each overwrite kills the one before
    assert len(store.segments()) >= 4
    opened.close_all()
    store = opened(segment_bytes=64 << 10)
    # only the newest value's segment and the new active one are left
    assert len(store.segments()) == 2
    assert store.get(b"k") == payload(9, 30_000)


def test_reclaim_under_overwrites_keeps_every_value_and_frees_space(opened):
    store = opened(segment_bytes=256 << 10, reclaim_below=0.5, rate_bytes_s=0)
    truth = {}
    for round_ in range(6):
        for i in range(40):
            if round_ == 0 or ((i + round_) % 3 == 0 and i % 4):   # every 4th key stays put
                truth[b"k%d" % i] = payload(i * 10 + round_, 20_000)
                store.put(b"k%d" % i, truth[b"k%d" % i])
        if round_ % 2:
            store.delete(b"k%d" % round_)
            truth.pop(b"k%d" % round_)
    before = store.disk_bytes()
    assert store.victims()
    copied = store.reclaim()
    assert copied > 0 and store.reclaimed_segments > 0
    assert store.disk_bytes() < before
    assert not store.victims()
    for key, data in truth.items():
        assert store.get(key) == data
    live = sum(os.path.getsize(os.path.join(store.dir, segment_name(s))) for s in store.segments())
    assert live == store.disk_bytes()
    # and after a restart
    opened.close_all()
    store = opened(segment_bytes=256 << 10)
    for key, data in truth.items():
        assert store.get(key) == data
    gone = [b"k%d" % i for i in range(40) if b"k%d" % i not in truth]
    assert gone and all(store.get(key) is None for key in gone)


def test_reclaim_loses_to_a_racing_overwrite(opened):
    store = opened(segment_bytes=64 << 10, rate_bytes_s=0)
    for i in range(8):
        store.put(b"k%d" % i, payload(i, 20_000))
    for i in range(1, 8):
        store.delete(b"k%d" % i)
    victim = store.locate(b"k0")[0].segment
    assert victim in store.victims()
    real_append = store._append

    def append_then_overwrite(key, view, digest=None):
        loc = real_append(key, view, digest)
        if digest is not None:             # the reclaim's copy: a put lands meanwhile
            store.put(key, b"newer")
        return loc

    store._append = append_then_overwrite
    store.reclaim()
    store._append = real_append
    assert store.get(b"k0") == b"newer"


def test_reclaim_is_bounded_in_rate(opened):
    store = opened(segment_bytes=64 << 10, rate_bytes_s=100_000)
    for i in range(8):
        store.put(b"k%d" % i, payload(i, 20_000))
    for i in range(0, 8, 2):
        store.delete(b"k%d" % i)
    slept = []
    copied = store.reclaim(sleep=slept.append)
    assert copied >= 20_000
    assert sum(slept) >= copied / 100_000 * 0.5     # it paced itself by the copied bytes


def test_a_corrupted_segment_byte_is_a_miss_and_a_log_line(opened, caplog):
    store = opened()
    store.put(b"good", payload(1, 50_000))
    loc = store.put(b"bad", payload(2, 50_000))
    path = os.path.join(store.dir, segment_name(loc.segment))
    with open(path, "r+b") as f:
        f.seek(loc.offset + 1234)
        byte = f.read(1)
        f.seek(loc.offset + 1234)
        f.write(bytes([byte[0] ^ 0x40]))
    buf = bytearray(50_000)
    with caplog.at_level(logging.ERROR, logger="kvstore.tiers.segments"):
        assert store.get_into(b"bad", buf) is None
    assert "failed its checksum" in caplog.text
    assert store.checksum_failures == 1
    assert store.locate(b"bad") is None                  # dropped, reported once
    assert store.get(b"good") == payload(1, 50_000)


def test_a_truncated_segment_is_a_miss(opened):
    store = opened()
    loc = store.put(b"k", payload(1, 50_000))
    os.truncate(os.path.join(store.dir, segment_name(loc.segment)), loc.offset + 100)
    assert store.get(b"k") is None


CHILD = textwrap.dedent("""
    import os, signal, sys
    from rocksdict import Rdict
    from kvstore.tiers.segments import SegmentStore
    base, step, sync = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
    armed = [False]
    def fault(name):
        if armed[0] and name == step:
            os.kill(os.getpid(), signal.SIGKILL)
    db = Rdict(base + "/index")
    store = SegmentStore(base + "/segs", db, fault=fault, sync=sync)
    store.put(b"k", b"A" * 300_000)
    store.put(b"other", b"B" * 1000)
    armed[0] = True
    store.put(b"k", b"C" * 300_000)
    print("survived", flush=True)
""")


@pytest.mark.parametrize("sync", [False, True])
@pytest.mark.parametrize("step", STEPS)
def test_kill_9_at_each_step_of_a_write_never_serves_a_torn_value(opened, tmp_path, step, sync):
    proc = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path), step, "1" if sync else "0"],
                          capture_output=True, text=True, cwd=os.getcwd(), timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    store = opened()
    got = store.get(b"k")
    if step == "indexed":
        assert got == b"C" * 300_000
    else:
        assert got == b"A" * 300_000          # the old value, whole
    assert store.get(b"other") == b"B" * 1000
    assert store.checksum_failures == 0


def test_an_index_record_whose_bytes_never_landed_is_a_miss(opened, tmp_path):
    """What a torn write would look like if the order were broken: never wrong bytes."""
    store = opened()
    loc = store.put(b"k", payload(4, 100_000))
    # overwrite the tail of the payload with zeros, as a lost page would look
    path = os.path.join(store.dir, segment_name(loc.segment))
    fd = os.open(path, os.O_WRONLY)
    os.pwrite(fd, bytes(4096), loc.offset + loc.length - 4096)
    os.close(fd)
    assert store.get(b"k") is None
    assert store.checksum_failures == 1


def test_file_header_names_the_segment(opened):
    store = opened()
    loc = store.put(b"k", b"x")
    with open(os.path.join(store.dir, segment_name(loc.segment)), "rb") as f:
        magic, version, seg = FILE_HEADER.unpack(f.read(FILE_HEADER.size))
    assert (magic[:5], version, seg) == (b"KVSEG", 1, loc.segment)


def test_put_many_is_one_index_write_and_the_last_of_a_key_wins(opened):
    calls = []
    store = opened()

    def write_index(records):
        calls.append(list(records))
        for key, raw in records:
            if raw is None:
                del store.index[key]
            else:
                store.index[key] = raw

    store.write_index = write_index
    store.put(b"a", b"old")
    store.put_many([(b"a", b"x" * 5000, b""), (b"b", b"y" * 7000, b"h"), (b"a", b"z" * 3000, b"")])
    assert len(calls) == 2 and [k for k, _ in calls[1]] == [b"b", b"a"]
    assert store.get(b"a") == b"z" * 3000 and store.get(b"b") == b"y" * 7000
    live = store.live_bytes()
    assert store.delete(b"a") and store.delete(b"b")
    assert store.live_bytes() == 0 < live


def test_a_failed_index_write_leaves_the_old_value_and_no_pending_append(opened):
    store = opened(segment_bytes=64 << 10)
    store.put(b"a", b"old")

    def refuse(records):
        raise OSError("disk full")

    store.write_index = refuse
    with pytest.raises(OSError):
        store.put(b"a", b"n" * 30_000)
    store.write_index = None
    assert store.get(b"a") == b"old"
    assert not any(store._pending.values())
