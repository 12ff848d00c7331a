"""Daemon-level tests of the tiers (kvstore/tiers/manager.py through the wire).

Each test starts real `python -m kvstore serve` processes with a small DRAM
arena (`--dram-size 8mb`) and an SSD tier in tmp_path, so values spill to
RocksDB after a few MiB. Values are deterministic functions of their number,
so every read is checked byte for byte against what was written. Restarts
reuse the same flags and `--ssd-dir`, as an operator would.
"""
from __future__ import annotations

import functools
import hashlib
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import numpy as np
import pytest
import redis

from conftest import Daemon, free_port, wait_ready, wait_until
from kvstore.net.connection import COPIED_REPLIES
from kvstore.tiers.ssd import SSDTier
from proto import wire

KIB, MIB = 1 << 10, 1 << 20
RECOVERED_LINE = "Recovered "


# ------------------------------------------------------------------ helpers


def value_of(number: int, size: int = 256 * KIB) -> bytes:
    """Incompressible bytes that only value ``number`` has."""
    return np.random.default_rng(number).bytes(size)


def digest(data: bytes | None) -> str | None:
    return None if data is None else hashlib.blake2b(data, digest_size=16).hexdigest()


def key_of(number: int) -> bytes:
    return b"v%05d" % number


def start_tiered(kvstore_factory, *flags: str, dram: str = "8mb", ssd_size: str = "1gb") -> Daemon:
    """A node with an SSD tier in the factory's folder (``ssd``) and a small DRAM arena."""
    return kvstore_factory("--dram-size", dram, "--ssd-dir", str(kvstore_factory.tmp_path / "ssd"),
                           "--ssd-size", ssd_size, *flags)


@pytest.fixture
def tiered(kvstore_factory):
    """`start_tiered` in the test's folder; the node is stopped at teardown."""
    return functools.partial(start_tiered, kvstore_factory)


def restart(kvstore_factory, daemon: Daemon, sig: int = signal.SIGTERM) -> Daemon:
    """Stop ``daemon`` with ``sig``, start the same command line again (a new log file) and
    wait until it has logged its recovery of the SSD tier."""
    again = kvstore_factory.restart(daemon, sig)
    wait_until(lambda: RECOVERED_LINE in again.log(), what="the recovery log line")
    return again


def client(daemon: Daemon, **kwargs) -> redis.Redis:
    return redis.Redis(daemon.host, daemon.port, socket_timeout=10, **kwargs)


def tiers(r: redis.Redis, keys: list[bytes]) -> list[str | None]:
    """The tier KV.LOCATE reports for each key (None: absent)."""
    return [None if item is None else item[0].decode() for item in r.execute_command(wire.KV_LOCATE, *keys)]


def write_values(r: redis.Redis, numbers, size: int = 256 * KIB) -> dict[bytes, str]:
    """SET value_of(n) under key_of(n) for each n; key -> digest."""
    written = {}
    for n in numbers:
        r.set(key_of(n), value_of(n, size))
        written[key_of(n)] = digest(value_of(n, size))
    return written


def spill(r: redis.Redis, count: int = 48, size: int = 256 * KIB) -> dict[bytes, str]:
    """Write ``count`` values (48 x 256 KiB = 12 MiB over an 8 MiB arena) and wait for demotions."""
    written = write_values(r, range(count), size)
    wait_until(lambda: "ssd" in tiers(r, list(written)), what="a value on SSD")
    return written


def on_ssd(r: redis.Redis, keys: list[bytes]) -> list[bytes]:
    return [k for k, tier in zip(keys, tiers(r, keys)) if tier == "ssd"]


# ------------------------------------------------------------------ spilling and reading back


def test_values_spill_to_ssd_and_read_back_byte_identical(tiered):
    daemon = tiered()
    r = client(daemon)
    written = spill(r, 48)
    located = tiers(r, list(written))
    assert set(located) == {"dram", "ssd"}, located
    sizes = [item[1] for item in r.execute_command(wire.KV_LOCATE, *written)]
    assert sizes == [256 * KIB] * 48
    assert located.count("ssd") * 256 * KIB >= 12 * MIB - 8 * MIB
    for key, expected in written.items():
        assert digest(r.get(key)) == expected, key
    assert r.dbsize() == 48
    assert r.info("ssd")["ssd_hits"] >= located.count("ssd")


