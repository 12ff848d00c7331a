"""Tests for the SSD tier (kvstore/tiers/ssd.py) on a real RocksDB in tmp_path.

Fault tests start real Python processes: a writer killed with SIGKILL in the
middle of heavy writes, a second process holding the directory's lock, and
(where the kernel lets us make a private mount namespace) a read-only and a
full filesystem.
"""
from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from rocksdict import Options, Rdict, WriteOptions

from kvstore.tiers import CorruptValue, TierError, TierFull, ValueTooLarge
from kvstore.tiers.record import RecordHeader
from kvstore.tiers.segments import LOCATION, Location, segment_name
from kvstore.tiers.ssd import (META_CF, SEGMENTS_DIR, VALUE_CF, IndexRecord, SSDTier, _db_options, _meta_options,
                               _value_options)
from kvstore.tiers import ssd_worker
from kvstore.tiers.ssd_worker import SSDWorker
from proto import fastpath as fp

REPO = Path(__file__).resolve().parents[1]
GIB = 1 << 30


def value_for(index: int, size: int = 64 * 1024) -> bytes:
    """Deterministic, incompressible value number ``index``."""
    return np.random.default_rng(index).bytes(size)


def bf16_noise(n_values: int) -> bytes:
    floats = np.random.default_rng(7).standard_normal(n_values).astype(np.float32)
    return (floats.view(np.uint32) >> 16).astype(np.uint16).tobytes()


def has_record(tier: SSDTier, key: bytes) -> bool:
    """Whether the tier holds a record of ``key`` (its header, as a restart would find it)."""
    return any(record.key == key for record in tier.scan_index())


def run_python(code: str, *args: str, prefix: list[str] | None = None,
               timeout: float = 60) -> subprocess.CompletedProcess:
    command = (prefix or []) + [sys.executable, "-c", textwrap.dedent(code), *args]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def tier(tmp_path):
    opened = SSDTier.open(str(tmp_path / "ssd"), GIB)
    yield opened
    opened.close()


def test_put_get_round_trip_and_accounting(tier):
    value = value_for(1)
    stored = tier.put(b"k1", value, parent=b"k0")
    assert stored > len(value)                       # raw payload plus header
    assert tier.get(b"k1") == value
    assert has_record(tier, b"k1") and not has_record(tier, b"k2")
    assert tier.get(b"k2") is None
    assert (tier.count, tier.used_bytes) == (1, stored)

    buffer = bytearray(len(value) + 10)
    assert tier.get_into(b"k1", buffer) == len(value)
    assert buffer[:len(value)] == value
    assert tier.get_into(b"k2", buffer) is None

    assert tier.delete(b"k1") and not tier.delete(b"k1")
    assert (tier.count, tier.used_bytes) == (0, 0)
    assert tier.get(b"k1") is None


def test_overwrite_replaces_value_and_size(tier):
    tier.put(b"k", value_for(1, 1000))
    stored = tier.put(b"k", value_for(2, 3000))
    assert tier.get(b"k") == value_for(2, 3000)
    assert (tier.count, tier.used_bytes) == (1, stored)


def test_put_accepts_any_buffer(tier):
    source = bytearray(value_for(3, 5000))
    tier.put(b"mv", memoryview(source)[100:4100])
    tier.put(b"np", np.frombuffer(source, dtype=np.uint16))
    assert tier.get(b"mv") == bytes(source[100:4100])
    assert tier.get(b"np") == bytes(source)


def test_put_batch_stores_all_and_last_duplicate_wins(tier):
    headers = tier.put_batch([(b"a", b"1" * 100, None, None), (b"b", b"2" * 200, b"a", None), (b"a", b"3" * 300, None, None)])
    sizes = [header.disk_bytes for header in headers]
    assert len(sizes) == 3
    assert tier.get(b"a") == b"3" * 300 and tier.get(b"b") == b"2" * 200
    assert tier.count == 2
    assert tier.used_bytes == sizes[1] + sizes[2]


