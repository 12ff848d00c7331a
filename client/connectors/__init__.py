"""Engine-facing adapters: the store in the shapes inference engines already plug in.

- `vllm_v1.StoreKVConnector`: vLLM's KV connector v1 (scheduler side asks how
  many prompt tokens the store holds; worker side loads and saves KV layer by
  layer). The project's own prefill and decode workers move KV through it.
- `sglang_hicache.HiCacheStore`: SGLang's HiCache storage backend
  (get/set/exists over tensors, `batch_exists` = one `KV.MATCH`).

They import only the client SDK (and torch), so an engine can use them without
the workers or the conductor.
"""