def test_puts_faster_than_demotion_lose_no_values(tiered):
    daemon = tiered()
    r = client(daemon)
    pipe = r.pipeline(transaction=False)
    for n in range(48):                      # 48 MiB through an 8 MiB arena, back to back
        pipe.set(key_of(n), value_of(n, MIB))
    assert all(pipe.execute())
    assert r.dbsize() == 48
    assert r.info("dram")["dram_evictions"] == 0


def test_mget_across_tiers_returns_every_value_and_loses_none(tiered):
    daemon = tiered()
    r = client(daemon)
    written = spill(r, 40)
    keys = list(written)
    assert {"dram", "ssd"} <= set(tiers(r, keys))
    assert [digest(v) for v in r.mget(keys + [b"absent"])] == list(written.values()) + [None]
    assert r.dbsize() == 40


def test_chains_spill_tail_first_and_read_back(tiered):
    """8 chains of 8 blocks (16 MiB, KV.PUT ... PARENT): SSD takes their tails, DRAM keeps prefixes."""
    daemon = tiered()
    r = client(daemon)
    chains = [[b"c%d-b%d" % (c, b) for b in range(8)] for c in range(8)]
    for c, chain in enumerate(chains):
        for b, key in enumerate(chain):
            parent = ["PARENT", chain[b - 1]] if b else []
            assert r.execute_command(wire.KV_PUT, key, value_of(100 * c + b), *parent) == 1
    wait_until(lambda: "ssd" in tiers(r, chains[0]), what="demotions")
    for chain in chains:
        located = tiers(r, chain)
        assert located == sorted(located), located      # dram... then ssd...: no hole in a prefix
    assert r.execute_command(wire.KV_MATCH, *chains[-1]) == 8
    for c, chain in enumerate(chains):
        for b, got in enumerate(r.mget(chain)):
            assert digest(got) == digest(value_of(100 * c + b)), (c, b)


def test_promotion_after_promote_hits_within_the_window(tiered):
    # A minute's window holds the first three hits however slowly they come.
    daemon = tiered("--promote-hits", "3", "--promote-window-ms", "60000")
    r = client(daemon)
    written = spill(r, 48)
    cold, slow = on_ssd(r, list(written))[:2]
    before = r.info("ssd")["ssd_promotions"]
    for expected_tier in ("ssd", "ssd", "dram"):
        assert digest(r.get(cold)) == written[cold]
        assert tiers(r, [cold]) == [expected_tier]
    assert r.info("ssd")["ssd_promotions"] == before + 1
    # Hits further apart than the window never add up to a promotion.
    assert r.config_set("promote-window-ms", 500)
    for _ in range(3):
        assert digest(r.get(slow)) == written[slow]
        assert tiers(r, [slow]) == ["ssd"]
        time.sleep(0.6)


def test_write_through_puts_land_on_ssd_and_survive_kill_9(tiered, kvstore_factory):
    daemon = tiered("--ssd-write-policy", "write-through", dram="64mb")
    r = client(daemon)
    written = write_values(r, range(10))
    wait_until(lambda: r.info("ssd")["ssd_records"] == 10, what="10 records on SSD")
    assert tiers(r, list(written)) == ["dram"] * 10       # the DRAM copy stays: a clean backup below it
    daemon = restart(kvstore_factory, daemon, signal.SIGKILL)
    r = client(daemon)
    assert tiers(r, list(written)) == ["ssd"] * 10
    assert {k: digest(r.get(k)) for k in written} == written


