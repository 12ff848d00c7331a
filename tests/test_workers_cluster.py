"""Workers on a store cluster. Starts a real etcd and three `kvstore serve --cluster` nodes (`ClusterUp`):
the prefill and decode engines move KV through `KVClusterClient`, found from the etcd URL as `--cluster`
finds it, and their greedy output equals a monolithic `generate` while the blocks land on several nodes.
Then `kvstore llm up --cluster-nodes 3` runs the whole stack (conductor and worker processes given
`--cluster`) and serves a completion token-exact."""
from __future__ import annotations

import json

import grpc
import pytest

from client import KVClient
from conductor.stores import StoreError, cluster_nodes, open_store
from llm_procs import LlmUp, post
from proto import grpc_codegen
from tests.cluster_procs import ClusterUp
from workers.catalog import TINY
from workers.decode import DecodeEngine
from workers.kvio import make_connector
from workers.model import load_model, reference_generate
from workers.prefill import PrefillEngine

cpb, cpb_grpc = grpc_codegen.load("conductor")
BLOCK_TOKENS = 8


@pytest.fixture(scope="module")
def tiny():
    return load_model(TINY)


def keys_per_node(addrs: list[str]) -> list[int]:
    counts = []
    for addr in addrs:
        host, _, port = addr.rpartition(":")
        with KVClient(host, int(port)) as node:
            counts.append(node.execute("DBSIZE"))
    return counts


def test_prefill_and_decode_through_a_three_node_cluster_are_token_exact(tiny):
    with ClusterUp(nodes=3, dram_size="64mb") as up:
        assert len(cluster_nodes(up.etcd_url)) == 3
        prefill_store, decode_store = open_store(cluster=up.etcd_url), open_store(cluster=up.etcd_url)
        prefill = PrefillEngine(tiny, make_connector(prefill_store, tiny, BLOCK_TOKENS))
        decode = DecodeEngine(tiny, make_connector(decode_store, tiny, BLOCK_TOKENS))
        try:
            base = [(7 * i + 3) % 256 for i in range(96)]
            for i, prompt in enumerate([base, base[:80] + [1, 2, 3, 4, 5]]):
                result = prefill.prefill(f"c{i}", prompt)
                seq = decode.submit(f"c{i}", prompt, result.first_token, result.stored_tokens, 10)
                tokens = [result.first_token] + [t for t, _ in decode.stream(seq)]
                assert tokens == reference_generate(tiny, prompt, 10), f"prompt {i}"
                assert not seq.recomputed
                assert result.cached_tokens == (0 if i == 0 else 80)
            counts = keys_per_node([n["addr"] for n in up.info["nodes"]])
            assert sum(counts) == 96 // BLOCK_TOKENS + 5 // BLOCK_TOKENS
            assert sum(1 for c in counts if c) > 1, counts
        finally:
            decode.stop()
            prefill_store.close()
            decode_store.close()


def test_a_cluster_url_that_names_nothing_is_a_clear_error():
    with pytest.raises(StoreError, match="bad cluster URL"):
        cluster_nodes("etcd://nowhere")
    with pytest.raises(StoreError, match="cannot read cluster"):
        cluster_nodes("etcd://127.0.0.1:1/kvstore")


def test_llm_up_on_a_started_cluster_serves_token_exact_completions(tiny):
    with LlmUp("--cluster-nodes", "3", "--prefill", "1", "--decode", "1", "--model", TINY, "--port", "0",
               "--block-tokens", str(BLOCK_TOKENS), "--dram-size", "64mb") as info:
        assert info["store"].startswith("etcd://")
        base = [(5 * i + 1) % 256 for i in range(70)]
        for prompt in (base, base + [9] * 12):         # the second reuses the first's blocks (KV.MATCH, KV.LOCATE)
            status, body = post(info["gateway"], {"prompt": prompt, "max_tokens": 8, "return_token_ids": True})
            assert status == 200, body
            assert json.loads(body)["choices"][0]["token_ids"] == reference_generate(tiny, prompt, 8)
        counts = keys_per_node(cluster_nodes(info["store"]))
        assert sum(counts) == 82 // BLOCK_TOKENS and sum(1 for c in counts if c) > 1, counts
        with grpc.insecure_channel(info["conductor"]) as channel:
            assert cpb_grpc.ConductorStub(channel).Stats(cpb.StatsRequest(), timeout=10).reused_tokens == 64
