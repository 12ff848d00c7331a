"""The store as vLLM 0.34's KV connector (`KVConnectorBase_V1`) over vLLM's own paged KV cache.

vLLM builds it with its factory, ``cls(vllm_config, role, kv_cache_config)``, once in the scheduler
process (role SCHEDULER) and once in every worker (role WORKER), from

    --kv-transfer-config '{"kv_connector": "VllmStoreConnector",
                           "kv_connector_module_path": "client.connectors.vllm_v1",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"store_host": "127.0.0.1", "store_port": 6380}}'

Extra config keys: ``store_host`` (default 127.0.0.1) and ``store_port``, or ``store_unix_socket``;
``store_password``, ``store_timeout_s`` (default 2), ``namespace`` (default: the model name). A
missing or malformed address is an error at start-up that names the key.

vLLM's layout. Each attention layer's cache is a 4D view ``[B, H, N, C]`` (blocks, KV heads, tokens
of a block, content: for the CPU backend ``2 * head_size``, keys then values) over one allocation
whose stride order is the resolved `KVCacheLayout` (``LBHNC`` on CPU). A vLLM block id names the same
block in every layer. One vLLM block is one store block: the same `block_size` tokens, the key of its
token prefix (`BlockHasher`, whose namespace binds the model, the layout, the page shape, the cache
dtype and the tensor-parallel size), one value of ``n_layers`` slots, slot l the bytes of
``cache[l][block_id]`` as they are (no conversion: a reader of the same layout copies them straight
back into its own page). The tensor header stored with the block names dtype and shape, so a reader
of another layout gets a mismatch, never reinterpreted bytes.

Scheduler side: `get_num_new_matched_tokens` asks the store how many leading blocks it holds (one
`KV.MATCH`, no state kept: vLLM may ask again), one token less when the whole prompt hits (the engine
computes at least one token). `update_state_after_alloc` notes the tokens vLLM agreed to load;
`build_connector_meta` turns the scheduler output into the step's plan: for each request, the block
ids and keys to load, and the blocks that become full during the step, to save.

Worker side: `start_load_kv` reads the planned blocks on a thread (all layers of all blocks in one batch)
and copies each layer into the request's allocated pages; `wait_for_layer_load` (called by vLLM's
attention hook) waits for that layer. A block gone, unfinished or mismatched when read ends the load
there: its block ids and those after it are reported by `get_block_ids_with_load_errors`, vLLM
recomputes them (with ``kv_load_failure_policy: recompute``) and its pages are never written from
the store. `save_kv_layer` (called after each attention layer with that layer's paged tensor) copies
the new full blocks' pages of the layer into a host buffer, and a thread puts them, so the pages are
free again when the call returns: `request_finished` never defers a free and `get_finished` reports
nothing.

A store that is down, slow or full never stops the engine: one log line, lookups find nothing, loads
fail over to recompute, saves are dropped; the store is used again once it answers.
"""
from __future__ import annotations

import logging
import re
import threading
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                               KVConnectorRole)

from client import BlockHasher, KVClient, Namespace
from client.connectors.read_buffers import ReadBuffers
from client.connectors.vllm_store_io import (LOAD_WAIT_S, BlockSaver, SaveJob, StoreHealth, matched_tokens,
                                             read_blocks)

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 2.0
SPARE_BUFFERS, SPARE_BYTES = 16, 512 << 20      # host buffers kept for the next loads and saves


@dataclass
class StoreAddress:
    host: str = "127.0.0.1"
    port: int | None = None
    unix_socket: str | None = None
    password: str | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S

    def client(self) -> KVClient:
        return KVClient(self.host, self.port or 0, unix_socket=self.unix_socket, password=self.password,
                        timeout=self.timeout_s, retries=0)

    def __str__(self) -> str:
        return self.unix_socket or f"{self.host}:{self.port}"


