"""The store as an SGLang (0.5.23) HiCache storage backend, loaded by SGLang's own factory.

SGLang's hierarchical cache keeps KV pages in GPU memory, then in a host
(CPU) pool, then in a storage backend. Started with

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvstore",
        "module_path": "client.connectors.sglang_hicache", "class_name": "HiCacheStore",
        "store_host": "10.0.0.5", "store_port": 6380}'

its `StorageBackendFactory` imports this module, checks that `HiCacheStore`
subclasses its `HiCacheStorage` and builds it as `cls(storage_config, kwargs)`;
the cache controller then hands it the host pool (`register_mem_pool_host`).

- **Zero copy** (`batch_get_v1`/`batch_set_v1`): each page of the host pool is
  the pieces `get_page_buffer_meta` names (as SGLang's Mooncake backend uses
  them): K and V of the page for the page-first layouts, K and V of every layer
  for `layer_first`. Each piece is one store value, sent from and received
  into the pool's own memory (`batch_put` / `batch_get_into`, one round trip
  a batch); a page is a hit only when every piece came back at its exact size.
  The zero-copy path is what this backend asks for: `interface_v1` defaults to
  1 here (set it to 0 in the extra config for the copying path).
- **Prefix hits** (`batch_exists`): one `KV.MATCH` over the pages' pieces in
  order, whatever the prefix length. Puts link each piece to the one before it
  (`PARENT`), so under memory pressure the store evicts a prefix from its tail.
- **Keys** carry what SGLang's file backend puts in its file names (model, TP
  rank and size; pipeline and context-parallel shards; MLA pages, the same on
  every TP rank, without the rank), and the page format (layout, dtype, piece
  sizes), so engines that lay pages out differently never read each other's
  bytes: ``{key_prefix}{model}_{tp_rank}_{tp_size}:{layout}.{dtype}.{n}x{bytes}:{page hash}.{piece}``.
  The namespace comes first so that `clear` (and an ACL user's key pattern)
  covers exactly one engine's keys.
- **A store that is down or slow** never raises into SGLang: the failure is
  logged once, every call misses (nothing is sent) for ``store_retry_s``
  seconds, then the next call tries the store again and its success is logged.
  A page whose value vanished, or changed size, is a miss.

Without SGLang installed the module still imports (the base class is then
`object`) and `HiCacheStore.over_client` gives the same tensor-by-key API to
code that is not SGLang.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Sequence

import torch

from client import KVClient
from client.connectors.store_health import StoreHealth
from client.errors import BufferTooSmall, ConnectionError as StoreConnectionError, KVError, TimeoutError as StoreTimeout
from client.tensors import TensorMismatch

try:                                             # the base class SGLang's factory insists on
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage as _Base
    SGLANG = True
except Exception:                                # not installed, or its import chain fails here
    _Base = object
    SGLANG = False

logger = logging.getLogger(__name__)

CLEAR_SCAN_COUNT = 1000
DEFAULT_KEY_PREFIX = "hicache:"
DEFAULT_TIMEOUT_S = 2.0
DEFAULT_RETRY_S = 1.0
UNREACHABLE = (StoreConnectionError, StoreTimeout, OSError)   # the store is down or slow: not a bug


def _required(extra: dict, key: str, what: str) -> Any:
    if key not in extra or extra[key] in (None, ""):
        raise ValueError(f"HiCacheStore: the storage backend extra config needs {key!r} ({what})")
    return extra[key]


def store_address(extra: dict | None) -> tuple[str, int]:
    """``store_host`` and ``store_port`` from the extra config; ValueError naming the key when bad."""
    extra = extra or {}
    host = _required(extra, "store_host", "the kvstore node's host name or IP address")
    if not isinstance(host, str) or any(c.isspace() for c in host):
        raise ValueError(f"HiCacheStore: 'store_host' must be a host name or IP address, not {host!r}")
    port = _required(extra, "store_port", "the kvstore node's TCP port")
    if isinstance(port, bool) or not (isinstance(port, int) or (isinstance(port, str) and port.isdigit())):
        raise ValueError(f"HiCacheStore: 'store_port' must be a port number, not {port!r}")
    if not 0 < int(port) < 65536:
        raise ValueError(f"HiCacheStore: 'store_port' must be in 1..65535, not {port}")
    return host, int(port)


def config_namespace(storage_config: Any) -> str:
    """The part of every key that SGLang's file backend puts in its file names (`HiCacheFile`)."""
    if storage_config is None:
        return "local"
    model = "-".join(storage_config.model_name.split("/")) if storage_config.model_name else ""
    shard = f"_{storage_config.pp_size}_{storage_config.pp_rank}" if storage_config.pp_size > 1 else ""
    if storage_config.attn_cp_size > 1:
        shard += f"_cp{storage_config.attn_cp_rank}_{storage_config.attn_cp_size}"
    if storage_config.is_mla_model:           # MLA KV is the same on every TP rank: one copy
        name = f"{model}{shard}"
    else:
        name = f"{model}_{storage_config.tp_rank}_{storage_config.tp_size}{shard}"
    if getattr(storage_config, "dcp_size", 1) > 1:
        name += (f"_tp{storage_config.tp_size}_dcp{storage_config.dcp_rank}_{storage_config.dcp_size}"
                 f"_page{storage_config.logical_page_size}")
    return name


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


