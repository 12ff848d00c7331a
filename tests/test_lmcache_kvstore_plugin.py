"""The `kvstore://` LMCache connector (client/connectors/lmcache_kvstore.py), loaded the way LMCache
0.5.6 loads a remote storage plugin (`remote_storage_plugins` + `remote_storage_plugin.kvstore.*`),
against a real `kvstore serve`: LMCache's own `RemoteBackend` over it, every byte checked, one
KV.MATCH per batched lookup, the node's arena carrying the bytes, reads under eviction a miss or the
right bytes, a node that goes down and comes back, and a clear error for a bad address."""
from __future__ import annotations

import asyncio
import logging
import random
import signal
import time
from pathlib import Path

import pytest

from conftest import free_port, wait_until
from client import KVClient
from client.connectors.lmcache_kvstore import KVStoreConnector
from loadtest.bench_lmcache import kvstore_plugin_config
from lmcache.v1.storage_backend.remote_backend import RemoteBackend

from tests.test_connectors_lmcache import rig, server  # noqa: F401  (fixtures: LMCache rig, one node)

LOGGER = "client.connectors.lmcache_kvstore"


def release(*memory_objs) -> None:
    """Give back chunks read (a put takes over its chunk's reference, as LMCache's callers expect)."""
    for memory_obj in memory_objs:
        if memory_obj is not None:
            memory_obj.ref_count_down()


def plugin(rig, node, class_name: str = "KVStoreConnectorAdapter", **options):
    extra = kvstore_plugin_config(f"kvstore://{node.host}:{node.port}", **options)
    extra["remote_storage_plugin.kvstore.class_name"] = class_name
    return rig.connector("plugin://kvstore", extra, ["kvstore"], "kvstore")


def slowlog_commands(node) -> list[bytes]:
    with KVClient(node.host, node.port, fast_path="off") as kv:
        entries = kv.execute("SLOWLOG", "GET", "1000")
    return [bytes(entry[3][0]).upper() for entry in entries]


def test_lmcache_remote_backend_runs_on_the_plugin(rig, server):
    """LMCache's RemoteBackend, built from `remote_storage_plugins`, stores and reads through it."""
    config = rig.config(extra=kvstore_plugin_config(f"kvstore://{server.host}:{server.port}"), plugins=["kvstore"])
    local = rig.backend(config)
    backend = RemoteBackend(config, rig.metadata, rig.loop, local, "cpu", plugin_name="kvstore")
    connector = backend.connection.getWrappedConnector()
    assert isinstance(connector, KVStoreConnector) and (connector.host, connector.port) == (server.host, server.port)

    keys = [rig.key(i) for i in range(8)]
    chunks = [rig.chunk(local, i) for i in range(8)]
    assert backend.batched_contains(keys) == 0 and not backend.contains(keys[0])
    backend.batched_submit_put_task(keys[:6], chunks[:6])
    backend.submit_put_task(keys[6], chunks[6]).result(10)
    for _ in range(200):
        if backend.batched_contains(keys) == 7:
            break
        asyncio.run(asyncio.sleep(0.01))
    assert backend.batched_contains(keys) == 7 and backend.contains(keys[6]) and not backend.contains(keys[7])

    got = backend.get_blocking(keys[3])
    assert rig.right(3, got)
    many = backend.batched_get_blocking(keys)
    assert [m is not None for m in many] == [True] * 7 + [False]
    assert all(rig.right(i, m) for i, m in enumerate(many[:7]))
    assert connector.store.fast_path.stats.reads + connector.store.fast_path.stats.index_reads > 0, \
        "the node's arena did not carry the reads"
    release(got, *many, chunks[7])


def test_batched_lookup_is_one_kv_match(rig, server):
    connector, local = plugin(rig, server, unix_socket=server.unix_socket)
    keys = [rig.key(200 + i) for i in range(6)]
    chunks = [rig.chunk(local, 200 + i) for i in range(4)]
    rig.run(connector.batched_put(keys[:4], chunks))
    with KVClient(server.host, server.port, fast_path="off") as kv:
        kv.execute("CONFIG", "SET", "slowlog-log-slower-than", "0")
        kv.execute("SLOWLOG", "RESET")
    assert rig.run(connector.batched_async_contains("l", keys)) == 4
    assert connector.batched_contains(keys[:2] + keys[5:] + keys[2:4]) == 2
    commands = [c for c in slowlog_commands(server) if c not in (b"SLOWLOG", b"CONFIG")]
    assert commands == [b"KV.MATCH", b"KV.MATCH"], commands


