"""Prefix-chained block keys: the names under which KV-cache blocks are stored.

A prompt's token ids are cut into blocks of `block_tokens`. Block i's key is

    key[i]  = H(key[i-1] || tokens of block i)
    key[-1] = H(namespace)

so two prompts share a key exactly when they share every token up to the end
of that block, and a lookup of the longest cached prefix is a walk along the
chain (one `KV.MATCH`). The rules, which every process and machine must apply
identically or nothing ever matches:

* H is xxh3-128 with the fixed seed `SEED` (never Python's `hash()`, which is
  salted per process); a digest is 16 bytes, and on the wire a key is the
  digest as 32 lower-case hex characters after an optional prefix (a model
  tag, say).
* Token ids enter the hash as unsigned 32-bit little-endian integers
  (`TOKEN_DTYPE`), whatever the input's dtype; ids outside [0, 2**32) are
  refused rather than wrapped.
* Only full blocks get keys; a trailing partial block has none (as in vLLM),
  since its KV would change as the prompt grows.
* The namespace binds what makes KV bytes incompatible: the model, the KV
  layout (dtype, tensor-parallel rank and size) and an optional tenant salt
  that keeps one tenant's prefixes from matching another's. `Namespace`
  encodes these canonically; a plain string is hashed as its UTF-8 bytes.

Hashing runs from the token array's bytes: a numpy array (or a list turned
into one) is converted once, and the loop does one slice and one xxh3 call
per block, with no per-token Python work.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import xxhash

SEED = 0x6B7673746F7265            # b"kvstore" read as a big-endian integer; fixed forever
TOKEN_DTYPE = np.dtype("<u4")      # token ids as they enter the hash
NAMESPACE_TAG = b"kvstore.namespace.v1:"


@dataclass(frozen=True)
class Namespace:
    """What two caches must agree on for their blocks to be interchangeable."""

    model: str
    dtype: str = ""
    tp_rank: int = 0
    tp_size: int = 1
    salt: str = ""

    def encode(self) -> bytes:
        """Canonical bytes: a version tag, then the fields as compact JSON with sorted keys."""
        return NAMESPACE_TAG + json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()


class BlockHasher:
    """Turns token-id sequences into prefix-chained block keys for one namespace."""

    def __init__(self, namespace: Namespace | str, block_tokens: int, *, prefix: str = ""):
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be positive, got {block_tokens}")
        self.namespace = namespace
        self.block_tokens = block_tokens
        self.prefix = prefix
        encoded = namespace.encode() if isinstance(namespace, Namespace) else namespace.encode("utf-8")
        self.root = xxhash.xxh3_128_digest(encoded, SEED)

    def hash_blocks(self, token_ids: Any) -> list[bytes]:
        """The 16-byte digest of every full block, in order."""
        data = token_bytes(token_ids, self.block_tokens)
        stride = self.block_tokens * TOKEN_DTYPE.itemsize
        digest = xxhash.xxh3_128_digest
        chain = self.root
        digests = []
        for start in range(0, len(data), stride):
            chain = digest(chain + data[start:start + stride], SEED)
            digests.append(chain)
        return digests

    def keys(self, token_ids: Any) -> list[str]:
        """The wire key of every full block: prefix + 32 lower-case hex characters."""
        return [self.prefix + d.hex() for d in self.hash_blocks(token_ids)]

    def __repr__(self) -> str:
        return f"BlockHasher({self.namespace!r}, {self.block_tokens}, prefix={self.prefix!r})"


def token_bytes(token_ids: Any, block_tokens: int) -> memoryview:
    """The full blocks of a 1-D integer sequence, as `TOKEN_DTYPE` bytes (no copy when already so)."""
    tokens = np.asarray(token_ids)
    if tokens.size == 0:
        return memoryview(b"")
    if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
        raise TypeError(f"token ids must be a 1-D integer sequence, got {tokens.dtype} "
                        f"with shape {tokens.shape}")
    tokens = tokens[:len(tokens) - len(tokens) % block_tokens]
    if tokens.dtype != TOKEN_DTYPE and tokens.size:
        if tokens.min() < 0 or tokens.max() > np.iinfo(TOKEN_DTYPE).max:
            raise ValueError("token ids must lie in [0, 2**32)")
    return memoryview(np.ascontiguousarray(tokens, dtype=TOKEN_DTYPE)).cast("B")