def test_bf16_values_are_shuffled_and_compressed(tmp_path):
    value = bf16_noise(1 << 19)
    with_shuffle = SSDTier.open(str(tmp_path / "a"), GIB)
    without = SSDTier.open(str(tmp_path / "b"), GIB, compression="off")
    try:
        assert with_shuffle.put(b"k", value) < 0.95 * len(value)
        assert without.put(b"k", value) > len(value)
        assert with_shuffle.put_batch([(b"k", value, None, None)])[0].index_tag == 0   # only the node decodes it
        assert without.put_batch([(b"k", value, None, None)])[0].index_tag == fp.ssd_tag(value)
        assert with_shuffle.compression_ratio > 1.05
        assert with_shuffle.get(b"k") == without.get(b"k") == value
    finally:
        with_shuffle.close()
        without.close()


def test_values_survive_a_clean_restart(tmp_path):
    path = str(tmp_path / "ssd")
    tier = SSDTier.open(path, GIB)
    stored = {i: tier.put(b"key%d" % i, value_for(i), parent=b"key%d" % (i - 1) if i else None)
              for i in range(50)}
    tier.delete(b"key7")
    used = tier.used_bytes
    tier.close()

    tier = SSDTier.open(path, GIB)
    try:
        records = {r.key: r for r in tier.scan_index()}
        assert tier.accounted.wait(30) and (tier.count, tier.used_bytes) == (49, used)
        assert b"key7" not in records and len(records) == 49
        tag = fp.ssd_tag(value_for(3))          # stored plain (incompressible): published under its tag
        assert records[b"key3"] == IndexRecord(b"key3", stored[3], 64 * 1024, b"key2", tag)
        assert records[b"key0"].parent is None
        assert all(tier.get(b"key%d" % i) == value_for(i) for i in range(50) if i != 7)
    finally:
        tier.close()


@pytest.mark.parametrize("options", [{"sync": True}, {"wal": False}, {"shuffle": False, "compression": "off"}])
def test_write_options_keep_values_across_a_clean_restart(tmp_path, options):
    path = str(tmp_path / "ssd")
    tier = SSDTier.open(path, GIB, **options)
    tier.put_batch([(b"a", value_for(1), None, None), (b"b", bf16_noise(10_000), b"a", None)])
    tier.close()
    tier = SSDTier.open(path, GIB, **options)
    try:
        assert tier.get(b"a") == value_for(1) and tier.get(b"b") == bf16_noise(10_000)
        assert [r.parent for r in tier.scan_index()] == [None, b"a"]
    finally:
        tier.close()


def flip_byte(path: str, family: str, key: bytes, position: int) -> None:
    """Damage one stored byte, as silent corruption would: of the payload (``VALUE_CF``), in
    its segment file, or of the header (``META_CF``), in its index record through RocksDB."""
    families = {META_CF: Options(raw_mode=True), VALUE_CF: Options(raw_mode=True)}
    db = Rdict(path, Options(raw_mode=True), column_families=families)
    column = db.get_column_family(META_CF)
    record = bytearray(column[key])
    if family == META_CF:
        record[LOCATION.size + position] ^= 0x40
        column[key] = bytes(record)
    else:
        loc = Location.unpack(record)
        with open(os.path.join(path, SEGMENTS_DIR, segment_name(loc.segment)), "r+b") as f:
            f.seek(loc.offset + position)
            byte = f.read(1)[0]
            f.seek(loc.offset + position)
            f.write(bytes([byte ^ 0x40]))
    column.close()
    del column
    db.close()


def test_corrupted_payload_is_reported_once_and_dropped(tmp_path):
    path = str(tmp_path / "ssd")
    tier = SSDTier.open(path, GIB)
    tier.put(b"good", value_for(1))
    tier.put(b"bad", value_for(2))
    tier.close()
    flip_byte(path, VALUE_CF, b"bad", 12345)

    tier = SSDTier.open(path, GIB)
    try:
        assert tier.accounted.wait(30) and tier.count == 2
        with pytest.raises(CorruptValue, match="bad"):
            tier.get(b"bad")
        assert tier.checksum_failures == 1
        assert not has_record(tier, b"bad")
        assert tier.get(b"bad") is None
        assert tier.count == 1 and [r.key for r in tier.scan_index()] == [b"good"]
        assert tier.get(b"good") == value_for(1)
    finally:
        tier.close()


