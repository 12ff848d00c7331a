"""Prefill and decode engines through a real `kvstore serve` process: greedy output equals a monolithic
`generate`, token for token, with and without a cached prefix (tiny random LLaMA, and SmolLM2-135M)."""
from __future__ import annotations

import random

import pytest
import torch

from client import KVClient
from workers.catalog import SMOLLM2, TINY
from workers.decode import DecodeEngine
from workers.kvio import make_connector
from workers.model import load_model, reference_generate
from workers.prefill import PrefillEngine

BLOCK_TOKENS = 16


@pytest.fixture(scope="module")
def store(kvstore_module_factory):
    return kvstore_module_factory("--dram-size", "256mb")


@pytest.fixture(scope="module")
def tiny():
    return load_model(TINY)


def engines(loaded, daemon):
    def client():
        return KVClient(unix_socket=daemon.unix_socket)
    prefill = PrefillEngine(loaded, make_connector(client(), loaded, BLOCK_TOKENS))
    decode = DecodeEngine(loaded, make_connector(client(), loaded, BLOCK_TOKENS))
    return prefill, decode


def serve(prefill, decode, request_id, prompt, max_tokens):
    """The prefill/decode split: first token from the prefill, the rest from the decode batch."""
    result = prefill.prefill(request_id, prompt)
    seq = decode.submit(request_id, prompt, result.first_token, result.stored_tokens, max_tokens)
    return result, seq, [result.first_token] + [t for t, _ in decode.stream(seq)]


def prompts_sharing_a_prefix(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    base = [rng.randrange(vocab) for _ in range(100)]
    tails = [(40, 3), (100, 0), (64, 0), (100, 37), (5, 1), (33, 20)]
    return [base[:n] + [rng.randrange(vocab) for _ in range(k)] for n, k in tails]


def test_tiny_model_is_token_exact_with_and_without_a_cached_prefix(tiny, store):
    prefill, decode = engines(tiny, store)
    cached = []
    for i, prompt in enumerate(prompts_sharing_a_prefix(256)):
        result, seq, tokens = serve(prefill, decode, f"exact-{i}", prompt, 12)
        assert tokens == reference_generate(tiny, prompt, 12), f"prompt {i}"
        assert not seq.recomputed
        cached.append(result.cached_tokens)
    assert cached[0] == 0 and cached[1] == 32 and cached[3] == 96
    assert cached[2] == 63         # the whole prompt hits: one token less, as LMCache does


def test_requests_decode_together_in_one_batch(tiny, store):
    prefill, decode = engines(tiny, store)
    prompts = prompts_sharing_a_prefix(256, seed=1)[:4]
    seqs = []
    for i, prompt in enumerate(prompts):
        result = prefill.prefill(f"batch-{i}", prompt)
        seqs.append((result.first_token, decode.submit(f"batch-{i}", prompt, result.first_token,
                                                        result.stored_tokens, 20)))
    outputs = [[first] + [t for t, _ in decode.stream(seq)] for first, seq in seqs]
    assert max(r["batch"] for r in decode.timings.rows() if r["kind"] == "decode") > 1
    for prompt, out in zip(prompts, outputs):
        assert out == reference_generate(tiny, prompt, 20)


def test_prefix_reused_logits_match_a_full_prefill(tiny, store):
    prefill, _ = engines(tiny, store)
    prompt = prompts_sharing_a_prefix(256, seed=2)[3]
    full = prefill.prefill("logits-full", prompt, reuse_limit=0, store_kv=False)
    prefill.prefill("logits-store", prompt)
    prefill.connector.wait_for_save()
    reused = prefill.prefill("logits-reused", prompt)
    assert full.cached_tokens == 0 and reused.cached_tokens == 128
    assert torch.allclose(full.last_logits, reused.last_logits, atol=1e-4, rtol=0)


def test_decode_recomputes_when_a_block_disappears(tiny, store):
    prefill, decode = engines(tiny, store)
    prompt = prompts_sharing_a_prefix(256, seed=3)[3]
    result = prefill.prefill("evicted", prompt)
    prefill.connector.wait_for_save()
    keys = prefill.connector.hasher.keys(prompt)
    with KVClient(unix_socket=store.unix_socket) as kv:
        assert kv.delete(keys[2]) == 1
    seq = decode.submit("evicted", prompt, result.first_token, result.stored_tokens, 10)
    tokens = [result.first_token] + [t for t, _ in decode.stream(seq)]
    assert seq.recomputed
    assert tokens == reference_generate(tiny, prompt, 10)


def test_decode_refuses_bad_requests(tiny, store):
    _, decode = engines(tiny, store)
    with pytest.raises(ValueError):
        decode.submit("empty", [], 1, 0, 5)
    with pytest.raises(ValueError):
        decode.submit("too-long", [1] * tiny.max_tokens, 1, 0, 5)


def test_smollm2_is_token_exact_through_the_store(store):
    smol = load_model(SMOLLM2)
    prefill, decode = engines(smol, store)
    text = "The capital of France is Paris. The capital of Italy is"
    base = smol.tokenizer(text).input_ids
    for i, prompt in enumerate([base, base + smol.tokenizer(" Rome, and of Spain").input_ids]):
        result, seq, tokens = serve(prefill, decode, f"smol-{i}", prompt, 8)
        assert tokens == reference_generate(smol, prompt, 8)
        assert result.cached_tokens == (0 if i == 0 else len(base) // BLOCK_TOKENS * BLOCK_TOKENS)
