"""LLaMA prefill and decode workers that are clients of the store, and the OpenAI-compatible gateway.

`model` loads the model (SmolLM2-135M from its wheel, or a tiny random LLaMA);
`prefill` and `decode` are the engines; `kvio` moves KV between the model's
cache and the store through the vLLM-shaped connector in `client.connectors`.
"""