def test_corrupted_compressed_payload_is_caught_by_get_into(tmp_path):
    path = str(tmp_path / "ssd")
    tier = SSDTier.open(path, GIB)
    tier.put(b"text", b"compressible text " * 10_000)
    tier.close()
    flip_byte(path, VALUE_CF, b"text", 100)

    tier = SSDTier.open(path, GIB)
    try:
        with pytest.raises(CorruptValue):
            tier.get_into(b"text", bytearray(200_000))
        assert list(tier.scan_index()) == []
        assert tier.accounted.wait(30) and tier.count == 0 and tier.used_bytes == 0
    finally:
        tier.close()


class CountingColumn:
    """A column family that records the keys of each ``get`` it is asked for."""

    def __init__(self, column):
        self.column, self.calls = column, []

    def get(self, keys, **options):
        self.calls.append(keys)
        return self.column.get(keys, **options)


def test_get_many_into_reads_the_headers_of_a_prefix_with_one_multi_get(tier):
    keys = [b"block-%d" % i for i in range(8)]
    tier.put_batch([(key, value_for(i), None, None) for i, key in enumerate(keys)])
    tier._meta = CountingColumn(tier._meta)
    wanted = keys[:3] + [b"absent"] + keys[3:]
    buffers = [bytearray(64 * 1024) for _ in wanted]

    results = tier.get_many_into(wanted, buffers)

    assert results == [64 * 1024] * 3 + [None] + [64 * 1024] * 5
    assert [bytes(b) for i, b in enumerate(buffers) if i != 3] == [value_for(i) for i in range(8)]
    assert tier._meta.calls == [wanted]


def test_get_many_into_drops_a_corrupt_value_and_serves_the_rest(tmp_path):
    path = str(tmp_path / "ssd")
    tier = SSDTier.open(path, GIB)
    tier.put_batch([(b"good", value_for(1), None, None), (b"bad", value_for(2), None, None)])
    tier.close()
    flip_byte(path, VALUE_CF, b"bad", 777)

    tier = SSDTier.open(path, GIB)
    try:
        buffers = [bytearray(64 * 1024), bytearray(64 * 1024), bytearray(10)]
        good, bad, small = tier.get_many_into([b"good", b"bad", b"good"], buffers)
        assert good == 64 * 1024 and bytes(buffers[0]) == value_for(1)
        assert isinstance(bad, CorruptValue) and tier.checksum_failures == 1
        assert isinstance(small, ValueError)
        assert tier.get(b"bad") is None and not has_record(tier, b"bad")
    finally:
        tier.close()


def test_corrupted_header_is_dropped_after_open(tmp_path):
    path = str(tmp_path / "ssd")
    tier = SSDTier.open(path, GIB)
    tier.put(b"a", b"x" * 100)
    tier.put(b"b", b"y" * 100)
    tier.close()
    flip_byte(path, META_CF, b"a", 0)   # the magic

    tier = SSDTier.open(path, GIB)
    try:
        assert [r.key for r in tier.scan_index()] == [b"b"]
        assert tier.accounted.wait(30) and tier.checksum_failures == 1
        assert tier.get(b"a") is None and tier.count == 1
    finally:
        tier.close()


def totals(tier: SSDTier) -> tuple[int, int, float]:
    return tier.count, tier.used_bytes, tier.compression_ratio


