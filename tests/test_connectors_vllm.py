"""The vLLM KV connector v1 shape against a real `kvstore serve`: the scheduler side's prefix answer
(one KV.MATCH, one token less on a full hit), layer-wise saves and loads, and the bookkeeping calls.
The workers' tests drive the same class with a real LLaMA end to end."""
from __future__ import annotations

import importlib.util
import threading

import numpy as np
import pytest
import torch

from client import BlockHasher, KVClient
from client.connectors.vllm_v1 import KVLayout, StoreKVConnector
from workers.kvio import EngineRequest

LAYOUT = KVLayout(n_layers=3, kv_heads=2, head_dim=4, block_tokens=8)
NAMES = [f"layer.{i}" for i in range(LAYOUT.n_layers)]


@pytest.fixture(scope="module")
def store(kvstore_module_factory):
    return kvstore_module_factory()


@pytest.fixture
def connector(store, request):
    kv = KVClient(unix_socket=store.unix_socket)
    c = StoreKVConnector(kv, BlockHasher(f"vllm-test-{request.node.name}", LAYOUT.block_tokens), LAYOUT)
    c.register_kv_caches({name: None for name in NAMES})
    yield c
    kv.close()


def layer_kv(tokens: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    base = torch.arange(tokens * LAYOUT.kv_heads * LAYOUT.head_dim, dtype=torch.float32)
    keys = (base + 1000 * layer).reshape(1, LAYOUT.kv_heads, tokens, LAYOUT.head_dim)
    return keys, -keys


def save_prompt(c: StoreKVConnector, request: EngineRequest, shift: int = 0) -> None:
    """Save the prompt's blocks, layer l holding ``layer_kv(tokens, l + shift)``."""
    hit, _ = c.get_num_new_matched_tokens(request, 0)
    c.update_state_after_alloc(request, None, hit)
    c.bind_connector_metadata(c.build_connector_meta(None))
    for layer, name in enumerate(NAMES):
        c.save_kv_layer(name, layer_kv(len(request.prompt_token_ids), layer + shift), None)
    c.wait_for_save()
    c.clear_connector_metadata()


def test_matched_tokens_are_whole_blocks_and_one_less_on_a_full_hit(connector):
    prompt = list(range(24))                         # exactly 3 blocks
    assert connector.get_num_new_matched_tokens(EngineRequest("a", prompt), 0) == (0, False)
    save_prompt(connector, EngineRequest("a", prompt))
    assert connector.get_num_new_matched_tokens(EngineRequest("b", prompt), 0) == (23, False)
    assert connector.get_num_new_matched_tokens(EngineRequest("c", prompt + [99] * 5), 0) == (24, False)
    assert connector.get_num_new_matched_tokens(EngineRequest("d", prompt + [99] * 5), 16) == (8, False)
    assert connector.get_num_new_matched_tokens(EngineRequest("e", [7] + prompt), 0) == (0, False)


def test_saved_layers_load_back_exactly(connector):
    prompt = list(range(100, 120))                   # 2 full blocks + 4 tokens that have no key
    save_prompt(connector, EngineRequest("w", prompt))
    reader = EngineRequest("r", prompt + [1, 2, 3])
    hit, _ = connector.get_num_new_matched_tokens(reader, 0)
    assert hit == 16
    connector.update_state_after_alloc(reader, None, hit)
    connector.bind_connector_metadata(connector.build_connector_meta())
    connector.start_load_kv(None)
    for layer, name in enumerate(NAMES):
        connector.wait_for_layer_load(name)
        keys, values = connector.loaded_layer("r", name)
        want_k, want_v = layer_kv(20, layer)
        assert torch.equal(keys, want_k[:, :, :16]) and torch.equal(values, want_v[:, :, :16])
    assert connector.load_complete("r")


def start_load(c: StoreKVConnector, request_id: str, prompt: list[int], tokens: int) -> np.ndarray:
    """Start loading the prompt's first ``tokens`` tokens; the buffer the load reads into."""
    c.update_state_after_alloc(EngineRequest(request_id, prompt), None, tokens)
    c.bind_connector_metadata(c.build_connector_meta())
    c.start_load_kv()
    for name in NAMES:
        c.wait_for_layer_load(name)
    return c._loads[request_id].buffer


def test_a_released_load_buffer_serves_the_next_load_and_loaded_layers_own_their_memory(connector):
    """A fresh buffer a load made the decode's start wait for the first touch of every page; a kept one
    is reused, so the layers handed out must be copies that a later load cannot overwrite."""
    first, second = list(range(700, 708)), list(range(800, 808))     # one block each: the join is a view
    save_prompt(connector, EngineRequest("w1", first))
    save_prompt(connector, EngineRequest("w2", second), shift=50)
    kept = start_load(connector, "r1", first, 8)
    first_layers = [connector.loaded_layer("r1", name) for name in NAMES]
    connector.release_load("r1")
    assert np.shares_memory(start_load(connector, "r2", second, 8), kept)
    assert torch.equal(connector.loaded_layer("r2", NAMES[0])[0], layer_kv(8, 50)[0])
    connector.release_load("r2")
    for layer, (keys, values) in enumerate(first_layers):
        want_k, want_v = layer_kv(8, layer)
        assert torch.equal(keys, want_k) and torch.equal(values, want_v)


def test_a_finished_request_waits_for_its_saves(connector):
    request = EngineRequest("s", list(range(300, 316)))
    connector.update_state_after_alloc(request, None, 0)
    connector.bind_connector_metadata(connector.build_connector_meta())
    for layer, name in enumerate(NAMES):
        connector.save_kv_layer(name, layer_kv(16, layer), None)
    assert connector.wait_for_blocks_opened("s", timeout=10)
    connector.wait_for_save()
    assert connector.request_finished(request) == (False, None)     # saves done: freed at once
    assert connector.get_finished(["s"]) == (set(), set())          # so never reported


def test_a_request_finished_while_saving_is_reported_once_its_saves_are_done(connector):
    request = EngineRequest("d", list(range(400, 416)))
    connector.update_state_after_alloc(request, None, 0)
    connector.bind_connector_metadata(connector.build_connector_meta())
    release = threading.Event()
    original = connector.store.put_layer

    def slow_put(*args, **kwargs):
        release.wait(10)
        return original(*args, **kwargs)
    connector.store.put_layer = slow_put
    try:
        for layer, name in enumerate(NAMES):
            connector.save_kv_layer(name, layer_kv(16, layer), None)
        assert connector.request_finished(request) == (True, None)  # its pages wait for the puts
        assert connector.get_finished(["d"]) == (set(), set())
        release.set()
        connector.wait_for_save()
    finally:
        connector.store.put_layer = original
    assert connector.get_finished([]) == ({"d"}, set())
    assert connector.get_finished([]) == (set(), set())


def test_a_missing_block_is_reported_not_loaded(store, connector):
    prompt = list(range(500, 524))
    save_prompt(connector, EngineRequest("w", prompt))
    keys = connector.hasher.keys(prompt)
    with KVClient(unix_socket=store.unix_socket) as kv:
        kv.delete(keys[1])
    reader = EngineRequest("r", prompt)
    connector.update_state_after_alloc(reader, None, 24)
    connector.bind_connector_metadata(connector.build_connector_meta())
    connector.start_load_kv()
    connector.wait_for_layer_load(NAMES[0])
    assert connector.loaded_layer("r", NAMES[0]) is None
    assert not connector.load_complete("r")


def test_bad_calls_raise_clear_errors(connector):
    with pytest.raises(ValueError):
        connector.register_kv_caches({"only-one": None})
    with pytest.raises(KeyError):
        connector.wait_for_layer_load("no-such-layer")
    connector.bind_connector_metadata(connector.build_connector_meta())
    with pytest.raises(ValueError):                  # no request bound: which one is this layer for?
        connector.save_kv_layer(NAMES[0], layer_kv(8, 0), None)
    with pytest.raises(KeyError):
        connector.save_kv_layer(NAMES[0], layer_kv(8, 0), None, request_id="nobody")


def test_the_layout_names_the_slot_shape():
    assert LAYOUT.slot_shape == (2, 2, 8, 4)
    assert LAYOUT.numpy_dtype() == np.float32


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed here")
def test_without_vllm_the_module_offers_the_plain_connector_only():
    import client.connectors.vllm_v1 as module

    assert module._vllm_base() is None
    assert not hasattr(module, "VllmStoreConnector")
    assert StoreKVConnector.__bases__ == (object,)
