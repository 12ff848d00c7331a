"""The store as an LMCache remote backend: `kvstore://host:port`, loaded as an LMCache plugin.

LMCache 0.5.6 loads remote connectors that live outside its tree through its
remote storage plugin framework. The engine's configuration names the plugin
and where its class lives, and gives the node's address under the plugin's
own key::

    remote_storage_plugins: ["kvstore"]
    extra_config:
      remote_storage_plugin.kvstore.module_path: client.connectors.lmcache_kvstore
      remote_storage_plugin.kvstore.class_name: KVStoreConnectorAdapter
      remote_storage_plugin.kvstore.url: kvstore://127.0.0.1:6380

LMCache then builds a `RemoteBackend` whose connector comes from
`KVStoreConnectorAdapter` (which also understands a plain
`remote_url: kvstore://host:port` once the plugin is listed). `class_name:
KVStoreConnector` works too: LMCache wraps a `RemoteConnector` subclass in
its own adapter and builds it with ``(loop, local_cpu_backend, config)``.
A plugin instance named ``kvstore.NAME`` reads its settings under
``remote_storage_plugin.kvstore.NAME.*``. Besides ``url``
(``kvstore://[[user]:password@]host:port``) they are: ``unix_socket`` (the
node's socket path: used instead of TCP), ``username``/``password`` (an ACL
user), ``timeout`` (seconds, 5), ``retries`` (1), ``pool_size``
(connections, 16), ``retry_interval`` (seconds between tries of a node that
is down, 1) and ``link_chunks`` (true).

Layout: one store value per LMCache chunk, under the chunk key's string
(`model@world_size@worker_id@chunk_hash@dtype`), holding exactly the chunk's
bytes (the layout `resp://` uses for full chunks, so the two read each other's
chunks). A value is visible only once written whole and a key maps to one
value, so a read gets a whole chunk or a miss; there is no second key that
eviction could separate from the first, as with `redis://`'s
`kv_bytes`/`metadata` pair. Shapes and dtypes are the engine's (every chunk
of one engine has the same); a last, partial chunk is recognised by its
length. The chunks of one batched put are linked as a chain (`KV.PUT ...
PARENT`), so under memory pressure the node evicts a prefix from its tail.

The bytes move on the SDK's zero-copy paths: a get is received straight into
the `MemoryObj` LMCache allocates (`get_into`; on the node's host, one memcpy
out of its shared-memory arena), a put is sent from the `MemoryObj`'s own
memory. A batched lookup is one `KV.MATCH`, however many chunks it asks about.

A node that is down or unreachable never stops LMCache: the first failure
logs one warning, every read then misses and every write is dropped, and the
connector tries the node again every `retry_interval` seconds; the first call
that gets through logs that the node is back.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any, Callable, Coroutine, List, Optional
from urllib.parse import urlsplit

from client import AsyncKVClient, KVClient
from client.connectors.store_health import StoreHealth
from client.errors import AuthenticationError, BufferTooSmall, KVError
from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.storage_backend.connector import ConnectorAdapter, ConnectorContext, extract_plugin_type
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

logger = logging.getLogger(__name__)

SCHEME = "kvstore://"
PLUGIN = "kvstore"
DEFAULTS = {"timeout": 5.0, "retries": 1, "pool_size": 16, "retry_interval": 1.0, "link_chunks": True}
# the node cannot be used: the SDK's ConnectionError and TimeoutError derive from the first two
UNUSABLE = (ConnectionError, TimeoutError, OSError, AuthenticationError)
REFUSAL_LOG_INTERVAL = 60.0      # seconds between two log lines about requests the node refuses


def config_key(plugin_name: str, option: str) -> str:
    return f"remote_storage_plugin.{plugin_name}.{option}"


def parse_address(url: Any, where: str) -> tuple[str, int, str | None, str | None]:
    """(host, port, username, password) from ``kvstore://[[user]:password@]host:port`` (or
    ``host:port``); ValueError naming ``where``, the setting the address came from, when it is
    missing or malformed."""
    if not isinstance(url, str) or not url.strip():
        raise ValueError(f"kvstore connector: no store address: set {where} to kvstore://HOST:PORT")
    text = url.strip()
    if "://" not in text:
        text = SCHEME + text
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"kvstore connector: {where}={url!r} is not kvstore://HOST:PORT ({exc})") from None
    if parts.scheme != PLUGIN or not parts.hostname or port is None or parts.path not in ("", "/") \
            or parts.query or parts.fragment:
        raise ValueError(f"kvstore connector: {where}={url!r} is not kvstore://HOST:PORT")
    return parts.hostname, port, parts.username or None, parts.password or None


def _extra(config: Any) -> dict:
    extra = getattr(config, "extra_config", None)
    return extra if isinstance(extra, dict) else {}


def address_from_config(config: Any, plugin_name: str) -> tuple[str, str]:
    """The address and the setting it came from: the plugin's ``url`` key, else a ``kvstore://``
    `remote_url`."""
    key = config_key(plugin_name, "url")
    url = _extra(config).get(key)
    remote_url = getattr(config, "remote_url", None)
    if url is None and isinstance(remote_url, str) and remote_url.startswith(SCHEME):
        return remote_url, "remote_url"
    return url, key


class KVStoreConnector(RemoteConnector):
    """LMCache's `RemoteConnector` over the kvstore SDK (see the module's docstring)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, local_cpu_backend: Any, config: Any = None,
                 url: str | None = None, plugin_name: str = PLUGIN):
        config = config if config is not None else local_cpu_backend.config
        super().__init__(local_cpu_backend.config, local_cpu_backend.metadata)
        self.plugin_name = plugin_name = plugin_name or PLUGIN     # its settings: remote_storage_plugin.<name>.*
        where = "remote_url"
        if url is None:
            url, where = address_from_config(config, plugin_name)
        self.host, self.port, username, password = parse_address(url, where)
        extra = _extra(config)

        def option(name: str, kind: Callable[[Any], Any]) -> Any:
            key = config_key(plugin_name, name)
            value = extra.get(key, DEFAULTS[name])
            try:
                return kind(value)
            except (TypeError, ValueError):
                raise ValueError(f"kvstore connector: {key}={value!r} is not a valid {kind.__name__}") from None

        def flag(value: Any) -> bool:
            return value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes", "on")

        username = extra.get(config_key(plugin_name, "username")) or username
        password = extra.get(config_key(plugin_name, "password")) or password
        self.link_chunks = option("link_chunks", flag)
        common = dict(username=username, password=password, timeout=option("timeout", float),
                      retries=option("retries", int), pool_size=option("pool_size", int),
                      unix_socket=extra.get(config_key(plugin_name, "unix_socket")) or None)
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        self.store = AsyncKVClient(self.host, self.port, **common)     # used on `loop` only
        self.sync_store = KVClient(self.host, self.port, **common)     # for the synchronous lookups
        self.reach = StoreHealth(f"kvstore at {self.host}:{self.port}", logger,
                                 "LMCache's remote reads miss and its writes are dropped", option("retry_interval", float))
        self._refusal_lock = threading.Lock()
        self._refusals, self._refusal_logged = 0, -REFUSAL_LOG_INTERVAL
        threading.Thread(target=self._map_arena, name="kvstore-arena-map", daemon=True).start()
        logger.info("kvstore connector for %s:%d (plugin %s)", self.host, self.port, plugin_name)

    def _map_arena(self) -> None:
        """Map the node's shared-memory arena now, off LMCache's path: mapping populates the page
        table of the whole arena (a cold first turn of 4 MiB puts ran at about a quarter of a warm
        one when the first put mapped it). A node elsewhere, or down, is left to the first call."""
        try:
            self.store.fast_path.arena()
        except Exception as exc:        # the first put or get maps it, or uses the wire
            logger.debug("kvstore connector: the arena is not mapped ahead: %s", exc)

    # ------------------------------------------------------------------ guards

    async def _guarded(self, call: Callable[[], Coroutine[Any, Any, Any]], miss: Any, tried: bool = False) -> Any:
        """``call()``'s result, or ``miss`` when the node is down or refuses it (``tried``: the caller
        has already asked `worth_trying`, which claims the probe of a node that is down)."""
        if not tried and not self.reach.usable():
            return miss
        try:
            result = await call()
        except UNUSABLE as exc:
            self.reach.failed(exc)
            return miss
        except KVError as exc:          # the node refused this one request (e.g. out of memory)
            self._refused(exc)
            return miss
        self.reach.answered()
        return result

    def _guarded_sync(self, call: Callable[[], Any], miss: Any) -> Any:
        if not self.reach.usable():
            return miss
        try:
            result = call()
        except UNUSABLE as exc:
            self.reach.failed(exc)
            return miss
        except KVError as exc:
            self._refused(exc)
            return miss
        self.reach.answered()
        return result

    def _refused(self, exc: KVError) -> None:
        """A request the node answered with an error: a miss; logged once a `REFUSAL_LOG_INTERVAL`."""
        self.reach.answered()
        now = time.monotonic()
        with self._refusal_lock:
            self._refusals += 1
            if now - self._refusal_logged < REFUSAL_LOG_INTERVAL:
                return
            count, self._refusals, self._refusal_logged = self._refusals, 0, now
        logger.warning("kvstore at %s:%d refused %d request(s), taken as misses; the last: %s",
                       self.host, self.port, count, exc)

    # ------------------------------------------------------------------ lookups

    async def exists(self, key: CacheEngineKey) -> bool:
        return bool(await self._guarded(lambda: self.store.exists(key.to_string()), 0))

    def exists_sync(self, key: CacheEngineKey) -> bool:
        return bool(self._guarded_sync(lambda: self.sync_store.exists(key.to_string()), 0))

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys: List[CacheEngineKey]) -> int:
        """How many leading chunks the node holds: one KV.MATCH."""
        if not keys:
            return 0
        names = [k.to_string() for k in keys]
        return self._guarded_sync(lambda: self.sync_store.match_prefix(names), 0)

    def support_batched_async_contains(self) -> bool:
        return True

    async def batched_async_contains(self, lookup_id: str, keys: List[CacheEngineKey], pin: bool = False) -> int:
        """How many leading chunks the node holds: one KV.MATCH."""
        if not keys:
            return 0
        names = [k.to_string() for k in keys]
        return await self._guarded(lambda: self.store.match_prefix(names), 0)

    # ------------------------------------------------------------------ reads

    def _allocate(self) -> Optional[MemoryObj]:
        memory_obj = self.local_cpu_backend.allocate(self.meta_shapes, self.meta_dtypes, self.meta_fmt)
        if memory_obj is None:
            logger.warning("kvstore connector: LMCache's CPU buffer is full; the read is a miss")
        return memory_obj

    def _finish_read(self, key: CacheEngineKey, memory_obj: MemoryObj, length: Any) -> Optional[MemoryObj]:
        """The chunk read into ``memory_obj`` (``length`` bytes, or an exception or None for a miss),
        shaped to its token count; else None, with ``memory_obj`` given back to LMCache."""
        if isinstance(length, int) and length > 0:
            try:
                return self.reshape_partial_chunk(memory_obj, length)
            except ValueError as exc:
                logger.warning("kvstore connector: %s holds %d bytes, not a chunk of this engine (%s): a miss",
                               key.to_string(), length, exc)
        elif isinstance(length, BufferTooSmall):
            logger.warning("kvstore connector: %s holds %d bytes, more than a chunk of this engine (%d): "
                           "a miss", key.to_string(), length.size, self.full_chunk_size_bytes)
        memory_obj.ref_count_down()
        return None

    async def get(self, key: CacheEngineKey) -> Optional[MemoryObj]:
        if not self.reach.usable():
            return None
        memory_obj = self._allocate()
        if memory_obj is None:
            return None

        async def read() -> Any:
            try:
                return await self.store.get_into(key.to_string(), memory_obj.byte_array)
            except BufferTooSmall as exc:
                return exc

        return self._finish_read(key, memory_obj, await self._guarded(read, None, tried=True))

    def support_batched_get(self) -> bool:
        return True

    async def batched_get(self, keys: List[CacheEngineKey]) -> List[Optional[MemoryObj]]:
        """One chunk or None per key, received in pipelined round trips."""
        if not self.reach.usable():
            return [None] * len(keys)
        memory_objs = []
        for _ in keys:
            memory_obj = self._allocate()
            if memory_obj is None:
                break
            memory_objs.append(memory_obj)
        wanted = keys[:len(memory_objs)]

        async def read() -> Any:
            try:
                return await self.store.batch_get_into([k.to_string() for k in wanted],
                                                       [m.byte_array for m in memory_objs])
            except BufferTooSmall:      # one value too large: read them one by one to tell which
                return [await self._read_one(k, m) for k, m in zip(wanted, memory_objs)]

        lengths = await self._guarded(read, None, tried=True) or [None] * len(wanted)
        got = [self._finish_read(k, m, n) for k, m, n in zip(wanted, memory_objs, lengths)]
        return got + [None] * (len(keys) - len(got))

    async def _read_one(self, key: CacheEngineKey, memory_obj: MemoryObj) -> Any:
        try:
            return await self.store.get_into(key.to_string(), memory_obj.byte_array)
        except BufferTooSmall as exc:
            return exc

    def support_batched_get_non_blocking(self) -> bool:
        return True

    async def batched_get_non_blocking(self, lookup_id: str, keys: List[CacheEngineKey]) -> List[MemoryObj]:
        """The leading chunks that were read, up to the first miss (the rest given back)."""
        results = await self.batched_get(keys)
        prefix: list[MemoryObj] = []
        for memory_obj in results:
            if memory_obj is None:
                break
            prefix.append(memory_obj)
        for memory_obj in results[len(prefix):]:
            if memory_obj is not None:
                memory_obj.ref_count_down()
        return prefix

    # ------------------------------------------------------------------ writes

    async def put(self, key: CacheEngineKey, memory_obj: MemoryObj) -> None:
        await self._guarded(lambda: self.store.put(key.to_string(), memory_obj.byte_array), False)

    def support_batched_put(self) -> bool:
        return True

    async def batched_put(self, keys: List[CacheEngineKey], memory_objs: List[MemoryObj]) -> None:
        """One pipelined round trip; each chunk linked to the one before it (a prefix's chain)."""
        if not keys:
            return
        names = [k.to_string() for k in keys]
        parents = [None, *names[:-1]] if self.link_chunks else None
        items = [(name, m.byte_array) for name, m in zip(names, memory_objs)]
        await self._guarded(lambda: self.store.batch_put(items, parents=parents), None)

    # ------------------------------------------------------------------ the rest

    async def list(self) -> List[str]:
        """Every key on the node that looks like an LMCache chunk key (SCAN)."""
        async def scan() -> list[str]:
            cursor, found = 0, []
            while True:
                cursor, names = await self.store.execute("SCAN", cursor, "MATCH", "*@*@*@*@*", "COUNT", 1000)
                found += [n.decode() if isinstance(n, bytes) else n for n in names]
                if int(cursor) == 0:
                    return found
        return await self._guarded(scan, [])

    async def close(self) -> None:
        await self.store.close()
        self.sync_store.close()
        logger.info("kvstore connector for %s:%d closed", self.host, self.port)

    def __repr__(self) -> str:
        return f"<KVStoreConnector {self.host}:{self.port}>"


class KVStoreConnectorAdapter(ConnectorAdapter):
    """LMCache's adapter for `plugin://kvstore[.instance]` (the plugin framework's URL; the address
    comes from `remote_storage_plugin.<instance>.url`) and for `kvstore://host:port`."""

    def __init__(self) -> None:
        super().__init__(SCHEME)

    def can_parse(self, url: str) -> bool:
        if url.startswith(SCHEME):
            return True
        return url.startswith("plugin://") and extract_plugin_type(url[len("plugin://"):]) == PLUGIN

    def create_connector(self, context: ConnectorContext) -> RemoteConnector:
        if context.url.startswith(SCHEME):
            return KVStoreConnector(context.loop, context.local_cpu_backend, context.config, url=context.url,
                                    plugin_name=context.plugin_name or PLUGIN)
        name = context.plugin_name or context.url[len("plugin://"):]
        return KVStoreConnector(context.loop, context.local_cpu_backend, context.config, plugin_name=name)