def test_changes_while_opening_totals_are_summed_are_counted_once(tmp_path):
    path = str(tmp_path / "ssd")
    tier = SSDTier.open(path, GIB)
    for i in range(2000):
        tier.put(b"k%04d" % i, value_for(i, 100 + i))
    tier.close()

    tier = SSDTier.open(path, GIB)
    try:
        tier.put(b"k0000", value_for(100, 5000))          # overwrite, likely before the sum is done
        tier.delete(b"k0001")
        tier.put(b"new", b"text " * 1000)
        assert tier.accounted.wait(30)
        tier.delete(b"k1999")                              # and after
        expected = (tier.count, tier.used_bytes, tier.compression_ratio)
        assert tier.count == 1999
    finally:
        tier.close()
    tier = SSDTier.open(path, GIB)
    try:
        assert tier.accounted.wait(30)
        assert (tier.count, tier.used_bytes, tier.compression_ratio) == expected
        assert sum(r.stored_size for r in tier.scan_index()) == tier.used_bytes
    finally:
        tier.close()


def test_close_while_totals_are_summed(tmp_path):
    path = str(tmp_path / "ssd")
    tier = SSDTier.open(path, GIB)
    tier.put_batch([(b"k%05d" % i, b"v", None, None) for i in range(20_000)])
    tier.close()
    SSDTier.open(path, GIB).close()                        # stops the summing thread first
    SSDTier.open(path, GIB).close()                        # and the directory is free again


WRITER = """
    import sys
    import numpy as np
    from kvstore.tiers.ssd import SSDTier
    tier = SSDTier.open(sys.argv[1], 1 << 34)
    with open(sys.argv[2], "w") as acks:
        i = 0
        while True:
            size = 16 * 1024 * (1 + i % 16)
            tier.put(b"key%d" % i, np.random.default_rng(i).bytes(size))
            acks.write("%d\\n" % i)
            acks.flush()
            i += 1
"""


def test_kill_9_during_heavy_writes_keeps_only_whole_values(tmp_path):
    path, acks = str(tmp_path / "ssd"), tmp_path / "acks"
    writer = subprocess.Popen([sys.executable, "-c", textwrap.dedent(WRITER), path, str(acks)], cwd=REPO)
    try:
        deadline = time.monotonic() + 30
        while (not acks.exists() or acks.stat().st_size < 2000) and time.monotonic() < deadline:
            assert writer.poll() is None, "writer died before it was killed"
            time.sleep(0.05)
        os.kill(writer.pid, signal.SIGKILL)
    finally:
        writer.kill()
        writer.wait()
    acknowledged = {int(line) for line in acks.read_text().split("\n")[:-1]}
    assert len(acknowledged) > 200

    tier = SSDTier.open(path, 1 << 34)
    try:
        records = list(tier.scan_index())
        found = {int(r.key[3:]) for r in records}
        assert acknowledged <= found                 # every acknowledged put survived
        for record in records:
            index = int(record.key[3:])
            expected = np.random.default_rng(index).bytes(16 * 1024 * (1 + index % 16))
            assert record.value_size == len(expected)
            assert tier.get(record.key) == expected  # whole and verified
        assert tier.accounted.wait(30)
        assert tier.checksum_failures == 0 and tier.count == len(records)
    finally:
        tier.close()


HOLDER = """
    import sys
    from kvstore.tiers.ssd import SSDTier
    tier = SSDTier.open(sys.argv[1], 1 << 30)
    print("ready", flush=True)
    sys.stdin.readline()
    tier.close()
"""


def test_directory_locked_by_another_process(tmp_path):
    path = str(tmp_path / "ssd")
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(HOLDER), path], cwd=REPO,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        with pytest.raises(TierError, match="locked by another process"):
            SSDTier.open(path, GIB)
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    SSDTier.open(path, GIB).close()       # free again once the holder is gone


def test_second_open_in_the_same_process_is_refused(tier):
    with pytest.raises(TierError, match="locked"):
        SSDTier.open(tier.path, GIB)


