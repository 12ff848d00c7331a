"""Engine-facing adapters: the store loaded by inference engines through their own plugin points.

- `vllm_v1.VllmStoreConnector` (code in `vllm_paged.py`): vLLM's `KVConnectorBase_V1` on its
  paged KV cache, built by vLLM's `KVConnectorFactory`. `vllm_v1.StoreKVConnector` is the same
  connector for a transformers cache; the project's prefill and decode workers move their KV
  through it. Both send their store traffic through `vllm_store_io.py`.
- `sglang_hicache.HiCacheStore`: SGLang's HiCache storage backend, loaded by its
  `StorageBackendFactory` ("dynamic"); pages move between SGLang's host KV pool and the store
  with no copy in between, `batch_exists` is one `KV.MATCH`.
- `lmcache_kvstore`: LMCache's remote connector for `kvstore://`, loaded through its remote
  storage plugin framework; zero-copy into LMCache's buffers, one `KV.MATCH` per batched lookup.
- `read_buffers.ReadBuffers`: load buffers kept for reuse, so a load does not fault fresh pages.

They import only the client SDK (and torch, and the engine's own modules where they subclass
them), so an engine can use them without the workers or the conductor. docs/engines.md has the
configuration each engine takes.
"""
