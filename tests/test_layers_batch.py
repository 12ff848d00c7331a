"""The layer batches: `batch_put_layers` and `batch_get_layers`, through the arena and over the wire.

Both must leave the store as the same slots written one `put_layer` at a time would (blocks commit when
their last layer is in, parents chain them, a reader waits for layers still being written), in a fixed
number of round trips whatever the number of slots.
"""
from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
import torch

from client import AsyncKVClient, KVClient, ResponseError, TensorMismatch

N_LAYERS = 4
SLOT = (2, 8, 16)


def slot(block: int, layer: int) -> torch.Tensor:
    return torch.full(SLOT, float(block * 100 + layer), dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def node(kvstore_module_factory):
    return kvstore_module_factory()


@pytest.fixture(params=["required", "off"])
def kv(request, node):
    with KVClient(unix_socket=node.unix_socket, fast_path=request.param) as client:
        yield client
        client.execute("FLUSHALL")


@pytest.fixture
def keys(request):
    return [f"blk-{request.node.name}-{i}" for i in range(3)]      # open blocks outlive FLUSHALL


def round_trips(kv: KVClient) -> list:
    """Count the round trips the client's transport takes from now on."""
    from client.steps import RoundTrip
    taken: list = []
    transport = kv._transport
    take = transport._take

    def counting(step, conn):
        if isinstance(step, RoundTrip):
            taken.append(len(step.requests))
        return take(step, conn)
    transport._take = counting
    return taken


def test_a_batch_of_layers_writes_the_blocks_a_slot_at_a_time_would(kv, keys):
    parents = [None, keys[0], keys[1]]
    taken = round_trips(kv)
    for layer in range(N_LAYERS):
        items = [(key, layer, slot(b, layer)) for b, key in enumerate(keys)]
        del taken[:]
        assert kv.batch_put_layers(items, n_layers=N_LAYERS, parents=parents) == [True] * len(keys)
        # over the wire one round trip (KV.BLOCK, KV.PUTLAYER per block); through the arena one opening
        # the blocks and one marking the slots
        assert taken == ([2 * len(keys)] if kv.fast_path.mode == "off" else [len(keys), len(keys)])
        assert kv.match_prefix(keys) == (len(keys) if layer == N_LAYERS - 1 else 0)
    del taken[:]
    got = kv.batch_get_layers(keys, framework="torch")
    assert len(taken) == 1                             # every block's layers in one round trip
    for b, value in enumerate(got):
        assert value.shape == (N_LAYERS, *SLOT)
        assert all(torch.equal(value[layer], slot(b, layer)) for layer in range(N_LAYERS))
    assert kv.execute("DEL", keys[0]) == 1
    assert kv.match_prefix(keys) == 0                  # the chain: a missing first block hides the rest


def test_a_batch_spanning_layers_and_blocks_and_a_cached_block(kv, keys):
    kv.batch_put_layers([(keys[0], layer, slot(0, layer)) for layer in range(N_LAYERS)], n_layers=N_LAYERS)
    items = [(key, layer, slot(b, layer)) for layer in range(N_LAYERS) for b, key in enumerate(keys)]
    result = kv.batch_put_layers(items, n_layers=N_LAYERS)
    assert result == [b != 0 for layer in range(N_LAYERS) for b in range(len(keys))]    # keys[0]: cached
    into = [torch.empty((N_LAYERS, *SLOT), dtype=torch.bfloat16) for _ in keys]
    assert kv.batch_get_layers(keys, into=into) == into
    assert all(torch.equal(into[b][layer], slot(b, layer)) for b in range(len(keys)) for layer in range(N_LAYERS))


def test_every_item_is_tried_and_the_first_error_raised_after(kv, keys):
    kv.put_layer(keys[1], 0, slot(1, 0), n_layers=N_LAYERS)
    items = [(key, 0, slot(b, 0)) for b, key in enumerate(keys)]
    with pytest.raises(ResponseError, match="already written"):
        kv.batch_put_layers(items, n_layers=N_LAYERS)
    for key in (keys[0], keys[2]):                     # the others went in all the same
        assert kv.get_layers(key, 0, 1, framework="torch") is not None


def test_a_batch_read_gives_none_for_absent_blocks_and_raises_a_mismatch_after(kv, keys):
    kv.batch_put_layers([(keys[0], layer, slot(0, layer)) for layer in range(N_LAYERS)], n_layers=N_LAYERS)
    assert kv.batch_get_layers([keys[0], "absent", keys[0]], 0, 1, framework="torch")[1] is None
    wrong = [np.empty((N_LAYERS, *SLOT), np.float32), torch.empty((N_LAYERS, *SLOT), dtype=torch.bfloat16)]
    with pytest.raises(TensorMismatch):
        kv.batch_get_layers([keys[0], keys[0]], into=wrong)
    assert torch.equal(wrong[1][2], slot(0, 2))          # the other block was read all the same
    assert kv.batch_get_layers([]) == [] and kv.batch_put_layers([], n_layers=N_LAYERS) == []


def test_a_batch_read_waits_for_layers_still_being_written(kv, keys):
    kv.batch_put_layers([(keys[0], 0, slot(0, 0))], n_layers=N_LAYERS)

    def rest():
        kv.batch_put_layers([(keys[0], layer, slot(0, layer)) for layer in range(1, N_LAYERS)],
                            n_layers=N_LAYERS)
    timer = threading.Timer(0.2, rest)
    timer.start()
    try:
        (value,) = kv.batch_get_layers([keys[0]], wait=3.0, framework="torch")
    finally:
        timer.join()
    assert torch.equal(value[N_LAYERS - 1], slot(0, N_LAYERS - 1))


def test_bad_batches_are_refused_before_anything_is_sent(kv, keys):
    with pytest.raises(ValueError, match="out of range"):
        kv.batch_put_layers([(keys[0], N_LAYERS, slot(0, 0))], n_layers=N_LAYERS)
    with pytest.raises(ValueError, match="parents"):
        kv.batch_put_layers([(keys[0], 0, slot(0, 0))], n_layers=N_LAYERS, parents=[None, None])
    with pytest.raises(TypeError, match="contiguous"):
        kv.batch_put_layers([(keys[0], 0, slot(0, 0)), (keys[1], 0, torch.zeros(16, 8, 2).transpose(0, 2))],
                            n_layers=N_LAYERS)
    with pytest.raises(ValueError, match="destinations"):
        kv.batch_get_layers(keys, into=[None])
    assert kv.get_layers(keys[0], framework="torch") is None


def test_the_asyncio_client_has_the_batches(node, keys):
    async def run():
        async with AsyncKVClient(unix_socket=node.unix_socket) as kv:
            items = [(key, layer, slot(b, layer)) for layer in range(N_LAYERS) for b, key in enumerate(keys)]
            assert await kv.batch_put_layers(items, n_layers=N_LAYERS) == [True] * len(items)
            got = await kv.batch_get_layers(keys, 1, 2, framework="torch")
            assert all(torch.equal(value[0], slot(b, 1)) for b, value in enumerate(got))
            await kv.execute("FLUSHALL")
    asyncio.run(run())
