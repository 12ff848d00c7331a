"""Unit tests for client/hashing.py: BlockHasher's prefix-chained block keys.

The golden vectors below were computed once and are pinned as literals: if
one changes, every key ever stored changes, and no cache written before the
change would ever match again. No server is started here; one test starts a
second Python interpreter to prove keys do not depend on the process.
"""
from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import xxhash

from client import BlockHasher, Namespace
from client.hashing import SEED

LLAMA = Namespace("llama-3-8b", dtype="bfloat16", tp_rank=0, tp_size=1)
REPO_ROOT = Path(__file__).resolve().parent.parent


def test_golden_vectors_for_a_namespace():
    hasher = BlockHasher(LLAMA, 4)
    assert hasher.root.hex() == "7913c77eabecef583dd571741e2649e4"
    assert hasher.keys(list(range(10))) == [
        "4de5cbbc0335b78c93d6849dbb6e13a8",
        "0ad4c8dc89a52d894052d9493a24de13",
    ]


def test_golden_vectors_for_a_plain_string_namespace_with_prefix():
    hasher = BlockHasher("demo", 16, prefix="m:")
    assert hasher.root.hex() == "ffa45cbb3ca2ffcf0ad21e5dad5843c7"
    assert hasher.keys(list(range(1000, 1040))) == [
        "m:c610d75dcd1fa24252821b146d3800ed",
        "m:63754a7c1ac8bf23d2be7c2d44bd8cb2",
    ]


def test_golden_vectors_for_a_salted_namespace():
    hasher = BlockHasher(Namespace("llama-3-8b", dtype="bfloat16", salt="tenant-a"), 4)
    assert hasher.keys([7] * 8) == [
        "3ef5517d7438ea0d3d99259e9fae4bb8",
        "f877e0902a74112f83fb0fee6f7510a7",
    ]


def test_namespace_encoding_is_canonical_json():
    assert LLAMA.encode() == (b'kvstore.namespace.v1:{"dtype":"bfloat16","model":"llama-3-8b",'
                              b'"salt":"","tp_rank":0,"tp_size":1}')


def test_keys_follow_the_documented_definition():
    """Recompute the chain from the definition with struct, independently of numpy."""
    tokens = [5, 70000, 2**32 - 1, 0, 9, 8, 7, 6, 1]
    block_tokens = 4
    chain = xxhash.xxh3_128_digest(b"demo", seed=SEED)
    expected = []
    for start in range(0, len(tokens) - block_tokens + 1, block_tokens):
        block = struct.pack(f"<{block_tokens}I", *tokens[start:start + block_tokens])
        chain = xxhash.xxh3_128_digest(chain + block, seed=SEED)
        expected.append(chain)
    assert BlockHasher("demo", block_tokens).hash_blocks(tokens) == expected


def test_numpy_arrays_of_any_integer_dtype_and_lists_agree():
    tokens = list(range(300, 364))
    hasher = BlockHasher(LLAMA, 16)
    reference = hasher.keys(tokens)
    for dtype in (np.int32, np.int64, np.uint32, np.uint16, np.uint64):
        assert hasher.keys(np.array(tokens, dtype=dtype)) == reference
    assert hasher.keys(tuple(tokens)) == reference


def test_digests_are_16_bytes_and_keys_are_their_hex():
    hasher = BlockHasher(LLAMA, 8, prefix="tag/")
    tokens = np.arange(40)
    digests = hasher.hash_blocks(tokens)
    assert all(len(d) == 16 for d in digests)
    assert hasher.keys(tokens) == ["tag/" + d.hex() for d in digests]
    assert all(len(k) == 4 + 32 and k[4:] == k[4:].lower() for k in hasher.keys(tokens))


def test_only_full_blocks_get_keys():
    hasher = BlockHasher(LLAMA, 16)
    assert hasher.keys(np.arange(15)) == []
    assert hasher.keys([]) == []
    assert hasher.keys(np.arange(47)) == hasher.keys(np.arange(32))
    assert len(hasher.keys(np.arange(48))) == 3


def test_shared_prefixes_share_keys_exactly_up_to_the_divergence_block():
    block_tokens = 16
    hasher = BlockHasher(LLAMA, block_tokens)
    first = np.arange(10 * block_tokens)
    second = first.copy()
    second[3 * block_tokens + 5] += 1          # diverge inside block 3; blocks 4.. are equal again
    a, b = hasher.keys(first), hasher.keys(second)
    assert a[:3] == b[:3]
    assert all(x != y for x, y in zip(a[3:], b[3:]))


@pytest.mark.parametrize("other", [
    Namespace("llama-3-8b", dtype="bfloat16", salt="tenant-b"),
    Namespace("llama-3-70b", dtype="bfloat16"),
    Namespace("llama-3-8b", dtype="float16"),
    Namespace("llama-3-8b", dtype="bfloat16", tp_rank=1, tp_size=2),
    "llama-3-8b",
])
def test_different_namespaces_never_share_keys(other):
    tokens = np.arange(64 * 16) % 1000
    salted = BlockHasher(Namespace("llama-3-8b", dtype="bfloat16", salt="tenant-a"), 16)
    theirs = BlockHasher(other, 16)
    assert not set(salted.keys(tokens)) & set(theirs.keys(tokens))


def test_another_process_with_another_hash_seed_gets_the_same_keys():
    tokens = list(range(1, 129))
    script = ("import json, sys\n"
              "from client import BlockHasher, Namespace\n"
              "ns = Namespace('llama-3-8b', dtype='bfloat16', salt='tenant-a')\n"
              "print(json.dumps(BlockHasher(ns, 16, prefix='p:').keys(json.loads(sys.argv[1]))))\n")
    env = dict(os.environ, PYTHONHASHSEED="12345", PYTHONPATH=str(REPO_ROOT))
    out = subprocess.run([sys.executable, "-c", script, json.dumps(tokens)], env=env,
                         capture_output=True, text=True, check=True, cwd=REPO_ROOT).stdout
    here = BlockHasher(Namespace("llama-3-8b", dtype="bfloat16", salt="tenant-a"), 16, prefix="p:")
    assert json.loads(out) == here.keys(tokens)


@pytest.mark.parametrize("tokens, error", [
    ([1, 2, -1, 4], ValueError),
    (np.array([1, 2, 2**32, 4], dtype=np.int64), ValueError),
    (np.array([1.0, 2.0, 3.0, 4.0]), TypeError),
    (np.arange(8).reshape(2, 4), TypeError),
])
def test_invalid_token_ids_are_refused(tokens, error):
    with pytest.raises(error):
        BlockHasher(LLAMA, 4).keys(tokens)


def test_block_tokens_must_be_positive():
    with pytest.raises(ValueError):
        BlockHasher(LLAMA, 0)