def test_path_that_cannot_be_a_directory(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(TierError, match="cannot be created"):
        SSDTier.open(str(blocker / "ssd"), GIB)


def private_mount_prefix(mount: str) -> list[str]:
    """`unshare` in a private mount namespace running ``mount`` first, or skip."""
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("unshare(1) is not installed")
    probe = subprocess.run([unshare, "-m", "sh", "-c", "mount -t tmpfs tmpfs /mnt"],
                           capture_output=True, text=True)
    if probe.returncode:
        pytest.skip(f"cannot make a private mount namespace here: {probe.stderr.strip()}")
    return [unshare, "-m", "sh", "-c", mount + ' && exec "$0" "$@"']


OPEN_AND_REPORT = """
    import sys
    from kvstore.tiers import TierError
    from kvstore.tiers.ssd import SSDTier
    try:
        SSDTier.open(sys.argv[1], 1 << 30).close()
        print("opened")
    except TierError as exc:
        print("TierError:", exc)
"""


def test_read_only_directory(tmp_path):
    readonly = tmp_path / "ro"
    SSDTier.open(str(readonly / "ssd"), GIB).close()     # an existing tier, then remounted read-only
    prefix = private_mount_prefix(f"mount --bind {readonly} {readonly} && "
                                  f"mount -o remount,ro,bind {readonly}")
    result = run_python(OPEN_AND_REPORT, str(readonly / "ssd"), prefix=prefix)
    assert "TierError:" in result.stdout, result.stderr
    assert "not writable" in result.stdout, result.stdout


FILL_DISK = """
    import sys
    import numpy as np
    from kvstore.tiers import TierError
    from kvstore.tiers.ssd import SSDTier
    tier = SSDTier.open(sys.argv[1], 1 << 30, compression="off")
    written = 0
    try:
        while True:
            tier.put(b"k%d" % written, np.random.default_rng(written).bytes(256 * 1024))
            written += 1
    except TierError as exc:
        print("TierError:", exc)
    used, count = tier.used_bytes, tier.count
    intact = all(tier.get(b"k%d" % i) == np.random.default_rng(i).bytes(256 * 1024) for i in range(written))
    print("written", written, "count", count, "accounted", used == sum(
        r.stored_size for r in tier.scan_index()), "intact", intact)
    try:
        tier.close()
    except TierError as exc:
        print("close:", exc)
"""


def fill_disk_prefix(tmp_path: Path) -> list[str]:
    """A 4 MiB tmpfs over the directory, or a 4 MiB file-size limit where mounts are refused."""
    mountpoint = tmp_path / "small"
    mountpoint.mkdir()
    try:
        return private_mount_prefix(f"mount -t tmpfs -o size=4m tmpfs {mountpoint}")
    except pytest.skip.Exception:
        limit = ("import resource, signal; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
                 "resource.setrlimit(resource.RLIMIT_FSIZE, (4 << 20, 4 << 20))")
        return [sys.executable, "-c", limit + "; import os, sys; os.execv(sys.argv[1], sys.argv[1:])"]


def test_full_disk_is_a_clear_error_and_earlier_values_stay_readable(tmp_path):
    prefix = fill_disk_prefix(tmp_path)
    result = run_python(FILL_DISK, str(tmp_path / "small" / "ssd"), prefix=prefix)
    assert "TierError:" in result.stdout, result.stderr
    assert "disk is full" in result.stdout or "file size limit" in result.stdout, result.stdout
    written = int(result.stdout.split("written ")[1].split()[0])
    assert written >= 1
    assert f"count {written} accounted True intact True" in result.stdout


def test_value_larger_than_the_tier_is_refused(tmp_path):
    tier = SSDTier.open(str(tmp_path / "ssd"), 1 << 20)
    try:
        with pytest.raises(ValueTooLarge, match="larger than the SSD tier's capacity"):
            tier.put(b"huge", value_for(1, 2 << 20))
        tier.put(b"a", value_for(2, 600_000))
        with pytest.raises(TierFull, match="free"):
            tier.put(b"b", value_for(3, 600_000))
        assert tier.count == 1 and not has_record(tier, b"b") and not has_record(tier, b"huge")
        tier.put(b"a", value_for(3, 900_000))        # overwriting frees the old size first
        assert tier.get(b"a") == value_for(3, 900_000)
    finally:
        tier.close()


def test_closed_tier_refuses_calls(tmp_path):
    tier = SSDTier.open(str(tmp_path / "ssd"), GIB)
    tier.close()
    tier.close()
    with pytest.raises(TierError, match="closed"):
        tier.get(b"k")


def test_bad_arguments_to_open(tmp_path):
    with pytest.raises(ValueError):
        SSDTier.open(str(tmp_path / "a"), GIB, compression="zstd")
    with pytest.raises(ValueError):
        SSDTier.open(str(tmp_path / "b"), 0)


def test_concurrent_overwrites_never_look_corrupt(tier):
    """Readers racing writers of the same keys see one whole value or the other."""
    versions = [value_for(v, 32 * 1024) for v in range(4)]
    errors: list[BaseException] = []
    stop = threading.Event()

    def write() -> None:
        for round_ in range(150):
            tier.put(b"k%d" % (round_ % 3), versions[round_ % 4])
        stop.set()

    def read() -> None:
        try:
            while not stop.is_set():
                for key in (b"k0", b"k1", b"k2"):
                    value = tier.get(key)
                    assert value is None or value in versions
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=write)] + [threading.Thread(target=read) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert tier.checksum_failures == 0 and tier.count == 3


def test_worker_batches_puts_and_reads_off_the_loop(tier):
    async def scenario() -> None:
        worker = SSDWorker(tier)
        try:
            headers = await asyncio.gather(*(worker.put(b"w%d" % i, value_for(i, 8192)) for i in range(64)))
            assert len(headers) == 64 and all(header.disk_bytes > 8192 for header in headers)
            values = await asyncio.gather(*(worker.submit(tier.get, b"w%d" % i) for i in range(64)))
            assert values == [value_for(i, 8192) for i in range(64)]
            assert await worker.submit(tier.delete, b"w0")
        finally:
            worker.close()

    asyncio.run(scenario())
    assert tier.count == 63


def test_worker_applies_deletes_in_queue_order(tier):
    async def scenario() -> list:
        worker = SSDWorker(tier)
        try:
            queued = [worker.put(b"k", b"first"), worker.delete(b"k"), worker.put(b"k", b"second"),
                      worker.put(b"gone", b"x"), worker.delete(b"gone"), worker.delete(b"never")]
            return await asyncio.gather(*queued)
        finally:
            worker.close()

    results = asyncio.run(scenario())
    assert results[1] is True and results[4] is True and results[5] is False
    assert tier.get(b"k") == b"second" and not has_record(tier, b"gone")
    assert tier.count == 1


def test_worker_gives_each_put_its_own_error(tmp_path):
    tier = SSDTier.open(str(tmp_path / "ssd"), 1 << 20)

    async def scenario() -> list:
        worker = SSDWorker(tier)
        try:
            puts = [worker.put(b"small%d" % i, b"s" * 1000) for i in range(5)]
            puts.insert(2, worker.put(b"huge", value_for(1, 2 << 20)))
            return await asyncio.gather(*puts, return_exceptions=True)
        finally:
            worker.close()

    try:
        results = asyncio.run(scenario())
        assert isinstance(results[2], ValueTooLarge)
        assert all(isinstance(r, RecordHeader) for i, r in enumerate(results) if i != 2)
        assert tier.count == 5
    finally:
        tier.close()


def test_worker_keeps_writing_after_a_caller_whose_loop_closed(tier):
    worker = SSDWorker(tier)
    gate = threading.Event()
    store = tier.put_batch
    tier.put_batch = lambda items: gate.wait(10) and store(items)

    async def queue_and_leave() -> None:
        worker.put(b"left", b"x")                   # its loop closes before the put is done

    async def put_again() -> int:
        return (await asyncio.wait_for(worker.put(b"after", b"y"), 5)).disk_bytes

    try:
        asyncio.run(queue_and_leave())
        gate.set()
        assert asyncio.run(put_again()) > 0
        assert tier.get(b"left") == b"x" and tier.get(b"after") == b"y"
    finally:
        worker.close()


class FailingDB:
    """A RocksDB handle whose first write fails with ``status``."""

    def __init__(self, db, status: str):
        self.db, self.status, self.failed = db, status, False

    def __getattr__(self, name: str):
        return getattr(self.db, name)

    def write(self, batch, options) -> None:
        if not self.failed:
            self.failed = True
            raise Exception(self.status)
        self.db.write(batch, options)


def test_writes_rocksdb_stalls_are_waited_out_and_land(tmp_path):
    """The tier asks RocksDB not to stall a write (rocksdict keeps the GIL through the call,
    so the node's event loop would stall with it) and writes again after a sleep, with a new
    batch (rocksdict consumes a batch even when RocksDB refuses it). Memtables of 64 KiB and
    a low level-0 limit make RocksDB stall often here (payloads are in segment files, so the
    index records are what fills them)."""
    path = str(tmp_path / "ssd")
    meta = _meta_options()
    meta.set_write_buffer_size(64 << 10)
    meta.set_max_write_buffer_number(2)
    meta.set_level_zero_slowdown_writes_trigger(2)
    meta.set_level_zero_stop_writes_trigger(4)
    db = Rdict(path, _db_options(), column_families={META_CF: meta, VALUE_CF: _value_options()})
    options = WriteOptions()
    options.no_slowdown = True
    tier = SSDTier(db, path, GIB, compress=False, shuffle=False, write_options=options)
    try:
        for i in range(1500):
            tier.put(b"k%d" % i + b"-" * 2000, value_for(i, 1024))
        tier.delete(b"k0" + b"-" * 2000)
        assert tier.write_stalls > 0
        assert tier.get(b"k0" + b"-" * 2000) is None
        assert all(tier.get(b"k%d" % i + b"-" * 2000) == value_for(i, 1024) for i in range(1, 1500))
    finally:
        tier.close()
    opened = SSDTier.open(str(tmp_path / "other"), GIB)
    try:
        assert opened._write_options.no_slowdown
    finally:
        opened.close()


def test_a_write_that_fails_otherwise_is_not_retried(tier):
    tier._db = FailingDB(tier._db, "IO error: No space left on device")
    with pytest.raises(TierError, match="No space left"):
        tier.put(b"k", value_for(1))
    assert tier.write_stalls == 0 and tier.get(b"k") is None


def test_overwrites_leave_segments_that_reclaim_rewrites(tmp_path):
    path = str(tmp_path / "ssd")
    tier = SSDTier.open(path, GIB, compression="off")
    tier._store.segment_bytes = 1 << 20
    try:
        for round_ in range(4):
            for i in range(12):
                if round_ == 0 or i % 3:
                    tier.put(b"k%d" % i, value_for(100 * round_ + i, 128 * 1024))
        before = tier.segment_disk_bytes
        copied = 0
        while (step := tier.reclaim(1)) or tier._store.victims():
            copied += step
        assert copied > 0 and tier.segment_disk_bytes < before
        expected = {i: value_for(100 * (3 if i % 3 else 0) + i, 128 * 1024) for i in range(12)}
        assert all(tier.get(b"k%d" % i) == v for i, v in expected.items())
        buf = bytearray(128 * 1024)
        assert tier.get_into(b"k0", buf) == 128 * 1024 and bytes(buf) == expected[0]
    finally:
        tier.close()
    tier = SSDTier.open(path, GIB)
    try:
        assert all(tier.get(b"k%d" % i) == v for i, v in expected.items())
        assert tier.accounted.wait(30) and tier.count == 12 and tier.checksum_failures == 0
    finally:
        tier.close()


def test_the_idle_writer_reclaims(tmp_path, monkeypatch):
    monkeypatch.setattr(ssd_worker, "RECLAIM_IDLE_S", 0.05)
    tier = SSDTier.open(str(tmp_path / "ssd"), GIB, compression="off")
    tier._store.segment_bytes = 1 << 20
    for i in range(16):
        tier.put(b"k%d" % (i % 2), value_for(i, 128 * 1024))
    assert tier._store.victims()
    worker = SSDWorker(tier)
    try:
        deadline = time.monotonic() + 30
        while tier._store.victims() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not tier._store.victims()
        assert tier.get(b"k0") == value_for(14, 128 * 1024) and tier.get(b"k1") == value_for(15, 128 * 1024)
    finally:
        worker.close()
        tier.close()


# ----------------------------------------------------------------- reads on the loop (read_cached)


def segment_files(tier: SSDTier) -> list[str]:
    directory = os.path.join(tier.path, SEGMENTS_DIR)
    return [os.path.join(directory, name) for name in os.listdir(directory)]


def drop_from_page_cache(tier: SSDTier) -> None:
    for name in segment_files(tier):
        fd = os.open(name, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def test_read_cached_serves_remembered_values_from_the_page_cache_and_follows_overwrites(tier):
    tier.put(b"k", value_for(1))
    assert tier.read_cached(b"k") == value_for(1)            # remembered when written
    tier.put(b"k", value_for(2))
    assert tier.read_cached(b"k") == value_for(2)            # the new record, never the old
    tier.delete(b"k")
    assert tier.read_cached(b"k") is None
    assert tier.read_cached(b"never") is None


def test_read_cached_never_waits_for_the_disk(tier):
    tier.put(b"k", value_for(1))
    drop_from_page_cache(tier)
    assert tier.read_cached(b"k") is None                     # not cached: a reader thread's job
    assert tier.get_many([b"k"]) == [value_for(1)]            # which brings it back in
    assert tier.read_cached(b"k") == value_for(1)


def test_read_cached_after_a_restart_serves_the_records_the_opening_scan_remembered(tmp_path):
    path = str(tmp_path / "ssd")
    tier = SSDTier.open(path, GIB)
    tier.put(b"k", value_for(1))
    tier.close()
    tier = SSDTier.open(path, GIB)
    try:
        assert tier.accounted.wait(30)
        assert tier.read_cached(b"k") == value_for(1)
        tier._recent.clear()                                  # as past RECENT_RECORDS at open
        assert tier.read_cached(b"k") is None
        assert tier.get_many([b"k"]) == [value_for(1)]        # a reader thread's read remembers it
        assert tier.read_cached(b"k") == value_for(1)
    finally:
        tier.close()


def test_the_opening_scan_never_keeps_a_record_written_over_since_open(tier):
    """The scan walks a view from open; a put since then must win, whatever the order."""
    tier.accounted.wait(30)
    tier.put(b"k", value_for(1))
    in_view = tier._meta.get(b"k")                            # what a view from before the put holds
    tier._written = set()                                     # as while the scan runs
    tier.put(b"k", value_for(2))
    tier._account_opening_headers([(b"k", in_view)])          # the scan reaches k only now
    assert b"k" not in tier._recent and tier.read_cached(b"k") is None
    assert tier.get_many([b"k"]) == [value_for(2)] and tier.read_cached(b"k") == value_for(2)


def test_read_cached_of_a_corrupted_payload_is_a_miss_never_wrong_bytes(tier):
    tier.put(b"bad", value_for(2))
    loc = Location.unpack(tier._recent[b"bad"])
    name = os.path.join(tier.path, SEGMENTS_DIR, segment_name(loc.segment))
    with open(name, "r+b") as f:                              # damage one byte while it is remembered
        f.seek(loc.offset + 777)
        byte = f.read(1)[0]
        f.seek(loc.offset + 777)
        f.write(bytes([byte ^ 0x40]))
    assert tier.read_cached(b"bad") is None
    with pytest.raises(CorruptValue):                         # the reader thread's read drops it
        tier.get(b"bad")
    assert tier.read_cached(b"bad") is None and tier.checksum_failures == 1