class _PoolPages:
    """A host KV pool's pages as flat byte views of its own memory (no copies)."""

    def __init__(self, pool: Any):
        buffer = getattr(pool, "kv_buffer", None)
        if buffer is None:
            raise ValueError(f"HiCacheStore: {type(pool).__name__} has no host KV buffer "
                             "(hybrid pools without one are not supported)")
        if buffer.device.type != "cpu" or not buffer.is_contiguous():
            raise ValueError("HiCacheStore: the host KV pool must be one contiguous CPU tensor")
        self.pool = pool
        self.page_size = pool.page_size
        flat = buffer.view(-1).view(torch.uint8)
        self.base, self.nbytes = buffer.data_ptr(), flat.numel()
        self.memory = memoryview(flat.numpy())        # shares the pool's memory
        probe = torch.arange(self.page_size, dtype=torch.int64)
        try:
            _, sizes = pool.get_page_buffer_meta(probe)
        except (ValueError, AssertionError, NotImplementedError) as e:
            raise ValueError(f"HiCacheStore: host pool layout {pool.layout!r} has no page buffer "
                             f"description ({e})") from e
        self.piece_sizes = list(sizes)
        self.pieces = len(sizes)                      # values per page
        self.page_bytes = sum(sizes)
        self.suffixes = ([""] if self.pieces == 1 else [".k", ".v"] if self.pieces == 2
                         else [f".{j}" for j in range(self.pieces)])
        dtype = str(pool.dtype).removeprefix("torch.")
        shapes = "-".join(str(s) for s in sorted(set(sizes)))
        self.format = f"{pool.layout}.{dtype}.{self.pieces}x{shapes}"

    def views(self, host_indices: torch.Tensor, pages: int) -> list[memoryview]:
        """Every piece of ``pages`` pages at ``host_indices`` (page_size indices a page), in order."""
        if host_indices.numel() != pages * self.page_size:
            raise ValueError(f"{pages} pages need {pages * self.page_size} host indices, "
                             f"got {host_indices.numel()}")
        ptrs, sizes = self.pool.get_page_buffer_meta(host_indices.cpu())
        out = []
        for ptr, size in zip(ptrs, sizes):
            offset = ptr - self.base
            if offset < 0 or offset + size > self.nbytes:
                raise ValueError(f"page piece at offset {offset} (+{size}) lies outside the host pool")
            out.append(self.memory[offset:offset + size])
        return out


