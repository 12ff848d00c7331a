"""Faults of the tiers, through real `python -m kvstore serve` processes.

Each fault must leave a clear log line or error reply, and the node must keep
serving from its other tiers: an unwritable or unusable `--ssd-dir`, a
RocksDB directory locked by another kvstore, a payload corrupted on disk, a
value larger than a whole tier, a full disk (a small tmpfs mounted in a
private mount namespace), `kill -9` in the middle of heavy writes, and
`--gpu-size` on a machine without a GPU. Restarts report in the log how many
values they recovered and how long it took.
"""
from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading

import pytest
import redis

from conftest import free_port, wait_until
from kvstore.tiers.gpu import gpu_available
from kvstore.tiers.ssd import VALUE_CF
from test_tier_ssd import flip_byte, private_mount_prefix
from test_tiering import KIB, MIB, client, digest, key_of, restart, value_of, write_values
from test_tiering import tiered  # noqa: F401  (fixture)

RECOVERED = re.compile(r"Recovered (\d+) values from the SSD tier in ([\d.]+) s \(([\d.]+) values/s\)")


def serves_from_dram(r: redis.Redis) -> None:
    """The node still stores and returns values."""
    assert r.set(b"still-serving", value_of(7, 300 * KIB))
    assert digest(r.get(b"still-serving")) == digest(value_of(7, 300 * KIB))


# ------------------------------------------------------------------ unusable directories


def test_unwritable_ssd_dir_is_logged_and_the_node_serves_from_dram(tmp_path, kvstore_factory):
    readonly = tmp_path / "ro"
    readonly.mkdir()
    prefix = private_mount_prefix(f"mount --bind {readonly} {readonly} && mount -o remount,ro,bind {readonly}")
    daemon = kvstore_factory("--dram-size", "8mb", "--ssd-dir", str(readonly / "ssd"),
                           prefix=prefix)
    assert "SSD tier disabled" in daemon.log()
    assert "cannot be created" in daemon.log() or "not writable" in daemon.log(), daemon.log()
    r = client(daemon)
    assert r.info("ssd") == {"ssd_enabled": 0}
    serves_from_dram(r)


def test_ssd_dir_that_cannot_be_a_directory(tmp_path, kvstore_factory):
    (tmp_path / "file").write_text("not a directory")
    daemon = kvstore_factory("--dram-size", "8mb", "--ssd-dir", str(tmp_path / "file" / "ssd"))
    assert "SSD tier disabled" in daemon.log() and "cannot be created" in daemon.log(), daemon.log()
    serves_from_dram(client(daemon))


def test_ssd_dir_locked_by_another_kvstore(tmp_path, tiered, kvstore_factory):
    first = tiered()
    second = kvstore_factory("--dram-size", "8mb", "--ssd-dir", str(tmp_path / "ssd"))
    assert "locked by another process" in second.log(), second.log()
    assert client(second).info("ssd") == {"ssd_enabled": 0}
    serves_from_dram(client(second))
    r = client(first)
    written = write_values(r, range(48))
    wait_until(lambda: r.info("ssd")["ssd_records"] > 0, what="the first node still writing to SSD")
    for key, got in zip(written, r.mget(list(written))):
        assert got is None or digest(got) == written[key], key


# ------------------------------------------------------------------ damaged or oversized values


def test_corrupted_value_on_disk_is_dropped_counted_and_logged(tmp_path, tiered, kvstore_factory):
    daemon = tiered("--ssd-write-policy", "write-through", dram="64mb")
    r = client(daemon)
    written = write_values(r, range(5))
    wait_until(lambda: r.info("ssd")["ssd_records"] == 5, what="5 records on SSD")
    daemon.stop()
    flip_byte(str(tmp_path / "ssd"), VALUE_CF, key_of(2), 1000)
    daemon = restart(kvstore_factory, daemon, signal.SIGTERM)
    r = client(daemon)
    assert r.get(key_of(2)) is None                  # never the damaged bytes
    assert r.info("ssd")["ssd_checksum_failures"] == 1
    assert "dropped" in daemon.log() and "failed verification" in daemon.log(), daemon.log()
    assert r.get(key_of(2)) is None and r.dbsize() == 4
    assert {k: digest(r.get(k)) for k in written if k != key_of(2)} == \
        {k: v for k, v in written.items() if k != key_of(2)}