def test_write_back_puts_stay_in_dram_until_demoted(tiered):
    daemon = tiered(dram="64mb")
    r = client(daemon)
    written = write_values(r, range(10))
    time.sleep(0.3)                     # several cron passes
    assert r.info("ssd")["ssd_records"] == 0
    assert tiers(r, list(written)) == ["dram"] * 10


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["clean-stop", "kill-9"])
def test_delete_and_overwrite_of_ssd_values_never_resurrect(sig, tiered, kvstore_factory):
    daemon = tiered()
    r = client(daemon)
    written = spill(r, 48)
    deleted, overwritten, renewed = on_ssd(r, list(written))[:3]
    assert r.delete(deleted) == 1          # acknowledged once the SSD delete has landed
    assert r.set(overwritten, b"small new value")
    # A new value of the same key that itself reaches SSD later replaces the old record.
    r.execute_command(wire.KV_PUT, renewed, value_of(10_000))
    write_values(r, range(100, 180))      # enough that approximate LRU surely demotes it
    wait_until(lambda: tiers(r, [renewed]) == ["ssd"], what="the renewed value on SSD")
    daemon = restart(kvstore_factory, daemon, sig)
    r = client(daemon)
    assert r.get(deleted) is None
    assert r.get(overwritten) in (None, b"small new value")     # never the old value
    assert digest(r.get(renewed)) == digest(value_of(10_000))
    survivors = [k for k in written if k not in (deleted, overwritten, renewed)]
    for key, got in zip(survivors, r.mget(survivors)):
        assert got is None or digest(got) == written[key], key


def test_get_during_demotion_returns_the_whole_value(tiered):
    """Readers hammer keys while a writer keeps pushing older values down to SSD."""
    daemon = tiered("--promote-hits", "1")
    size, stop, wrong, seen = 128 * KIB, threading.Event(), [], {"value": 0, "none": 0}
    expected = {n: digest(value_of(n, size)) for n in range(400)}
    written = [0]

    def writer() -> None:
        r = client(daemon)
        for n in range(400):
            if stop.is_set():
                return
            r.set(key_of(n), value_of(n, size))
            written[0] = n + 1

    def reader(seed: int) -> None:
        r, rng = client(daemon), np.random.default_rng(seed)
        while not stop.is_set():
            n = int(rng.integers(0, max(written[0], 1)))
            got = r.get(key_of(n))
            if got is None:
                seen["none"] += 1
            elif digest(got) != expected[n]:
                wrong.append((n, len(got)))
            else:
                seen["value"] += 1

    threads = [threading.Thread(target=writer)] + [threading.Thread(target=reader, args=(s,)) for s in (1, 2)]
    try:
        for t in threads:
            t.start()
        threads[0].join(30)
        stop.set()
        for t in threads[1:]:
            t.join(10)
        assert not wrong, wrong[:5]
        assert seen["value"] > 50, seen
        info = client(daemon).info("dram")
        assert info["dram_demotions"] > 0, info
    finally:
        stop.set()


def test_sdk_reads_of_ssd_values_are_leased_from_the_arena_and_redis_reads_are_sent_from_rocksdb_bytes(
        tiered, kvstore_factory):
    """A lease command's values are read into arena extents (the SDK copies them out of
    shared memory, no wire fallback); a GET's are RocksDB's own bytes, taking no extent."""
    from client import KVClient
    daemon = tiered("--ssd-write-policy", "write-through", "--promote-hits", "1000000",
                          dram="64mb")
    r = client(daemon)
    written = write_values(r, range(6))
    wait_until(lambda: r.info("ssd")["ssd_records"] == 6, what="6 records on SSD")
    daemon = restart(kvstore_factory, daemon)   # every value on SSD only
    r = client(daemon)
    keys = list(written)
    assert set(tiers(r, keys)) == {"ssd"}
    kv = KVClient(unix_socket=daemon.unix_socket, fast_path="required")
    buffers = [bytearray(256 * KIB) for _ in range(3)]
    assert kv.batch_get_into(keys[:3], buffers) == [256 * KIB] * 3
    assert [digest(bytes(b)) for b in buffers] == [written[k] for k in keys[:3]]
    assert kv.fast_path.stats.wire_calls == 0
    kv.close()
    used = r.info("dram")["dram_used"]
    assert [digest(r.get(k)) for k in keys[3:]] == [written[k] for k in keys[3:]]
    assert r.info("dram")["dram_used"] == used
    assert set(tiers(r, keys)) == {"ssd"}


# ------------------------------------------------------------------ soft pins and holds