class HiCacheStore(_Base):
    """SGLang's `HiCacheStorage` over a kvstore node: built as ``HiCacheStore(storage_config, kwargs)``."""

    def __init__(self, storage_config: Any = None, kwargs: dict | None = None, *,
                 client: KVClient | None = None):
        extra = dict(getattr(storage_config, "extra_config", None) or {})
        if getattr(storage_config, "should_split_heads", False):
            raise ValueError("HiCacheStore: pages split by heads across TP sizes (tp_lcm_size) are not supported")
        self.storage_config = storage_config
        self.key_prefix = str(extra.get("key_prefix", DEFAULT_KEY_PREFIX))
        self.namespace = config_namespace(storage_config)
        self.retry_s = float(extra.get("store_retry_s", DEFAULT_RETRY_S))
        if client is None:
            self.address = store_address(extra)
            timeout = float(extra.get("store_timeout_s", DEFAULT_TIMEOUT_S))
            self.store = KVClient(*self.address, password=extra.get("store_password"), timeout=timeout,
                                  retries=1, fast_path=str(extra.get("store_fast_path", "auto")))
            self._owns_client = True
        else:
            self.address = (client.endpoint.host, client.endpoint.port)
            self.store = client
            self._owns_client = False
        if storage_config is not None and getattr(storage_config, "extra_config", None) is not None:
            storage_config.extra_config.setdefault("interface_v1", 1)   # SGLang then calls the v1 methods
        self.zero_copy = bool((getattr(storage_config, "extra_config", None) or {}).get("interface_v1", 1))
        self.metrics = bool(getattr(storage_config, "enable_storage_metrics", False))
        self.mem_pool_host = None
        self._pages: _PoolPages | None = None
        self._lock = threading.Lock()
        self.health = StoreHealth(f"HiCacheStore: kvstore at {self.address[0]}:{self.address[1]}", logger,
                                  "HiCache storage misses", self.retry_s)
        self._refusals: set[tuple[str, str]] = set()
        self._counts = {"get_hits": 0, "get_misses": 0, "sets": 0, "set_failures": 0, "exists_queries": 0,
                        "prefix_hits": 0, "store_errors": 0, "skipped_while_down": 0}
        self._io: dict[str, list] = {"prefetch_pgs": [], "backup_pgs": [], "prefetch_bandwidth": [],
                                     "backup_bandwidth": []}
        logger.info("HiCacheStore: kvstore at %s:%s, keys under %r", *self.address,
                    f"{self.key_prefix}{self.namespace}:")

    @classmethod
    def over_client(cls, client: KVClient, key_prefix: str = DEFAULT_KEY_PREFIX,
                    namespace: str = "local") -> HiCacheStore:
        """The backend over an existing client, outside SGLang (tensors by key)."""
        backend = cls(None, None, client=client)
        backend.key_prefix, backend.namespace = key_prefix, namespace
        return backend

    # ------------------------------------------------------------------ keys

    def _base(self) -> str:
        return f"{self.key_prefix}{self.namespace}:"

    def _page_key(self, key: str) -> str:
        """A whole page's key on the copying path (one tensor a page)."""
        fmt = f"{self._pages.format}:" if self._pages is not None else ""
        return f"{self._base()}{fmt}{key}"

    def _piece_keys(self, keys: Sequence[str]) -> list[str]:
        pages = self._pages
        head = f"{self._base()}{pages.format}:"
        return [f"{head}{key}{suffix}" for key in keys for suffix in pages.suffixes]

    # ------------------------------------------------------- store health

    def _usable(self) -> bool:
        if self.health.usable():
            return True
        self._count("skipped_while_down")
        return False

    def _failed(self, what: str, error: BaseException) -> None:
        self._count("store_errors")
        self.health.failed(error, what)

    def _call(self, what: str, fn, *args, default: Any = None, **kwargs) -> Any:
        """fn(*args) against the store; ``default`` (nothing raised) when it is down, slow or refuses."""
        if not self._usable():
            return default
        try:
            result = fn(*args, **kwargs)
        except UNREACHABLE as e:
            self._failed(what, e)
            return default
        except (BufferTooSmall, TensorMismatch):      # a value other than the caller's buffer: theirs to judge
            self.health.answered()
            raise
        except KVError as e:                          # the store answered, with an error
            self.health.answered()
            self._count("store_errors")
            seen = (what, type(e).__name__) in self._refusals
            self._refusals.add((what, type(e).__name__))
            logger.log(logging.DEBUG if seen else logging.WARNING, "HiCacheStore: %s failed: %s", what, e)
            return default
        self.health.answered()
        return result

    # ------------------------------------------------------ zero-copy (v1)

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """The host KV pool whose pages `batch_get_v1`/`batch_set_v1` move (SGLang calls this once)."""
        self.mem_pool_host = mem_pool_host
        self._pages = _PoolPages(mem_pool_host)
        logger.info("HiCacheStore: host pool %s, layout %s, %d value(s) of %s bytes a page",
                    type(mem_pool_host).__name__, mem_pool_host.layout, self._pages.pieces,
                    "/".join(str(s) for s in sorted(set(self._pages.piece_sizes))))

    def _need_pool(self) -> _PoolPages:
        if self._pages is None:
            raise RuntimeError("HiCacheStore: batch_get_v1/batch_set_v1 before register_mem_pool_host")
        return self._pages

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        """Store pages straight from the host pool; per page, whether it is stored now (or was)."""
        if not keys:
            return []
        pages = self._need_pool()
        views = pages.views(host_indices, len(keys))
        names = self._piece_keys(keys)
        before = self._prefix_tail(extra_info)
        parents = [before, *names[:-1]]
        start = time.perf_counter()
        stored = self._call("batch_set_v1", self.store.batch_put, list(zip(names, views)), parents=parents)
        if stored is None:
            self._count("set_failures", len(keys))
            return [False] * len(keys)
        self._count("sets", len(keys))
        self._record("backup", len(keys), time.perf_counter() - start)
        return [True] * len(keys)                     # stored now, or already (put-once: same bytes)

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        """Read pages straight into the host pool; a page is True only when every piece arrived whole."""
        if not keys:
            return []
        pages = self._need_pool()
        views = pages.views(host_indices, len(keys))
        names = self._piece_keys(keys)
        start = time.perf_counter()
        try:
            lengths = self._call("batch_get_v1", self.store.batch_get_into, names, views)
        except BufferTooSmall:                        # some value is bigger than its piece: find which
            lengths = [self._call("batch_get_v1", self._get_one, n, v) for n, v in zip(names, views)]
        if lengths is None:
            lengths = [None] * len(names)
        n = pages.pieces
        hits = [all(lengths[i * n + j] == len(views[i * n + j]) for j in range(n)) for i in range(len(keys))]
        got = sum(hits)
        self._count("get_hits", got)
        self._count("get_misses", len(keys) - got)
        if got:
            self._record("prefetch", got, time.perf_counter() - start)
        return hits

    def _get_one(self, name: str, view: memoryview) -> int | None:
        try:
            return self.store.get_into(name, view)
        except BufferTooSmall:
            return None

    def _prefix_tail(self, extra_info: Any) -> str | None:
        """The last piece of the page before this batch (its parent), when SGLang says which it is."""
        prefix = getattr(extra_info, "prefix_keys", None)
        if not prefix or self._pages is None:
            return None
        return self._piece_keys([prefix[-1]])[-1]

    # ------------------------------------------------------- prefix hits

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many leading pages are stored: one KV.MATCH over their values, in order."""
        self._count("exists_queries")
        if not keys:
            return 0
        if self.zero_copy and self._pages is not None:
            matched = self._call("batch_exists", self.store.match_prefix, self._piece_keys(keys), default=0)
            hits = matched // self._pages.pieces
        else:
            hits = self._call("batch_exists", self.store.match_prefix, [self._page_key(k) for k in keys],
                              default=0)
        self._count("prefix_hits", hits)
        return hits

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # ------------------------------------------- the copying path (tensors)

    def get(self, key: str, target_location: torch.Tensor | None = None, target_sizes: Any = None
            ) -> torch.Tensor | None:
        """The page's tensor (in ``target_location`` when given), or None when it is not stored."""
        name = self._page_key(key)
        if target_location is not None:
            try:
                found = self._call("get", self.store.get_tensor_into, name, target_location, default=False)
            except TensorMismatch:                    # stored with another dtype or shape: not this page
                found = False
            value = target_location if found else None
        else:
            value = self._call("get", self.store.get_tensor, name, framework="torch")
        self._count("get_hits" if value is not None else "get_misses")
        return value

    def batch_get(self, keys: Sequence[str], target_locations: Sequence[torch.Tensor] | None = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        targets = target_locations if target_locations is not None else [None] * len(keys)
        if len(targets) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(targets)} target locations")
        return [self.get(k, t) for k, t in zip(keys, targets)]

    def set(self, key: str, value: torch.Tensor | None = None, target_location: Any = None,
            target_sizes: Any = None, parent: str | None = None) -> bool:
        """Store a page; True also when it was stored already (pages are content-addressed)."""
        if value is None:
            raise ValueError("set needs a tensor value")
        ok = self._call("set", self.store.put_tensor, self._page_key(key), value.contiguous(),
                        parent=self._page_key(parent) if parent is not None else None, default=None)
        self._count("sets" if ok is not None else "set_failures")
        return ok is not None

    def batch_set(self, keys: Sequence[str], values: Sequence[torch.Tensor] | None = None,
                  target_locations: Any = None, target_sizes: Any = None) -> bool:
        """Store consecutive pages of one prefix, each linked to the page before it."""
        if values is None or len(values) != len(keys):
            raise ValueError("batch_set needs one tensor per key")
        return all([self.set(key, value, parent=keys[i - 1] if i else None)
                    for i, (key, value) in enumerate(zip(keys, values))])

    # ------------------------------------------------------------- the rest

    def clear(self) -> None:
        """Delete this engine's keys (its namespace under the key prefix); others' stay."""
        pattern = _glob_escape(self._base()) + "*"
        cursor = 0
        while True:
            reply = self._call("clear", self.store.execute, "SCAN", cursor, "MATCH", pattern,
                               "COUNT", CLEAR_SCAN_COUNT)
            if reply is None:
                return
            cursor, keys = reply
            if keys:
                self._call("clear", self.store.delete, *keys)
            if int(cursor) == 0:
                return

    def counters(self) -> dict[str, int]:
        """This backend's own counters (no round trip)."""
        with self._lock:
            return dict(self._counts)

    def get_stats(self):
        """SGLang's `StorageMetrics` (pages and GB/s of each v1 batch since the last call), or None."""
        if not SGLANG:
            return None
        try:
            from sglang.srt.observability.metrics_collector import StorageMetrics
        except Exception:
            return None
        metrics = StorageMetrics()
        with self._lock:
            for name, values in self._io.items():
                getattr(metrics, name).extend(values)
                values.clear()
        return metrics

    def close(self) -> None:
        if self._owns_client:
            self.store.close()

    def _record(self, kind: str, pages: int, seconds: float) -> None:
        if not self.metrics or self._pages is None:
            return
        with self._lock:
            self._io[f"{kind}_pgs"].append(pages)
            self._io[f"{kind}_bandwidth"].append(pages * self._pages.page_bytes / max(seconds, 1e-9) / 1e9)

    def _count(self, name: str, by: int = 1) -> None:
        with self._lock:
            self._counts[name] += by