@pytest.mark.parametrize("class_name", ["KVStoreConnectorAdapter", "KVStoreConnector"])
def test_every_byte_round_trips_full_and_partial_chunks(rig, server, class_name):
    connector, local = plugin(rig, server, class_name)
    assert type(connector.getWrappedConnector()) is KVStoreConnector
    base = 400 if class_name == "KVStoreConnector" else 300
    keys = [rig.key(base + i) for i in range(5)]
    chunks = [rig.chunk(local, base + i) for i in range(4)] + [rig.chunk(local, base + 4, tokens=100)]
    rig.run(connector.batched_put(keys[:3], chunks[:3]))
    for key, chunk in zip(keys[3:], chunks[3:]):
        rig.run(connector.put(key, chunk))
    assert rig.run(connector.exists(keys[4])) and connector.exists_sync(keys[0])
    assert not rig.run(connector.exists(rig.key(999)))

    got = [rig.run(connector.get(key)) for key in keys]
    assert all(rig.right(base + i, m) for i, m in enumerate(got))
    assert got[4].meta.shape[2] == 100, "a partial chunk comes back with its own token count"
    batch = rig.run(connector.batched_get(keys[:2] + [rig.key(999)] + keys[2:]))
    assert batch[2] is None and all(rig.right(base + i, m) for i, m in enumerate(batch[:2] + batch[3:]))
    prefix = rig.run(connector.batched_get_non_blocking("l", keys[:2] + [rig.key(999)] + keys[2:]))
    assert len(prefix) == 2 and all(rig.right(base + i, m) for i, m in enumerate(prefix))
    assert rig.run(connector.get(rig.key(999))) is None
    release(*got, *batch, *prefix)


def test_under_eviction_reads_a_miss_never_wrong_bytes(rig, kvstore_factory):
    node = kvstore_factory("--dram-size", "16mb")              # ~30 chunks of 512 KiB
    connector, local = plugin(rig, node)
    for start in range(0, 80, 8):                                    # 40 MiB put
        chunks = [rig.chunk(local, i) for i in range(start, start + 8)]
        rig.run(connector.batched_put([rig.key(i) for i in range(start, start + 8)], chunks))
    tally = {"hits": 0, "misses": 0, "wrong": 0}
    rng = random.Random(5)

    async def read(i: int) -> None:
        got = await connector.get(rig.key(i))
        tally["misses" if got is None else "hits" if rig.right(i, got) else "wrong"] += 1
        release(got)

    async def write(i: int) -> None:
        chunk = rig.chunk(local, i)
        await connector.put(rig.key(i), chunk)

    async def waves() -> None:
        new = 80
        for _ in range(8):
            await asyncio.gather(*(read(rng.randrange(new)) for _ in range(6)),
                                 *(write(new + j) for j in range(3)))
            new += 3
    rig.run(waves())
    assert tally["wrong"] == 0, tally
    assert tally["hits"] > 0 and tally["misses"] > 0, f"no eviction or no hit: the test proves nothing {tally}"



def test_a_node_down_is_misses_and_one_log_line_then_the_node_is_used_again(rig, kvstore_factory, caplog):
    node = kvstore_factory()
    connector, local = plugin(rig, node, timeout=2.0, retry_interval=0.2)
    rig.run(connector.put(rig.key(0), rig.chunk(local, 0)))
    node.stop()
    caplog.set_level(logging.INFO, logger=LOGGER)
    for _ in range(2):
        assert rig.run(connector.get(rig.key(0))) is None
        assert not rig.run(connector.exists(rig.key(0))) and not connector.exists_sync(rig.key(0))
        assert connector.batched_contains([rig.key(0)]) == 0
        assert rig.run(connector.batched_async_contains("l", [rig.key(0)])) == 0
        assert rig.run(connector.batched_get([rig.key(0), rig.key(1)])) == [None, None]
        rig.run(connector.put(rig.key(1), rig.chunk(local, 1)))       # dropped, no exception
        rig.run(connector.batched_put([rig.key(2)], [rig.chunk(local, 2)]))
        rig.run(asyncio.sleep(0.25))
    down = [r for r in caplog.records if r.name == LOGGER and "cannot be used" in r.getMessage()]
    assert len(down) == 1, [r.getMessage() for r in caplog.records]
    assert f"{node.host}:{node.port}" in down[0].getMessage() and down[0].levelno == logging.WARNING

    # the same node comes back on its port (a restart: empty, with a new arena)
    node = kvstore_factory.restart(node)
    rig.run(asyncio.sleep(0.25))
    assert rig.run(connector.get(rig.key(0))) is None                 # lost with the old process
    rig.run(connector.put(rig.key(1), rig.chunk(local, 1)))
    got = rig.run(connector.get(rig.key(1)))
    assert rig.right(1, got)
    assert connector.batched_contains([rig.key(1)]) == 1
    back = [r for r in caplog.records if r.name == LOGGER and "answers again" in r.getMessage()]
    assert len(back) == 1
    release(got)


def test_a_node_down_from_the_start_does_not_stop_lmcache(rig):
    port = free_port()                                                    # nobody listens there
    config = rig.config(extra=kvstore_plugin_config(f"kvstore://127.0.0.1:{port}"), plugins=["kvstore"])
    local = rig.backend(config)
    backend = RemoteBackend(config, rig.metadata, rig.loop, local, "cpu", plugin_name="kvstore")
    assert backend.connection is not None
    chunk = rig.chunk(local, 0)
    backend.submit_put_task(rig.key(0), chunk).result(10)
    assert backend.batched_contains([rig.key(0)]) == 0 and backend.get_blocking(rig.key(0)) is None


