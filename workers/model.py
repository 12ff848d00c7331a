"""Loading the weights the workers run: SmolLM2-135M (converted once, see `workers.catalog`) or a tiny LLaMA.

Everything runs in fp32: bf16 changes the logits of a prefix-reused prefill
by up to half a unit, fp32 by about 1e-5, and the workers promise greedy
output equal to a monolithic run.

`tiny` is a four-layer LLaMA with random weights from a fixed seed and a
byte-level tokenizer: the same code paths in a fraction of a second, for tests.

This module imports torch; names, files and tokenizers (what command lines
and the gateway need) are in `workers.catalog`, which does not.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from workers.catalog import DTYPE_NAME, TINY, TINY_CONTEXT, ByteTokenizer, check_name, converted_dir, namespace_of

DTYPE = getattr(torch, DTYPE_NAME)


@dataclass
class LoadedModel:
    """A causal LM ready for inference, its tokenizer, and what the KV layout depends on."""

    name: str
    model: Any
    tokenizer: Any
    n_layers: int
    kv_heads: int
    head_dim: int
    max_tokens: int
    eos_token_id: int | None

    @property
    def namespace(self) -> str:
        return namespace_of(self.name)

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.n_layers * self.kv_heads * self.head_dim * DTYPE.itemsize


def load_model(name: str) -> LoadedModel:
    """`smollm2-135m` (converted once, then loaded from the cache) or `tiny`."""
    check_name(name)
    if name == TINY:
        model, tokenizer = _tiny_model(), ByteTokenizer()
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        folder = converted_dir()
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=DTYPE)
        tokenizer = AutoTokenizer.from_pretrained(folder)
    model.eval()
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    eos = model.generation_config.eos_token_id
    return LoadedModel(name, model, tokenizer, cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim,
                       cfg.max_position_embeddings, eos[0] if isinstance(eos, list) else eos)


def _tiny_model() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=ByteTokenizer.vocab_size, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         max_position_embeddings=TINY_CONTEXT, initializer_range=0.2,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    state = torch.random.get_rng_state()
    torch.manual_seed(1234)
    try:
        model = LlamaForCausalLM(config).to(DTYPE)
    finally:
        torch.random.set_rng_state(state)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


@torch.inference_mode()
def reference_generate(loaded: LoadedModel, token_ids: list[int], max_new_tokens: int) -> list[int]:
    """A monolithic greedy `generate`: what the prefill/decode split must reproduce token for token."""
    ids = torch.tensor([token_ids], dtype=torch.long)
    out = loaded.model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                                attention_mask=torch.ones_like(ids),
                                pad_token_id=loaded.eos_token_id if loaded.eos_token_id is not None else 0)
    new = out[0, len(token_ids):].tolist()
    if loaded.eos_token_id is not None and loaded.eos_token_id in new:
        new = new[:new.index(loaded.eos_token_id) + 1]
    return new