def test_value_larger_than_the_ssd_tier_stays_in_dram(tiered):
    daemon = tiered("--ssd-write-policy", "write-through", dram="64mb", ssd_size="1mb")
    r = client(daemon)
    r.set(b"huge", value_of(1, 2 * MIB))
    r.set(b"small", value_of(2, 64 * KIB))
    wait_until(lambda: "larger than the SSD tier" in daemon.log(), what="the log line")
    wait_until(lambda: r.info("ssd")["ssd_records"] == 1, what="the small value on SSD")
    assert digest(r.get(b"huge")) == digest(value_of(1, 2 * MIB))
    assert r.execute_command("KV.LOCATE", b"huge")[0][0] == b"dram"


def test_value_larger_than_dram_is_refused_with_oom(tiered):
    daemon = tiered()
    r = client(daemon)
    with pytest.raises(redis.exceptions.OutOfMemoryError):
        r.set(b"huge", value_of(1, 12 * MIB))
    assert r.get(b"huge") is None
    serves_from_dram(r)


def test_full_disk_is_logged_and_values_stay_readable(tmp_path, kvstore_factory):
    small = tmp_path / "small"
    small.mkdir()
    prefix = private_mount_prefix(f"mount -t tmpfs -o size=6m tmpfs {small}")
    daemon = kvstore_factory("--dram-size", "64mb", "--ssd-dir", str(small / "ssd"),
                           "--ssd-size", "1gb", "--ssd-write-policy", "write-through",
                           prefix=prefix)
    r = client(daemon)
    written = write_values(r, range(40))             # 10 MiB onto a 6 MiB disk
    wait_until(lambda: "SSD tier write failed" in daemon.log(), what="the full-disk log line")
    assert "disk is full" in daemon.log(), daemon.log()
    assert {k: digest(r.get(k)) for k in written} == written
    assert r.info("ssd")["ssd_errors"] >= 1
    serves_from_dram(r)


# ------------------------------------------------------------------ crashes and restarts


def test_kill_9_during_heavy_writes_restarts_with_only_whole_values(tiered, kvstore_factory):
    daemon = tiered("--ssd-write-policy", "write-through", dram="16mb")
    size, stop, acknowledged = 64 * KIB, threading.Event(), []

    def writer() -> None:
        r = client(daemon)
        n = 0
        while not stop.is_set():
            try:
                r.set(key_of(n), value_of(n, size))
            except redis.ConnectionError:
                return
            acknowledged.append(n)
            n += 1

    thread = threading.Thread(target=writer)
    try:
        thread.start()
        wait_until(lambda: len(acknowledged) > 150, what="writes in flight")
        daemon.stop(signal.SIGKILL)
        stop.set()
        thread.join(10)
        daemon = restart(kvstore_factory, daemon, signal.SIGKILL)
        r = client(daemon)
        keys = [key_of(n) for n in range(len(acknowledged) + 1)]
        found = 0
        for n, got in enumerate(r.mget(keys)):
            assert got is None or digest(got) == digest(value_of(n, size)), n
            found += got is not None
        recovered = int(RECOVERED.search(daemon.log()).group(1))
        assert found == recovered == r.dbsize() > 0
    finally:
        stop.set()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["clean-stop", "kill-9"])
def test_warm_restart_logs_how_many_values_and_how_long(sig, tiered, kvstore_factory):
    daemon = tiered("--ssd-write-policy", "write-through", dram="64mb")
    r = client(daemon)
    written = write_values(r, range(30), 32 * KIB)
    wait_until(lambda: r.info("ssd")["ssd_records"] == 30, what="30 records on SSD")
    daemon = restart(kvstore_factory, daemon, sig)
    match = RECOVERED.search(daemon.log())
    assert match, daemon.log()
    assert int(match.group(1)) == 30 and float(match.group(2)) >= 0
    r = client(daemon)
    assert r.info("ssd")["ssd_recovered"] == 30
    assert {k: digest(r.get(k)) for k in written} == written


def test_gpu_size_without_a_gpu_exits_with_a_clear_error():
    usable, reason = gpu_available()
    if usable:
        pytest.skip("this machine has a GPU")
    result = subprocess.run([sys.executable, "-m", "kvstore", "serve", "--port", str(free_port()),
                             "--dram-size", "8mb", "--gpu-size", "64mb"],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "GPU" in output and reason.split(" (")[0] in output, output
    assert "Traceback" not in output, output
