"""Moving a model's KV between its transformers cache and the store, through the vLLM-shaped connector.

Both workers drive `StoreKVConnector` the way vLLM would: the prefill plans a
request with the scheduler-side calls and saves layers from forward hooks; the
decode plans a load of the blocks the prefill says it stored. This module holds
what they share: the connector for a loaded model, the layer names, a request
record, and rebuilding a `DynamicCache` from a finished load.
"""
from __future__ import annotations

from dataclasses import dataclass

from transformers import DynamicCache

from client import BlockHasher
from client.connectors.vllm_v1 import KVLayout, StoreKVConnector
from conductor.stores import Store
from workers.model import LoadedModel


@dataclass
class EngineRequest:
    """What a connector reads from a request (vLLM's `Request` has the same attributes)."""

    request_id: str
    prompt_token_ids: list[int]
    num_computed_tokens: int = 0


def layer_names(loaded: LoadedModel) -> list[str]:
    return [f"model.layers.{i}.self_attn" for i in range(loaded.n_layers)]


def make_connector(store: Store, loaded: LoadedModel, block_tokens: int) -> StoreKVConnector:
    """A connector whose block keys and layer slots fit this model (fp32, its KV heads and head dim)."""
    layout = KVLayout(loaded.n_layers, loaded.kv_heads, loaded.head_dim, block_tokens)
    connector = StoreKVConnector(store, BlockHasher(loaded.namespace, block_tokens), layout)
    connector.register_kv_caches({name: None for name in layer_names(loaded)})
    return connector


def plan_load(connector: StoreKVConnector, request: EngineRequest, tokens: int) -> None:
    """Bind a plan that reads the prompt's first ``tokens`` tokens and saves the full blocks after them."""
    connector.update_state_after_alloc(request, None, tokens)
    connector.bind_connector_metadata(connector.build_connector_meta())


def loaded_cache(connector: StoreKVConnector, loaded: LoadedModel, request_id: str) -> DynamicCache | None:
    """A cache holding the request's loaded prefix, layer by layer as each arrives; None when a block was
    gone from the store (the caller recomputes instead of running on a hole)."""
    cache = DynamicCache(config=loaded.model.config)
    for index, name in enumerate(layer_names(loaded)):
        connector.wait_for_layer_load(name)
        kv = connector.loaded_layer(request_id, name)
        if kv is None:
            return None
        layer = cache.layers[index]
        layer.lazy_initialization(*kv)
        layer.keys, layer.values = kv          # adopted as they are: `update` would copy them once more
    return cache
