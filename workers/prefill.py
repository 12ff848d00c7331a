"""The prefill engine: reuse the cached prefix, compute the rest, store each layer as it is computed.

For one request: the prompt's block keys and one `KV.MATCH` say how much of the
prompt the store holds (the connector's `get_num_new_matched_tokens`; the
conductor may allow less, when its policy chose to recompute); those layers are
read into a `DynamicCache`; the model runs over the remaining tokens only. A
forward hook on every decoder layer hands that layer's keys and values to the
connector the moment the layer finishes, and the connector's thread puts the
new full blocks' slots while the next layers compute. The engine answers with
the first generated token once the forward is done and every new block is
open in the store (its first layer in), so a decode worker that finds no block
knows it is really gone rather than not yet started; the remaining layers may
still be on their way, and the decode side waits for them.

Requests run one at a time (a CPU forward already uses every core it is given);
`queued_seconds` estimates the work waiting, for the conductor's load reports.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from client.connectors.vllm_v1 import StoreKVConnector
from workers.kvio import EngineRequest, layer_names, loaded_cache, plan_load
from workers.model import LoadedModel
from workers.timings import Timings


@dataclass
class PrefillResult:
    first_token: int
    cached_tokens: int      # prompt tokens read from the store, not computed
    stored_tokens: int      # prompt tokens whose blocks are in the store (or being written) now
    load_s: float
    compute_s: float
    last_logits: torch.Tensor


class PrefillEngine:
    def __init__(self, loaded: LoadedModel, connector: StoreKVConnector, timings: Timings | None = None):
        self.loaded = loaded
        self.connector = connector
        self.timings = timings or Timings()
        self.names = layer_names(loaded)
        self._run_lock = threading.Lock()
        self._queue_lock = threading.Lock()
        self._queued_tokens = 0
        self._saving: str | None = None         # request whose layers the hooks store
        self._saving_thread = 0                 # the thread running that forward (another may share the model)
        self._cache = None
        for index, layer in enumerate(loaded.model.model.layers):
            layer.register_forward_hook(self._layer_hook(index))

    def queued_seconds(self) -> float:
        """Seconds of prefill waiting or running, at this engine's measured speed."""
        with self._queue_lock:
            return self._queued_tokens * self.timings.prefill_s_per_token()

    @torch.inference_mode()
    def prefill(self, request_id: str, token_ids: list[int], reuse_limit: int | None = None,
                store_kv: bool = True) -> PrefillResult:
        """Prefill one prompt; ``reuse_limit`` caps the tokens taken from the store (None: all it holds)."""
        if not token_ids:
            raise ValueError("the prompt is empty")
        with self._queue_lock:
            self._queued_tokens += len(token_ids)
        try:
            with self._run_lock:
                return self._prefill(EngineRequest(request_id, list(token_ids)), reuse_limit, store_kv)
        finally:
            with self._queue_lock:
                self._queued_tokens -= len(token_ids)

    def _prefill(self, request: EngineRequest, reuse_limit: int | None, store_kv: bool) -> PrefillResult:
        connector, rid = self.connector, request.request_id
        connector.get_finished()             # drain the finished-saving record, as vLLM does every step
        started = time.perf_counter()
        hit, _ = connector.get_num_new_matched_tokens(request, 0)
        if reuse_limit is not None:
            hit = min(hit, max(0, reuse_limit))
        cache = self._load(request, hit)
        if cache is None:                      # a block vanished between MATCH and read: recompute all
            hit = 0
            cache = self._load(request, 0)
        loaded_at = time.perf_counter()
        self._cache, self._saving = cache, rid if store_kv else None
        self._saving_thread = threading.get_ident()
        try:
            ids = torch.tensor([request.prompt_token_ids[hit:]], dtype=torch.long)
            out = self.loaded.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        finally:
            self._cache, self._saving = None, None
        computed_at = time.perf_counter()
        if store_kv:
            connector.wait_for_blocks_opened(rid)
        connector.clear_connector_metadata()
        connector.release_load(rid)
        logits = out.logits[0, -1]
        n = len(request.prompt_token_ids)
        stored = (n // self.connector.hasher.block_tokens) * self.connector.hasher.block_tokens
        self.timings.record_prefill(n - hit, hit, computed_at - started)
        if hit:
            self.timings.record_transfer(hit, loaded_at - started)
        return PrefillResult(int(torch.argmax(logits)), hit, stored if store_kv else hit,
                             loaded_at - started, computed_at - loaded_at, logits)

    def _load(self, request: EngineRequest, tokens: int):
        plan_load(self.connector, request, tokens)
        if not tokens:
            return DynamicCache(config=self.loaded.model.config)
        self.connector.start_load_kv()
        cache = loaded_cache(self.connector, self.loaded, request.request_id)
        if cache is None:
            self.connector.clear_connector_metadata()
            self.connector.release_load(request.request_id)
        return cache

    def _layer_hook(self, index: int):
        def after_layer(module, args, output) -> None:
            if self._saving is None or threading.get_ident() != self._saving_thread:
                return
            layer = self._cache.layers[index]
            self.connector.save_kv_layer(self.names[index], (layer.keys, layer.values), request_id=self._saving)
        return after_layer
