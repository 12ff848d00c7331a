"""`HiCacheStore` as SGLang 0.5.23 runs it, against a real `kvstore serve`: built by SGLang's own
`StorageBackendFactory` ("dynamic"), moving pages of SGLang's own host KV pool (`MHATokenToKVPoolHost`
over an `MHATokenToKVPool`, both on CPU) with `batch_set_v1`/`batch_get_v1`; TP ranks apart; a store that
is down or stopped gives misses and is used again when back; a bad address is an error at start-up.
The copying path (`get`/`set` of tensors) is checked with a tiny LLaMA's KV, decoded token-exactly."""
from __future__ import annotations

import importlib.util
import logging
import signal
import sys
import time

import pytest
import torch
from transformers import DynamicCache

from client import BlockHasher, KVClient
from client.connectors import sglang_hicache
from client.connectors.sglang_hicache import HiCacheStore
from loadtest.bench_sglang import create_backend, extra_config, fill_pages, host_pool, load_sglang, same_pages
from loadtest.bench_sglang import storage_config as make_config
from workers.catalog import TINY
from workers.model import load_model, reference_generate

PAGE = 16
LOG = "client.connectors.sglang_hicache"


@pytest.fixture(scope="module")
def sg():
    pytest.importorskip("sglang")
    return load_sglang()


@pytest.fixture(scope="module")
def store(kvstore_module_factory):
    return kvstore_module_factory()


def backend_over(sg, daemon, pool, *, layout="page_first", model="org/model-7B", tp_rank=0, tp_size=1, **extra):
    config = make_config(sg, extra_config(daemon.host, daemon.port, **extra), model=model, tp_rank=tp_rank,
                         tp_size=tp_size, layout=layout)
    return create_backend(sg, config, pool)


def page_indices(pool, first: int, pages: int) -> torch.Tensor:
    return torch.arange(first * pool.page_size, (first + pages) * pool.page_size, dtype=torch.int64)


# ------------------------------------------------------------------------ SGLang's factory and pools

def test_the_dynamic_factory_builds_our_backend_with_the_zero_copy_interface(sg, store):
    _, pool = host_pool(sg, "page_first")
    config = make_config(sg, extra_config(store.host, store.port), model="org/model-7B", tp_rank=1, tp_size=2)
    backend = sg["StorageBackendFactory"].create_backend("dynamic", config, pool)
    try:
        assert type(backend) is HiCacheStore and isinstance(backend, sg["HiCacheStorage"])
        assert config.extra_config["interface_v1"] == 1           # SGLang's controller then calls the v1 methods
        backend.register_mem_pool_host(pool)
        key = backend._piece_keys(["abc"])[0]
        assert key.startswith("hicache:org-model-7B_1_2:page_first.bfloat16.2x") and key.endswith(":abc.k")
        assert backend.get_stats() is not None and backend.batch_exists(["nothing"]) == 0
    finally:
        backend.close()


@pytest.mark.parametrize("layout", ["page_first", "layer_first", "page_first_direct", "page_head"])
def test_v1_round_trip_through_the_host_pool_is_byte_exact(sg, store, layout):
    _, pool = host_pool(sg, layout)
    backend = backend_over(sg, store, pool, layout=layout)
    try:
        src, dst = fill_pages(pool, 0, 5, seed=3), page_indices(pool, 8, 5)
        keys = [f"{layout}-{i}" for i in range(5)]
        assert backend.batch_set_v1(keys[:4], src[:4 * PAGE]) == [True] * 4
        calls = []
        match = backend.store.match_prefix
        backend.store.match_prefix = lambda names: calls.append(len(names)) or match(names)
        assert backend.batch_exists(keys) == 4                    # one KV.MATCH over every page's values
        assert calls == [5 * backend._pages.pieces]
        assert backend.batch_get_v1(keys, dst) == [True] * 4 + [False]
        assert same_pages(pool, src[:4 * PAGE], dst[:4 * PAGE])
        assert backend.batch_set_v1(keys[:4], src[:4 * PAGE]) == [True] * 4     # stored already: still True
        stats = backend.get_stats()
        assert isinstance(stats, sg["StorageMetrics"]) and stats.backup_pgs == [4, 4] and stats.prefetch_pgs == [4]
        assert backend.get_stats().backup_pgs == []                             # drained, as Mooncake's is
    finally:
        backend.clear()
        backend.close()


def test_a_page_that_vanished_or_changed_size_is_a_miss_never_wrong_bytes(sg, store):
    _, pool = host_pool(sg, "page_first")
    backend = backend_over(sg, store, pool)
    try:
        keys = ["p0", "p1", "p2", "p3"]
        src = fill_pages(pool, 0, 4, seed=11)
        assert all(backend.batch_set_v1(keys, src))
        k0, v0, k1, v1, k2, _, k3, _ = backend._piece_keys(keys)
        size = backend._pages.piece_sizes[0]
        backend.store.delete(v1)                                                  # vanished
        backend.store.put(k2, b"x" * (size - 2), overwrite=True)                  # shorter
        backend.store.put(k3, b"x" * (size + 64), overwrite=True)                 # longer
        dst = page_indices(pool, 8, 4)
        assert backend.batch_get_v1(keys, dst) == [True, False, False, False]
        assert same_pages(pool, src[:PAGE], dst[:PAGE])
        assert backend.batch_exists(keys) == 1
    finally:
        backend.clear()
        backend.close()