def test_pinned_values_are_evicted_last_and_pins_expire(tiered):
    daemon = tiered()
    r = client(daemon)
    assert r.execute_command(wire.KV_PUT, b"pinned-at-put", value_of(1), "PIN") == 1
    r.set(b"pinned-later", value_of(2))
    r.set(b"short-pin", value_of(3))
    assert r.execute_command(wire.KV_PIN, b"pinned-later") == 1
    assert r.execute_command(wire.KV_PIN, b"short-pin", 200) == 1
    assert r.execute_command(wire.KV_PIN, b"absent") == 0
    time.sleep(0.4)                                   # the short pin has expired
    written = write_values(r, range(10, 70))          # 15 MiB through an 8 MiB arena
    wait_until(lambda: "ssd" in tiers(r, list(written)), what="demotions")
    assert tiers(r, [b"pinned-at-put", b"pinned-later", b"short-pin"]) == ["dram", "dram", "ssd"]
    assert r.execute_command(wire.KV_UNPIN, b"pinned-at-put") == 1
    assert r.execute_command(wire.KV_UNPIN, b"pinned-at-put") == 0
    write_values(r, range(100, 160))
    wait_until(lambda: tiers(r, [b"pinned-at-put"]) == ["ssd"], what="the unpinned value demoted")
    assert tiers(r, [b"pinned-later"]) == ["dram"]
    assert digest(r.get(b"pinned-at-put")) == digest(value_of(1))
    assert digest(r.get(b"short-pin")) == digest(value_of(3))


HELD_GETS = COPIED_REPLIES // MIB + 1      # GETs of a 1 MiB value that one client leaves unread


