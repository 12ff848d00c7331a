"""The conductor: cache-aware scheduling of LLM requests onto prefill and decode instances.

It answers, per request, "which prefill instance, which decode instance, or
reject?" from where the prefix KV cache already lives and how loaded each
instance is (the Mooncake design, FAST '25). The same policy and admission
objects serve two drivers: `simulator` replays Mooncake traces against the cost
model in `costmodel`, and `service` answers live gRPC calls against a running
store.
"""
