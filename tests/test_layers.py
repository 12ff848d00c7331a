"""Layer-wise blocks against a real `kvstore serve` process: layers written one at a
time, read while the writer is still at work (a second process), bad input."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from client import KVClient, ResponseError, tensors

ROOT = str(Path(__file__).resolve().parents[1])
LAYER = (2, 16, 64)          # one layer's K/V slice: (kv, tokens, head dim)


def layer_value(layer: int) -> torch.Tensor:
    return torch.full(LAYER, float(layer), dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def node(kvstore_module_factory):
    return kvstore_module_factory()


@pytest.fixture(params=["auto", "off"])
def kv(request, node):
    with KVClient(unix_socket=node.unix_socket, fast_path=request.param) as client:
        yield client
        client.execute("FLUSHALL")


@pytest.fixture
def key(request):
    return f"blk-{request.node.name}"        # open blocks outlive FLUSHALL: one key per test


def test_a_block_is_visible_only_once_every_layer_is_in(kv, key):
    for layer in (3, 0, 2):
        assert kv.put_layer(key, layer, layer_value(layer), n_layers=4) is True
        assert kv.match_prefix([key]) == 0 and kv.get(key) is None
    assert kv.get_layers(key, 0, 1, framework="torch").shape == (1, *LAYER)   # written layers are readable
    with pytest.raises(ResponseError, match="not written yet"):
        kv.get_layers(key, 0, 4)
    kv.put_layer(key, 1, layer_value(1), n_layers=4)
    assert kv.match_prefix([key]) == 1
    assert kv.put_layer(key, 1, layer_value(1), n_layers=4) is False          # cached: put-once
    whole = kv.get_layers(key, framework="torch")
    assert whole.shape == (4, *LAYER)
    assert all(torch.equal(whole[i], layer_value(i)) for i in range(4))
    into = torch.empty(LAYER, dtype=torch.bfloat16)
    kv.get_layers(key, 2, 3, into=into)                                       # one layer, its own shape
    assert torch.equal(into, layer_value(2))


def test_bad_layer_input(kv, key):
    with pytest.raises(ValueError, match="out of range"):
        kv.put_layer(key, 4, layer_value(0), n_layers=4)
    kv.put_layer(key, 0, layer_value(0), n_layers=4)
    with pytest.raises(ResponseError, match="out of range"):                    # the node checks too
        kv.execute("KV.PUTLAYER", key, 7, b"x")
    with pytest.raises(ResponseError, match="bytes"):
        kv.execute("KV.PUTLAYER", key, 1, b"x")
    with pytest.raises(ResponseError, match="already written"):
        kv.put_layer(key, 0, layer_value(0), n_layers=4)
    with pytest.raises(ResponseError, match="another header"):
        kv.put_layer(key, 1, torch.zeros(LAYER), n_layers=4)                  # float32, not bf16
    with pytest.raises(ResponseError, match="out of range"):
        kv.get_layers(key, 2, 9)
    with pytest.raises(ResponseError, match="timed out"):
        kv.get_layers(key, 0, 2, wait=0.2)
    with pytest.raises(ValueError):
        kv.put_layer(key, 0, layer_value(0), n_layers=0)
    assert kv.get_layers("absent", 0, 1) is None


def test_an_abandoned_block_is_reclaimed_and_its_waiter_told(kv, key):
    before = counters(kv)
    kv.put_layer(key, 0, layer_value(0), n_layers=2, timeout_ms=300)
    with pytest.raises(ResponseError, match="abandoned"):
        kv.get_layers(key, 1, 2, wait=4)
    assert kv.get_layers(key, 0, 1) is None
    after = counters(kv)
    assert after["partial_blocks_abandoned"] == before["partial_blocks_abandoned"] + 1


def test_arena_writes_name_the_arena_they_mapped(node, key):
    """KV.BLOCK with TOKEN and KV.LAYERDONE refuse a mapping of another arena (a node that
    restarted since) before they open or mark anything."""
    stale = b"x" * 16
    header = tensors.spec_of(layer_value(0), 2, layered=True).header()
    with KVClient(unix_socket=node.unix_socket, fast_path="required") as kv:
        token = kv.fast_path.arena().token
        before = counters(kv)["partial_blocks"]
        with pytest.raises(ResponseError, match="STALEARENA"):
            kv.execute("KV.BLOCK", key, header, "TOKEN", stale)
        assert counters(kv)["partial_blocks"] == before
        offset, n_layers, layer_bytes = kv.execute("KV.BLOCK", key, header, "TOKEN", token)
        assert (n_layers, layer_bytes) == (2, layer_value(0).numel() * 2)
        kv.fast_path.mapping.write(offset + 128, tensors.host_view(layer_value(0)))
        with pytest.raises(ResponseError, match="STALEARENA"):
            kv.execute("KV.LAYERDONE", stale, key, 0)
        assert kv.execute("KV.LAYERDONE", token, key, 0) == 1       # the stale one marked nothing
        assert kv.execute("KV.BLOCK", key, header) == [offset, 2, layer_bytes]   # the wire needs no token


def counters(kv: KVClient) -> dict[str, int]:
    stats = kv.execute("KV.LEASES")
    return {bytes(k).decode(): v for k, v in zip(stats[::2], stats[1::2])}


WRITER = textwrap.dedent("""
    import sys, time, torch
    from client import KVClient
    with KVClient(unix_socket=sys.argv[1]) as kv:
        for layer in range(32):
            time.sleep(0.01)                       # the model computing layer `layer`
            kv.put_layer("prefill", layer, torch.full((2, 16, 64), float(layer), dtype=torch.bfloat16),
                         n_layers=32)
""")


def test_a_reader_in_another_process_gets_layers_while_they_are_written(node):
    with KVClient(unix_socket=node.unix_socket, timeout=30) as kv:
        writer = subprocess.Popen([sys.executable, "-c", WRITER, node.unix_socket], cwd=ROOT)
        try:
            into = torch.empty((32, *LAYER), dtype=torch.bfloat16)
            arrived = []
            for layer in range(32):
                kv.get_layers("prefill", layer, layer + 1, into=into[layer], wait=25)
                arrived.append(kv.match_prefix(["prefill"]))
            assert writer.wait(20) == 0
        finally:
            writer.kill()
        assert all(torch.equal(into[i], layer_value(i)) for i in range(32))
        assert arrived[0] == 0                     # layer 0 was read before the block was complete
