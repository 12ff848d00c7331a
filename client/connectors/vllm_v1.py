"""The store as a vLLM KV connector (v1 shape): prefix hits, layer-wise loads and saves.

vLLM splits a connector in two halves that live in different processes:

- the scheduler side answers "how many of this prompt's tokens can the store
  supply?" (`get_num_new_matched_tokens`: the prompt's block keys, one
  `KV.MATCH`; when every token hits it reports one less, as LMCache does,
  because the engine must compute at least one token to get logits), learns
  what was allocated (`update_state_after_alloc`) and packs the plan for the
  next step into metadata (`build_connector_meta`);
- the worker side, given that metadata, starts reading the cached prefix
  (`start_load_kv`, on a background thread, all layers of all blocks in
  one read), lets each attention layer wait for its own data
  (`wait_for_layer_load`), and saves each layer of each new full block as soon
  as the layer has run (`save_kv_layer` queues the puts; a background thread
  sends them, so storing overlaps the next layers' compute); `wait_for_save`
  says when the puts are done, and `get_finished` names the finished requests
  whose free `request_finished` deferred while their puts were in flight.

A block is stored as one value of `n_layers` equal slots (`put_layer`), each
slot the layer's keys and values for the block's tokens, shaped
`(2, kv_heads, block_tokens, head_dim)`. A reader sees a block only once every
layer is in, or waits for the rest (`get_layers(..., wait=)`).

KV layout. This class speaks the transformers layout: a `DynamicCache` holds
each layer as one contiguous `(batch, heads, tokens, head_dim)` tensor;
`save_kv_layer` takes the layer's `(keys, values)` for the request, and a
finished load is handed back by `loaded_layer` as `(keys, values)` to place in
the cache. The project's prefill and decode workers move KV through it.

vLLM's own paged layout is `vllm_paged.VllmStoreConnector` (a subclass of vLLM
0.34's `KVConnectorBase_V1`, built by vLLM's factory), exported here when vLLM
is importable, so vLLM loads it with
`kv_connector_module_path="client.connectors.vllm_v1"` and
`kv_connector="VllmStoreConnector"`. Both put and read blocks through the same
pieces (`vllm_store_io`: the saver thread, block reads, the store's health).
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

from client import BlockHasher, KVClient
from client.connectors.read_buffers import ReadBuffers
from client.connectors.vllm_store_io import (LOAD_WAIT_S, BlockSaver, SaveJob, StoreHealth, matched_tokens,
                                             read_blocks)

log = logging.getLogger(__name__)

SCHEDULER, WORKER = "scheduler", "worker"
SPARE_READ_BUFFERS, SPARE_READ_BYTES = 4, 512 << 20     # load buffers kept for the next loads


@dataclass(frozen=True)
class KVLayout:
    """What one block's layer slot holds: keys and values of `block_tokens` tokens, fp32 or other."""

    n_layers: int
    kv_heads: int
    head_dim: int
    block_tokens: int
    dtype: torch.dtype = torch.float32

    @property
    def slot_shape(self) -> tuple[int, ...]:
        return (2, self.kv_heads, self.block_tokens, self.head_dim)

    def numpy_dtype(self) -> np.dtype:
        return torch.empty(0, dtype=self.dtype).numpy().dtype


@dataclass
class RequestTransfer:
    """One request's plan: its block keys, the tokens to load, the blocks to save."""

    request_id: str
    keys: list[str]
    load_start: int = 0          # tokens [load_start, load_stop) come from the store
    load_stop: int = 0
    save_from_block: int = 0     # blocks before it are cached (or loaded) already


@dataclass
class StoreConnectorMetadata:
    """What the scheduler side hands the worker side for one step."""

    requests: list[RequestTransfer] = field(default_factory=list)


class _Load:
    """A request's prefix being read: one buffer for all its blocks and layers."""

    def __init__(self, layout: KVLayout, transfer: RequestTransfer, buffers: ReadBuffers):
        self.transfer = transfer
        first, last = transfer.load_start // layout.block_tokens, -(-transfer.load_stop // layout.block_tokens)
        self.blocks = range(first, last)
        self.buffer = buffers.take((len(self.blocks), layout.n_layers, *layout.slot_shape), layout.numpy_dtype())
        self.done = threading.Event()
        self.missing_blocks = 0      # blocks gone from the store (evicted, node lost, store away) when read