def test_tp_ranks_and_models_keep_apart(sg, store):
    ranks = []
    for rank in (0, 1):
        _, pool = host_pool(sg, "page_first")
        ranks.append((pool, backend_over(sg, store, pool, tp_rank=rank, tp_size=2)))
    keys = ["shared-0", "shared-1"]                 # the same page hashes on both ranks, different KV heads
    try:
        for rank, (pool, backend) in enumerate(ranks):
            assert all(backend.batch_set_v1(keys, fill_pages(pool, 0, 2, seed=100 + rank)))
        for pool, backend in ranks:
            dst = page_indices(pool, 4, 2)
            assert backend.batch_get_v1(keys, dst) == [True, True]
            assert same_pages(pool, page_indices(pool, 0, 2), dst)               # its own bytes, not the other's
        _, pool = host_pool(sg, "page_first")
        other_model = backend_over(sg, store, pool, model="org/other-7B", tp_rank=0, tp_size=2)
        assert other_model.batch_exists(keys) == 0
        other_model.close()
        ranks[0][1].clear()                                                      # one rank's keys only
        assert ranks[0][1].batch_exists(keys) == 0 and ranks[1][1].batch_exists(keys) == 2
    finally:
        for _, backend in ranks:
            backend.clear()
            backend.close()


# ---------------------------------------------------------------------- a store down, slow, misnamed

def test_a_store_that_goes_down_gives_misses_and_is_used_again_when_back(sg, kvstore_factory, caplog):
    daemon = kvstore_factory()
    _, pool = host_pool(sg, "page_first")
    backend = backend_over(sg, daemon, pool, store_retry_s=0.2, store_timeout_s=1.0)
    keys = ["d0", "d1"]
    src, dst = fill_pages(pool, 0, 2, seed=5), page_indices(pool, 4, 2)
    assert all(backend.batch_set_v1(keys, src))
    daemon.stop(signal.SIGKILL)
    with caplog.at_level(logging.WARNING, logger=LOG):
        for _ in range(3):
            assert backend.batch_exists(keys) == 0
            assert backend.batch_get_v1(keys, dst) == [False, False]
            assert backend.batch_set_v1(keys, src) == [False, False]
            assert backend.get("d0", torch.empty(4)) is None and backend.set("d0", torch.zeros(4)) is False
            time.sleep(0.25)
    unreachable = [r for r in caplog.records if "cannot be used" in r.getMessage()]
    assert len(unreachable) == 1 and f"{daemon.host}:{daemon.port}" in unreachable[0].getMessage()
    kvstore_factory.restart(daemon)
    time.sleep(0.25)
    with caplog.at_level(logging.WARNING, logger=LOG):
        assert backend.batch_set_v1(keys, src) == [True, True]              # the restarted node is empty
    assert any("answers again" in r.getMessage() for r in caplog.records)
    assert backend.batch_exists(keys) == 2
    assert backend.batch_get_v1(keys, dst) == [True, True] and same_pages(pool, src, dst)
    backend.close()


def test_a_stopped_store_costs_a_timeout_not_an_exception(sg, kvstore_factory):
    daemon = kvstore_factory()
    _, pool = host_pool(sg, "page_first")
    backend = backend_over(sg, daemon, pool, store_retry_s=0.2, store_timeout_s=0.5)
    keys = ["s0", "s1"]
    src, dst = fill_pages(pool, 0, 2, seed=9), page_indices(pool, 4, 2)
    assert all(backend.batch_set_v1(keys, src))
    daemon.proc.send_signal(signal.SIGSTOP)
    try:
        start = time.monotonic()
        assert backend.batch_exists(keys) == 0
        assert backend.batch_set_v1(["s2"], src[:PAGE]) == [False]          # skipped: the store is down
        assert time.monotonic() - start < 3.0
    finally:
        daemon.proc.send_signal(signal.SIGCONT)
    time.sleep(0.25)
    assert backend.batch_exists(keys) == 2
    assert backend.batch_get_v1(keys, dst) == [True, True] and same_pages(pool, src, dst)
    backend.close()


@pytest.mark.parametrize("extra, names", [
    ({}, "'store_host'"),
    ({"store_host": "127.0.0.1"}, "'store_port'"),
    ({"store_host": "127.0.0.1", "store_port": "six"}, "'store_port'"),
    ({"store_host": "127.0.0.1", "store_port": 70000}, "'store_port'"),
    ({"store_host": "no such host", "store_port": 6379}, "'store_host'"),
])
def test_a_missing_or_malformed_address_is_an_error_at_start_up(sg, extra, names):
    _, pool = host_pool(sg, "page_first")
    config = make_config(sg, {"backend_name": "kvstore", "module_path": "client.connectors.sglang_hicache",
                              "class_name": "HiCacheStore", **extra})
    with pytest.raises(ValueError, match=names):
        sg["StorageBackendFactory"].create_backend("dynamic", config, pool)


def test_the_module_imports_without_sglang(monkeypatch):
    monkeypatch.setitem(sys.modules, "sglang.srt.mem_cache.hicache_storage", None)     # its import fails
    spec = importlib.util.spec_from_file_location("sglang_hicache_alone", sglang_hicache.__file__)
    alone = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(alone)
    assert not alone.SGLANG and alone.HiCacheStore.__mro__[1] is object
    assert alone.HiCacheStore.over_client(KVClient(port=1)).get_stats() is None


# --------------------------------------------------------------- the copying path (tensors by key)

@pytest.fixture
def hicache(store):
    with KVClient(unix_socket=store.unix_socket) as kv:
        backend = HiCacheStore.over_client(kv, key_prefix="hicache-test:")
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
    assert hicache.get("page-a", torch.empty(3, 2, 4)) is None              # another shape: a miss
    assert hicache.batch_exists([]) == 0
    counts = hicache.counters()
    assert counts["get_hits"] == 1 and counts["get_misses"] == 2


def test_clear_deletes_only_its_own_keys(store, hicache):
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