@pytest.mark.parametrize("url", [None, "", "kvstore://127.0.0.1", "redis://127.0.0.1:6380", "kvstore://:6380",
                                 "kvstore://127.0.0.1:notaport", "kvstore://127.0.0.1:6380/db",
                                 "kvstore://127.0.0.1:6380?db=1"])
def test_a_missing_or_malformed_address_is_an_error_naming_the_setting(rig, url):
    extra = kvstore_plugin_config(url)
    with pytest.raises(ValueError, match=r"remote_storage_plugin\.kvstore\.url"):
        rig.connector("plugin://kvstore", extra, ["kvstore"], "kvstore")


def test_remote_url_with_the_kvstore_scheme_once_the_plugin_is_listed(rig, server):
    extra = kvstore_plugin_config(None)
    connector, local = rig.connector(f"kvstore://{server.host}:{server.port}", extra, ["kvstore"])
    chunk = rig.chunk(local, 500)
    rig.run(connector.put(rig.key(500), chunk))
    got = rig.run(connector.get(rig.key(500)))
    assert rig.right(500, got)
    with pytest.raises(ValueError, match="remote_url"):
        rig.connector("kvstore://127.0.0.1", extra, ["kvstore"])
    release(got)


def test_an_acl_password_in_the_address_and_a_wrong_one_logged_once(rig, kvstore_factory, caplog):
    node = kvstore_factory(password="s3cret")
    extra = kvstore_plugin_config(f"kvstore://:s3cret@{node.host}:{node.port}")
    connector, local = rig.connector("plugin://kvstore", extra, ["kvstore"], "kvstore")
    rig.run(connector.put(rig.key(1), rig.chunk(local, 1)))
    got = rig.run(connector.get(rig.key(1)))
    assert rig.right(1, got)
    release(got)

    caplog.set_level(logging.INFO, logger=LOGGER)
    extra = kvstore_plugin_config(f"kvstore://{node.host}:{node.port}", password="wrong")
    connector, local = rig.connector("plugin://kvstore", extra, ["kvstore"], "kvstore")
    for _ in range(3):
        assert rig.run(connector.get(rig.key(1))) is None
        assert connector.batched_contains([rig.key(1)]) == 0
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno >= logging.WARNING]
    assert len(lines) == 1 and "AuthenticationError" in lines[0], lines


def test_the_documented_yaml_configures_the_plugin(rig, server, tmp_path):
    """The `kvstore://` YAML of docs/engines.md, loaded by LMCache's own config reader."""
    from lmcache.v1.config import LMCacheEngineConfig

    doc = (Path(__file__).parent.parent / "docs" / "engines.md").read_text()
    block = next(b.split("\n", 1)[1] for b in doc.split("```yaml")[1:]
                 if "remote_storage_plugin.kvstore.url" in b.split("```")[0]).split("```")[0]
    path = tmp_path / "lmcache.yaml"
    path.write_text(block.replace("10.0.0.5:6380", f"{server.host}:{server.port}"))
    config = LMCacheEngineConfig.from_file(str(path))
    local = rig.backend(config)
    name = config.remote_storage_plugins[0]
    backend = RemoteBackend(config, rig.metadata, rig.loop, local, "cpu", plugin_name=name)
    assert isinstance(backend.connection.getWrappedConnector(), KVStoreConnector)
    backend.submit_put_task(rig.key(800), rig.chunk(local, 800)).result(10)
    assert backend.batched_contains([rig.key(800)]) == 1
    got = backend.get_blocking(rig.key(800))
    assert rig.right(800, got)
    release(got)


def test_a_hung_node_costs_one_timeout_then_misses_at_once(rig, kvstore_factory, caplog):
    """A node that stops answering (SIGSTOP) holds one call for `timeout`; the calls after it miss at
    once until the next probe, and the node is used again once it answers."""
    node = kvstore_factory()
    connector, local = plugin(rig, node, timeout=0.5, retry_interval=2.0)
    rig.run(connector.put(rig.key(900), rig.chunk(local, 900)))
    caplog.set_level(logging.INFO, logger=LOGGER)
    node.proc.send_signal(signal.SIGSTOP)
    try:
        started = time.monotonic()
        assert connector.batched_contains([rig.key(900)]) == 0            # over the wire: times out
        assert time.monotonic() - started < 3
        started = time.monotonic()
        for _ in range(20):
            assert rig.run(connector.batched_async_contains("l", [rig.key(900)])) == 0
            assert not connector.exists_sync(rig.key(900))
        assert time.monotonic() - started < 1.5, "calls waited on a node already known to be down"
        assert len([r for r in caplog.records if "cannot be used" in r.getMessage()]) == 1
    finally:
        node.proc.send_signal(signal.SIGCONT)
    wait_until(lambda: connector.batched_contains([rig.key(900)]) == 1, what="the node used again")
    got = rig.run(connector.get(rig.key(900)))
    assert rig.right(900, got)
    release(got)