class StoreKVConnector:
    """vLLM's KV connector v1 methods over a `KVClient`, for a transformers-layout model."""

    def __init__(self, store: KVClient, hasher: BlockHasher, layout: KVLayout, role: str = WORKER):
        self.store = store
        self.hasher = hasher
        self.layout = layout
        self.role = role
        self.health = StoreHealth(repr(store))
        self._planned: dict[str, RequestTransfer] = {}
        self._layer_index: dict[str, int] = {}
        self._meta = StoreConnectorMetadata()
        self._loads: dict[str, _Load] = {}
        self._lock = threading.Lock()
        self._deferred: set[str] = set()             # finished requests whose pages wait for their saves
        self._finished_saving: set[str] = set()
        self._saver = BlockSaver(store, self.health, on_request_done=self._saves_done)
        self._read_buffers = ReadBuffers(SPARE_READ_BUFFERS, SPARE_READ_BYTES)

    # ------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """Prompt tokens beyond ``num_computed_tokens`` the store can supply (one KV.MATCH), and False:
        the load completes within the step (no asynchronous load). Changes no state; a store that does
        not answer supplies nothing."""
        prompt = list(request.prompt_token_ids)
        hit = matched_tokens(self.store, self.health, self.hasher.keys(prompt), self.hasher.block_tokens)
        if hit >= len(prompt):
            hit = len(prompt) - 1
        return max(0, hit - num_computed_tokens), False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Record the load the scheduler accepted: tokens after the locally computed ones."""
        transfer = RequestTransfer(request.request_id, self.hasher.keys(list(request.prompt_token_ids)))
        computed = getattr(request, "num_computed_tokens", 0)
        transfer.load_start, transfer.load_stop = computed, computed + num_external_tokens
        transfer.save_from_block = transfer.load_stop // self.hasher.block_tokens
        self._planned[request.request_id] = transfer

    def build_connector_meta(self, scheduler_output: Any = None) -> StoreConnectorMetadata:
        """The plans of the requests scheduled since the last call."""
        meta = StoreConnectorMetadata(list(self._planned.values()))
        self._planned.clear()
        return meta

    def request_finished(self, request: Any, block_ids: Any = None) -> tuple[bool, dict | None]:
        """True while the request's saves are still in flight: its pages wait for them, and
        `get_finished` names it once they are done."""
        with self._lock:
            if self._saver.saving(request.request_id):
                self._deferred.add(request.request_id)
                return True, None
        return False, None

    # ------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """Learn the attention layers' names, in model order (the store's slot index)."""
        if len(kv_caches) != self.layout.n_layers:
            raise ValueError(f"{len(kv_caches)} KV caches for a layout of {self.layout.n_layers} layers")
        self._layer_index = {name: i for i, name in enumerate(kv_caches)}

    def bind_connector_metadata(self, metadata: StoreConnectorMetadata) -> None:
        self._meta = metadata

    def clear_connector_metadata(self) -> None:
        self._meta = StoreConnectorMetadata()

    def start_load_kv(self, forward_context: Any = None, **kwargs: Any) -> None:
        """Start reading every bound request's cached prefix on a background thread."""
        for transfer in self._meta.requests:
            if transfer.load_stop > transfer.load_start:
                load = _Load(self.layout, transfer, self._read_buffers)
                self._loads[transfer.request_id] = load
                threading.Thread(target=self._read, args=(load,), name="kv-loader", daemon=True).start()

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until ``layer_name``'s prefix KV of every bound request is here."""
        self._index(layer_name)
        for transfer in self._meta.requests:
            load = self._loads.get(transfer.request_id)
            if load is not None:
                load.done.wait()

    def loaded_layer(self, request_id: str, layer_name: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The loaded prefix of one layer as ``(keys, values)``, each ``(1, heads, tokens, head_dim)``;
        None when the request loads nothing or a block was gone (the caller recomputes)."""
        load = self._loads.get(request_id)
        if load is None or load.missing_blocks:
            return None
        layer = torch.from_numpy(load.buffer[:, self._index(layer_name)])       # (blocks, 2, h, bt, d)
        offset = load.transfer.load_start - load.blocks.start * self.layout.block_tokens
        tokens = slice(offset, offset + load.transfer.load_stop - load.transfer.load_start)

        def side(i: int) -> torch.Tensor:       # one copy, out of the buffer: blocks side by side along tokens
            blocks = layer[:, i].permute(1, 0, 2, 3)                            # (h, blocks, bt, d)
            joined = torch.empty(blocks.shape, dtype=blocks.dtype).copy_(blocks)
            return joined.reshape(1, self.layout.kv_heads, -1, self.layout.head_dim)[:, :, tokens]
        return side(0), side(1)

    def load_complete(self, request_id: str) -> bool:
        """Whether the request's whole planned prefix was read (False: a block had disappeared)."""
        load = self._loads.get(request_id)
        return load is not None and load.done.is_set() and not load.missing_blocks

    def release_load(self, request_id: str) -> None:
        """Forget a load whose layers were taken; its buffer serves a later load once no read is left."""
        load = self._loads.pop(request_id, None)
        if load is not None and load.done.is_set():
            self._read_buffers.give_back(load.buffer)

    def save_kv_layer(self, layer_name: str, kv_layer: tuple[torch.Tensor, torch.Tensor], attn_metadata: Any = None,
                      request_id: str | None = None, **kwargs: Any) -> None:
        """Queue the puts of this layer's new full blocks; returns at once (a thread sends them)."""
        transfer = self._saving_request(request_id)
        keys, values = kv_layer
        full_blocks = min(len(transfer.keys), keys.shape[-2] // self.layout.block_tokens)
        blocks = range(transfer.save_from_block, full_blocks)
        if not blocks:
            return
        bt = self.layout.block_tokens

        def slot(i: int) -> np.ndarray:         # built on the saver's thread: the forward goes on
            b = blocks[i]
            return torch.stack([keys[0, :, b * bt:(b + 1) * bt], values[0, :, b * bt:(b + 1) * bt]]).numpy()
        parents = [transfer.keys[b - 1] if b else None for b in blocks]
        self._saver.submit(SaveJob(transfer.request_id, self._index(layer_name), self.layout.n_layers,
                                   transfer.keys[blocks.start:blocks.stop], parents, slot))

    def wait_for_blocks_opened(self, request_id: str, timeout: float | None = None) -> bool:
        """Block until every new block of the request exists in the store (its first layer is in),
        so a reader that finds nothing knows the block is really absent."""
        return self._saver.wait_opened(request_id, timeout)

    def wait_for_save(self) -> None:
        """Block until every queued put has been answered."""
        self._saver.wait_idle()

    def get_finished(self, finished_req_ids: Sequence[str] = ()) -> tuple[set[str], set[str]]:
        """(requests deferred by `request_finished` whose saves completed since the last call, and
        requests whose asynchronous loads completed: none, loads finish within the step)."""
        with self._lock:
            done, self._finished_saving = self._finished_saving, set()
        return done, set()

    # ------------------------------------------------------------ internals

    def _index(self, layer_name: str) -> int:
        try:
            return self._layer_index[layer_name]
        except KeyError:
            raise KeyError(f"unknown layer '{layer_name}' (register_kv_caches names the layers)") from None

    def _saving_request(self, request_id: str | None) -> RequestTransfer:
        requests = self._meta.requests
        if request_id is not None:
            for t in requests:
                if t.request_id == request_id:
                    return t
            raise KeyError(f"request '{request_id}' is not in the bound metadata")
        if len(requests) != 1:
            raise ValueError("save_kv_layer needs request_id when the step holds several requests")
        return requests[0]

    def _read(self, load: _Load) -> None:
        keys = [load.transfer.keys[b] for b in load.blocks]
        try:
            got = read_blocks(self.store, self.health, keys, self.layout.n_layers, load.buffer, LOAD_WAIT_S)
            load.missing_blocks = len(keys) - got
        finally:
            load.done.set()

    def _saves_done(self, request_id: str) -> None:
        with self._lock:
            if request_id in self._deferred:
                self._deferred.discard(request_id)
                self._finished_saving.add(request_id)


def _vllm_base() -> type | None:
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
    except ImportError:
        return None
    return KVConnectorBase_V1


if _vllm_base() is not None:
    from client.connectors.vllm_paged import PagedStoreMetadata, VllmStoreConnector  # noqa: E402,F401