def store_address(extra: dict[str, Any]) -> StoreAddress:
    """The store's address from ``kv_connector_extra_config``; ValueError naming the key that is wrong."""
    def bad(key: str, want: str) -> ValueError:
        return ValueError(f"kv_connector_extra_config[{key!r}] must be {want}, got {extra.get(key)!r}")

    address = StoreAddress()
    socket_path = extra.get("store_unix_socket")
    if socket_path is not None:
        if not isinstance(socket_path, str) or not socket_path:
            raise bad("store_unix_socket", "a socket path")
        address.unix_socket = socket_path
    host = extra.get("store_host", address.host)
    if not isinstance(host, str) or not host.strip():
        raise bad("store_host", "a host name or address")
    address.host = host.strip()
    port = extra.get("store_port")
    if port is None and socket_path is None:
        raise ValueError("kv_connector_extra_config needs 'store_port' (with 'store_host') or "
                         "'store_unix_socket': the KV store's address")
    if port is not None:
        try:
            address.port = int(str(port).strip())
        except ValueError:
            raise bad("store_port", "a port number (1-65535)") from None
        if not 0 < address.port < 65536:
            raise bad("store_port", "a port number (1-65535)")
    password = extra.get("store_password")
    if password is not None and not isinstance(password, str):
        raise bad("store_password", "a string")
    address.password = password
    try:
        address.timeout_s = float(extra.get("store_timeout_s", DEFAULT_TIMEOUT_S))
    except (TypeError, ValueError):
        raise bad("store_timeout_s", "a number of seconds") from None
    if not address.timeout_s > 0:
        raise bad("store_timeout_s", "a positive number of seconds")
    return address


@dataclass
class BlockTransfer:
    """Blocks of one request to load or save: vLLM block ids and their store keys, in prompt order."""

    request_id: str
    block_ids: list[int]
    keys: list[str]
    parent: str | None = None            # the key before the first block (saves chain to it)


@dataclass
class PagedStoreMetadata(KVConnectorMetadata):
    """One step's plan, from the scheduler-side connector to the worker-side ones."""

    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)


@dataclass
class _Tracked:
    """Scheduler side: a running request's keys, its block ids so far, and the blocks already handled."""

    keys: list[str]
    block_ids: list[int]
    saved_blocks: int                    # blocks before it are cached, loaded or already saved


class _PagedLoad:
    """One step's loads: read on a thread, each layer copied into the pages, one event per layer."""

    def __init__(self, n_layers: int):
        self.layer_ready = [threading.Event() for _ in range(n_layers)]
        self.failed_block_ids: set[int] = set()
        self.thread: threading.Thread | None = None

    def wait(self, layer: int) -> None:
        self.layer_ready[layer].wait()

    def join(self) -> None:
        if self.thread is not None:
            self.thread.join()


class _Staging:
    """One save's pages of every layer, ``[layers, blocks, *page]`` in a host buffer; given back once the
    step and every put queued from it let go."""

    def __init__(self, buffer: Any, dtype: torch.dtype, buffers: ReadBuffers):
        self.buffer, self.buffers = buffer, buffers
        self.host = _as_torch(buffer, dtype)
        self.staged = 0
        self._holders = 1                    # the step itself, until every layer is staged
        self._lock = threading.Lock()

    def layer(self, layer: int) -> torch.Tensor:
        self.staged += 1
        return self.host[layer]

    def hold(self) -> None:
        with self._lock:
            self._holders += 1

    def release(self) -> None:
        with self._lock:
            self._holders -= 1
            last = self._holders == 0
        if last:
            self.buffers.give_back(self.buffer)


def layer_order(names: list[str]) -> list[str]:
    """Attention layer names in model order (the store's slot index), the same in every process."""
    def index(name: str) -> tuple[int, str]:
        numbers = re.findall(r"\.(\d+)\.", f".{name}.")
        return (int(numbers[0]) if numbers else -1, name)
    return sorted(names, key=index)