def hold_by_reading(daemon: Daemon, key: bytes) -> socket.socket:
    """A Unix-socket client that asks for a 1 MiB value HELD_GETS times and never reads the replies.

    The first replies are copied into the reply buffer (while up to COPIED_REPLIES
    are queued), the last one is sent from the arena under a hold; the socket
    buffer takes only part of the replies, so the hold lasts as long as this client does.
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(daemon.unix_socket)
    sock.sendall(b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(key), key) * HELD_GETS)
    return sock


@pytest.mark.parametrize("ssd", [False, True], ids=["dram-only", "with-ssd"])
def test_store_full_of_held_values_answers_oom_instead_of_stalling(tmp_path, ssd, kvstore_factory):
    flags = ("--dram-size", "8mb", "--ssd-dir", str(tmp_path / "ssd")) if ssd else ("--dram-size", "8mb")
    daemon = kvstore_factory(*flags)
    holders = []
    try:
        r = client(daemon)
        keys = list(write_values(r, range(8), MIB))
        if not ssd:
            assert r.info("memory")["used_memory"] == 8 * MIB
        hits = r.info("stats")["keyspace_hits"]
        holders = [hold_by_reading(daemon, key) for key in keys]
        wait_until(lambda: r.info("stats")["keyspace_hits"] == hits + len(keys) * HELD_GETS,
                   what="every GET to run, its reply stuck")
        if ssd:
            # Values that were demoted come back staged under the readers' holds: the
            # newcomer finds room (in DRAM or by demotion) or gets -OOM, but never waits.
            try:
                r.set(b"newcomer", value_of(99, MIB))
            except redis.exceptions.OutOfMemoryError:
                pass
        else:
            with pytest.raises(redis.exceptions.OutOfMemoryError):
                r.set(b"newcomer", value_of(99, MIB))
            assert r.get(b"newcomer") is None
        assert r.ping()
        for sock in holders:
            sock.close()
        wait_until(lambda: _set_ok(r, b"newcomer", value_of(99, MIB)), what="room once the holds end")
        assert digest(r.get(b"newcomer")) == digest(value_of(99, MIB))
    finally:
        for sock in holders:
            sock.close()


def _set_ok(r: redis.Redis, key: bytes, value: bytes) -> bool:
    try:
        return bool(r.set(key, value))
    except redis.ResponseError:
        return False


# ------------------------------------------------------------------ visibility


def info_text(daemon: Daemon) -> str:
    """INFO as the server sends it (redis-py parses away the section titles)."""
    with socket.create_connection((daemon.host, daemon.port), timeout=10) as sock:
        sock.sendall(b"*2\r\n$4\r\nINFO\r\n$10\r\neverything\r\n")
        reply = b""
        while b"\r\n" not in reply or len(reply) < reply.index(b"\r\n") + 2 + int(reply[1:reply.index(b"\r\n")]):
            reply += sock.recv(65536)
    return reply.split(b"\r\n", 1)[1].decode()


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def settled_info_and_metrics(r: redis.Redis, metrics_port: int) -> tuple[dict, dict[str, float]]:
    """INFO's SSD and DRAM sections (one call) and a metrics scrape taken while no value moved.

    The cron demotes promoted copies at its own pace, so a scrape is compared
    only with an INFO that reads the same before and after it.
    """
    deadline = time.monotonic() + 20
    while True:
        before = r.info("ssd", "dram")
        metrics = scrape(metrics_port)
        if r.info("ssd", "dram") == before or time.monotonic() > deadline:
            return before, metrics
        time.sleep(0.2)


def test_info_tier_sections_and_metrics_endpoint_agree(tiered):
    metrics_port = free_port()
    daemon = tiered("--metrics-port", str(metrics_port), "--promote-hits", "1")
    r = client(daemon)
    written = spill(r, 48)
    cold = on_ssd(r, list(written))
    for key in cold[:5]:
        r.get(key)
    text = info_text(daemon)
    for title in ("# DRAM", "# SSD", "# GPU"):
        assert title in text
    ssd, metrics = settled_info_and_metrics(r, metrics_port)
    dram = ssd              # one INFO call: values the cron moves between two calls are counted once
    for field in ("capacity", "used", "values", "hits", "misses", "promotions", "demotions",
                  "evictions", "checksum_failures", "compression_ratio"):
        assert f"ssd_{field}" in ssd, field
    assert ssd["ssd_capacity"] == 1 << 30 and ssd["ssd_enabled"] == 1
    assert ssd["ssd_hits"] >= 5 and ssd["ssd_promotions"] >= 5
    assert dram["dram_capacity"] == 8 * MIB and dram["dram_demotions"] >= len(cold)
    assert ssd["ssd_values"] + dram["dram_values"] == 48
    assert r.info("gpu") == {"gpu_enabled": 0}
    for field, metric in [("ssd_hits", "ssd_hits_total"), ("ssd_promotions", "ssd_promotions_total"),
                          ("ssd_values", "ssd_values"), ("ssd_used", "ssd_used"),
                          ("dram_demotions", "dram_demotions_total"), ("dram_capacity", "dram_capacity"),
                          ("ssd_checksum_failures", "ssd_checksum_failures_total")]:
        assert metrics[f"kvstore_{metric}"] == float(ssd[field]), field
    stats = r.execute_command(wire.KV_STATS)     # a map under RESP3, pairs under RESP2
    stats = stats if isinstance(stats, dict) else dict(zip(stats[::2], stats[1::2]))
    assert stats[b"bytes_ssd"] + stats[b"bytes_dram"] == 48 * 256 * KIB


def test_info_counts_dram_hits_with_an_ssd_tier(tiered):
    daemon = tiered(dram="64mb")
    r = client(daemon)
    write_values(r, range(4))
    for n in range(4):
        r.get(key_of(n))
    r.get(b"absent")
    dram = r.info("dram")
    assert (dram["dram_hits"], dram["dram_misses"]) == (4, 1)


def test_ping_answered_while_a_large_index_is_loading(tmp_path, kvstore_factory):
    """200,000 values already on SSD: PING answers while INFO still says loading."""
    path = str(tmp_path / "ssd")
    tier = SSDTier.open(path, 1 << 34, compression="off")
    for start in range(0, 200_000, 5000):
        tier.put_batch([(b"%032x" % i, b"x" * 64, None, None) for i in range(start, start + 5000)])
    tier.close()
    port = free_port()
    log_path = tmp_path / "loading.log"
    args = [sys.executable, "-m", "kvstore", "serve", "--port", str(port), "--dram-size", "8mb", "--ssd-dir", path]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    daemon = kvstore_factory.adopt(Daemon(proc, "127.0.0.1", port, None, None, str(log_path), args))
    wait_ready("127.0.0.1", port, proc)
    r = client(daemon)
    answered_while_loading = 0
    while True:
        pipe = r.pipeline(transaction=False)
        pipe.ping()
        pipe.info("ssd")
        pong, ssd = pipe.execute()
        if not ssd["ssd_loading"]:
            break
        answered_while_loading += pong is True
    assert answered_while_loading > 0
    wait_until(lambda: "Recovered 200000 values" in daemon.log(), what="the recovery log line")
    assert r.dbsize() == 200_000
    assert r.get(b"%032x" % 1234) == b"x" * 64
