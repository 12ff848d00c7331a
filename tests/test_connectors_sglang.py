"""The SGLang HiCache storage shape against a real `kvstore serve`: a tiny LLaMA's KV pages stored, matched
with `batch_exists` (one KV.MATCH), read back into the caller's tensors, and decoded token-exactly."""
from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from client import BlockHasher, KVClient
from client.connectors.sglang_hicache import HiCacheStore
from conftest import start_kvstore
from workers.catalog import TINY
from workers.model import load_model, reference_generate

PAGE = 16


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    daemon = start_kvstore(tmp_path_factory.mktemp("kvstore"))
    yield daemon
    daemon.stop()


@pytest.fixture
def hicache(store):
    with KVClient(unix_socket=store.unix_socket) as kv:
        backend = HiCacheStore(kv, key_prefix="hicache-test:")
        yield backend
        backend.clear()


def pages_of(cache: DynamicCache, pages: int) -> list[torch.Tensor]:
    """Page i: every layer's keys and values of tokens [i*PAGE, (i+1)*PAGE), shaped (layers, 2, heads, PAGE, dim)."""
    return [torch.stack([torch.stack([layer.keys[0, :, i * PAGE:(i + 1) * PAGE],
                                      layer.values[0, :, i * PAGE:(i + 1) * PAGE]]) for layer in cache.layers])
            for i in range(pages)]


@torch.inference_mode()
def test_pages_of_a_real_model_round_trip_token_exact(hicache):
    tiny = load_model(TINY)
    prompt = list(range(10, 90))                     # 80 tokens: 5 pages
    keys = BlockHasher("sglang-test", PAGE).keys(prompt)
    cache = DynamicCache(config=tiny.model.config)
    tiny.model(input_ids=torch.tensor([prompt]), past_key_values=cache, use_cache=True)
    pages = pages_of(cache, 4)
    assert hicache.batch_set(keys[:4], pages)
    assert hicache.batch_exists(keys) == 4
    assert hicache.exists(keys[3]) and not hicache.exists(keys[4])

    targets = [torch.empty_like(p) for p in pages]
    got = hicache.batch_get(keys[:4], targets)
    assert all(g is t for g, t in zip(got, targets))
    rebuilt = DynamicCache(config=tiny.model.config)
    for layer in range(tiny.n_layers):
        kv = torch.cat([t[layer] for t in targets], dim=2)         # (2, heads, 64, dim)
        rebuilt.update(kv[0].unsqueeze(0), kv[1].unsqueeze(0), layer)
    cached = 4 * PAGE
    out = tiny.model(input_ids=torch.tensor([prompt[cached:]]), past_key_values=rebuilt, use_cache=True)
    tokens = [int(out.logits[0, -1].argmax())]
    for _ in range(7):
        out = tiny.model(input_ids=torch.tensor([[tokens[-1]]]), past_key_values=rebuilt, use_cache=True)
        tokens.append(int(out.logits[0, -1].argmax()))
    assert tokens == reference_generate(tiny, prompt, 8)


def test_get_without_a_target_returns_a_new_tensor_and_misses_are_none(hicache):
    value = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)
    assert hicache.set("page-a", value)
    assert torch.equal(hicache.get("page-a"), value)
    assert hicache.get("page-b") is None
    assert hicache.batch_exists([]) == 0
    stats = hicache.get_stats()
    assert stats["get_hits"] == 1 and stats["get_misses"] == 1 and "store_keys" in stats


def test_clear_deletes_only_its_own_prefix(store, hicache):
    with KVClient(unix_socket=store.unix_socket) as kv:
        kv.put("someone-else", b"x")
        hicache.batch_set(["a", "b"], [torch.zeros(4), torch.ones(4)])
        hicache.clear()
        assert hicache.batch_exists(["a", "b"]) == 0
        assert kv.get("someone-else") == b"x"


def test_bad_calls_raise_clear_errors(hicache):
    with pytest.raises(ValueError):
        hicache.batch_set(["a", "b"], [torch.zeros(2)])
    with pytest.raises(ValueError):
        hicache.set("a", None)
    with pytest.raises(ValueError):
        hicache.batch_get(["a"], [])