class VllmStoreConnector(KVConnectorBase_V1):
    """The store behind vLLM's KV connector interface, on vLLM's paged KV cache."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self.address = store_address(extra)
        cache = vllm_config.cache_config
        self.block_size = int(cache.block_size)
        if "block_tokens" in extra and int(extra["block_tokens"]) != self.block_size:
            raise ValueError(f"kv_connector_extra_config['block_tokens'] must equal vLLM's block_size "
                             f"({self.block_size}): one store block is one vLLM block")
        parallel = vllm_config.parallel_config
        model = vllm_config.model_config
        self.tp_rank = _tp_rank() if role == KVConnectorRole.WORKER else 0
        self.namespace = Namespace(
            model=str(extra.get("namespace") or model.model),
            dtype=f"{cache.cache_dtype}:{model.dtype}".replace("torch.", ""),
            tp_size=parallel.tensor_parallel_size,
            salt=f"vllm-paged:{cache.kv_cache_layout or 'unresolved'}:"
                 f"{model.get_num_kv_heads(parallel)}x{model.get_head_size()}:{self.block_size}")
        self.store = self.address.client()
        self.health = StoreHealth(str(self.address))
        self._hashers: dict[str, BlockHasher] = {}
        # scheduler side
        self._external: dict[str, tuple[int, list[str]]] = {}   # request -> (tokens to load, its keys)
        self._tracked: dict[str, _Tracked] = {}
        # worker side
        self._caches: dict[str, torch.Tensor] = {}
        self._layer_index: dict[str, int] = {}
        self._blocks_per_page = 1                      # kernel blocks per vLLM block
        self._load: _PagedLoad | None = None
        self._load_errors: set[int] = set()
        self._buffers = ReadBuffers(SPARE_BUFFERS, SPARE_BYTES)
        self._saver: BlockSaver | None = None
        self._staging: dict[int, tuple[BlockTransfer, _Staging]] = {}   # this step's saves
        log.info("KV store connector (%s) on %s, namespace %s", role.name.lower(), self.address, self.namespace)

    @property
    def requires_kv_delivery(self) -> bool:
        return False          # a cache: a dropped save is a later miss, never a lost hand-off

    # ------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` the store holds (whole blocks, one KV.MATCH; one token less
        when the whole request hits), and False: they load within the step. Never None (the answer is
        known at once); 0 when the store does not answer. Keeps no state."""
        keys = self._keys(request)
        hit = matched_tokens(self.store, self.health, keys, self.block_size)
        total = getattr(request, "num_tokens", None) or len(request.prompt_token_ids)
        if hit >= total:
            hit = total - 1
        return max(0, hit - num_computed_tokens), False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Note what vLLM agreed to load for a request it scheduled (and its keys, salt included)."""
        self._external[request.request_id] = (num_external_tokens, self._keys(request))

    def build_connector_meta(self, scheduler_output: Any) -> PagedStoreMetadata:
        meta = PagedStoreMetadata()
        for req_id in scheduler_output.finished_req_ids or ():
            self._tracked.pop(req_id, None)
        for req_id in getattr(scheduler_output, "preempted_req_ids", None) or ():
            self._tracked.pop(req_id, None)
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            external, keys = self._external.pop(new.req_id, (0, None))
            if new.prompt_token_ids is None:             # prompt embeddings: no token ids to key
                continue
            if keys is None:
                keys = self._hasher(None).keys(new.prompt_token_ids)
            tracked = _Tracked(keys, list(new.block_ids[0]), new.num_computed_tokens // self.block_size)
            if external:
                first = (new.num_computed_tokens - external) // self.block_size
                last = min(len(keys), -(-new.num_computed_tokens // self.block_size))
                meta.loads.append(BlockTransfer(new.req_id, tracked.block_ids[first:last], keys[first:last]))
                tracked.saved_blocks = last
            self._tracked[new.req_id] = tracked
            self._plan_save(meta, new.req_id, new.num_computed_tokens + scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            if cached.new_block_ids[i] is not None:
                tracked.block_ids.extend(cached.new_block_ids[i][0])
            self._plan_save(meta, req_id, cached.num_computed_tokens[i] + scheduled.get(req_id, 0))
        self._external.clear()
        return meta

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """False: saves copy the pages out when they are queued, so the blocks may be freed now."""
        self._tracked.pop(request.request_id, None)
        self._external.pop(request.request_id, None)
        return False, None

    def _plan_save(self, meta: PagedStoreMetadata, req_id: str, computed_after_step: int) -> None:
        tracked = self._tracked[req_id]
        full = min(len(tracked.keys), computed_after_step // self.block_size, len(tracked.block_ids))
        if full > tracked.saved_blocks:
            first = tracked.saved_blocks
            meta.saves.append(BlockTransfer(req_id, tracked.block_ids[first:full], tracked.keys[first:full],
                                            tracked.keys[first - 1] if first else None))
            tracked.saved_blocks = full

    def _keys(self, request: Any) -> list[str]:
        tokens = request.prompt_token_ids
        if tokens is None:
            return []
        return self._hasher(getattr(request, "cache_salt", None)).keys(tokens)

    def _hasher(self, salt: str | None) -> BlockHasher:
        salt = salt or ""
        hasher = self._hashers.get(salt)
        if hasher is None:
            ns = self.namespace if not salt else Namespace(self.namespace.model, self.namespace.dtype, 0,
                                                           self.namespace.tp_size, f"{self.namespace.salt}:{salt}")
            hasher = self._hashers[salt] = BlockHasher(ns, self.block_size)
        return hasher

    # ------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Keep vLLM's per-layer paged tensors (``[B, H, N, C]`` views), ordered by layer index."""
        names = layer_order(list(kv_caches))
        self._caches = {name: kv_caches[name] for name in names}
        self._layer_index = {name: i for i, name in enumerate(names)}
        first = self._caches[names[0]]
        manager_blocks = getattr(self._kv_cache_config, "num_blocks", None)
        if manager_blocks and first.shape[0] % manager_blocks == 0:
            self._blocks_per_page = first.shape[0] // manager_blocks
        for name in names:
            if self._caches[name].shape != first.shape or self._caches[name].dtype != first.dtype:
                raise ValueError(f"layer {name} has a {tuple(self._caches[name].shape)} {self._caches[name].dtype}"
                                 f" cache, layer {names[0]} {tuple(first.shape)} {first.dtype}: the store "
                                 "needs equal slots")
        self._saver = BlockSaver(self.store, self.health)

    @property
    def n_layers(self) -> int:
        return len(self._caches)

    def _pages(self, cache: torch.Tensor) -> torch.Tensor:
        """A layer's cache as ``[vLLM blocks, kernel blocks per vLLM block, H, N, C]`` (a view)."""
        return cache.unflatten(0, (-1, self._blocks_per_page))

    def _gather(self, cache: torch.Tensor, block_ids: list[int], host: torch.Tensor) -> None:
        """Copy the pages of ``block_ids`` of one layer into ``host`` (contiguous), with one copy."""
        ids = torch.tensor(block_ids, dtype=torch.long, device=cache.device)
        if cache.device == host.device:
            torch.index_select(self._pages(cache), 0, ids, out=host)
        else:                                # a device cache: gathered there, then one copy to host
            host.copy_(self._pages(cache).index_select(0, ids))

    def _scatter(self, cache: torch.Tensor, block_ids: list[int], host: torch.Tensor) -> None:
        """Copy ``host[i]`` (one layer's page of block i, a strided view of the read buffer) into page
        ``block_ids[i]`` of one layer, with one copy."""
        ids = torch.tensor(block_ids, dtype=torch.long, device=cache.device)
        self._pages(cache).index_copy_(0, ids, host.to(cache.device, non_blocking=True))

    def _page_shape(self) -> tuple[int, ...]:
        first = next(iter(self._caches.values()))
        return (self._blocks_per_page, *first.shape[1:])

    def _key(self, key: str) -> str:
        return key if self.tp_rank == 0 else f"tp{self.tp_rank}.{key}"

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Start reading this step's planned blocks; each layer lands in its pages before its event."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, PagedStoreMetadata)
        if not meta.loads or not self._caches:
            return
        load = self._load = _PagedLoad(self.n_layers)
        load.thread = threading.Thread(target=self._read, args=(load, list(meta.loads)), name="kv-loader",
                                       daemon=True)
        load.thread.start()

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._load is not None:
            self._load.wait(self._layer_index[layer_name])

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """Copy this layer's pages of the step's newly full blocks to host memory and queue their puts."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, PagedStoreMetadata)
        if not meta.saves or self._saver is None:
            return
        layer = self._layer_index[layer_name]
        for save in meta.saves:
            staging = self._staging_of(save, kv_layer.dtype)
            host = staging.layer(layer)
            self._gather(kv_layer, save.block_ids, host)
            keys = [self._key(k) for k in save.keys]
            parents = [self._key(save.parent) if save.parent else None] + keys[:-1]
            staging.hold()
            self._saver.submit(SaveJob(save.request_id, layer, self.n_layers, keys, parents,
                                       slot=lambda i, host=host: host[i], nbytes=host.nbytes,
                                       release=staging.release))
            if staging.staged == self.n_layers:          # every layer is staged: the step lets go
                self._staging.pop(id(save), None)
                staging.release()

    def _staging_of(self, save: BlockTransfer, dtype: torch.dtype) -> _Staging:
        """The host buffer that a save's pages are staged in, every layer of the step in one buffer
        (kept for the next steps by `ReadBuffers`: fresh memory would be paged in at each copy)."""
        entry = self._staging.get(id(save))
        if entry is None or entry[0] is not save:
            buffer = self._buffers.take((self.n_layers, len(save.block_ids), *self._page_shape()),
                                        _numpy_dtype(dtype))
            entry = self._staging[id(save)] = (save, _Staging(buffer, dtype, self._buffers))
        return entry[1]

    def clear_connector_metadata(self) -> None:
        """The step is over: staging buffers of layers vLLM did not save go back once their puts are done."""
        super().clear_connector_metadata()
        stagings, self._staging = self._staging, {}
        for _, staging in stagings.values():
            staging.release()

    def wait_for_save(self) -> None:
        """The step's loads are finished (their errors known); puts go on in the background."""
        load, self._load = self._load, None
        if load is not None:
            load.join()
            self._load_errors |= load.failed_block_ids

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        if self._saver is not None:
            self._saver.close()
        self.store.close()

    def _read(self, load: _PagedLoad, transfers: list[BlockTransfer]) -> None:
        try:
            shape, dtype = self._page_shape(), next(iter(self._caches.values())).dtype
            reads = []
            for t in transfers:
                buffer = self._buffers.take((len(t.keys), self.n_layers, *shape), _numpy_dtype(dtype))
                got = read_blocks(self.store, self.health, [self._key(k) for k in t.keys], self.n_layers,
                                  _as_torch(buffer, dtype), LOAD_WAIT_S)
                load.failed_block_ids.update(t.block_ids[got:])
                reads.append((t, buffer, got))
            for name, layer in self._layer_index.items():
                cache = self._caches[name]
                for t, buffer, got in reads:
                    if got:
                        self._scatter(cache, t.block_ids[:got], _as_torch(buffer, dtype)[:got, layer])
                load.layer_ready[layer].set()
            for _, buffer, _ in reads:
                self._buffers.give_back(buffer)
        except Exception:                    # noqa: BLE001 - a failed load is a recompute, not a crash
            log.exception("loading KV blocks from the store failed: recomputing them")
            for t in transfers:
                load.failed_block_ids.update(t.block_ids)
        finally:
            for event in load.layer_ready:
                event.set()


def _tp_rank() -> int:
    """This worker's tensor-parallel rank (0 outside an initialised vLLM worker)."""
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
        return get_tensor_model_parallel_rank()
    except Exception:                        # noqa: BLE001 - no parallel group: a single worker
        return 0


def _numpy_dtype(dtype: torch.dtype) -> Any:
    """The host buffer's numpy dtype: the cache's own, or raw 16-bit words for bfloat16 (numpy has none)."""
    import numpy as np
    if dtype == torch.bfloat16:
        return np.dtype(np.uint16)
    return torch.empty(0, dtype=dtype).numpy().dtype


def _as_torch(array: Any, dtype: torch.dtype) -> torch.Tensor:
    tensor = torch.from_numpy(array)
    return tensor.view(dtype) if tensor.dtype != dtype else tensor
