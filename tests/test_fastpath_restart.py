"""Every fast-path operation across a real restart of `kvstore serve` (same Unix socket,
stopped cleanly or killed with SIGKILL): each client has mapped the old node's arena
and holds what a busy client holds (a lease kept after a get, spares from a put, the
old node's shared index with values it read from it), and its first operation after
the restart must map the new arena and give the new node's answer: never the dead
node's bytes, never a block published with bytes that were written into the dead
node's memory."""
from __future__ import annotations

import asyncio
import signal
from typing import Any, Awaitable, Callable

import numpy as np
import pytest
import torch

from client import AsyncKVClient, KVClient

MIB = 1 << 20
OLD, NEW = 1, 2                    # every byte of a value is its version
SHAPE = (256, 1024)                # float32: 1 MiB, so puts go through the arena
N_LAYERS = 4
HOLD_LEASES = {"lease_ttl_ms": 120_000}   # a lease kept after a get outlives the restart


def value(version: int) -> np.ndarray:
    return np.full(MIB, version, np.uint8)


def tensor(version: int) -> np.ndarray:
    return np.full(SHAPE, version, np.float32)


def layer(version: int, index: int) -> torch.Tensor:
    return torch.full(SHAPE, float(10 * version + index))


class Blocking:
    """A KVClient behind the AsyncKVClient interface, so one scenario drives both."""

    def __init__(self, kv: KVClient):
        self.kv = kv
        self.fast_path = kv.fast_path

    def __getattr__(self, name: str) -> Callable[..., Awaitable[Any]]:
        method = getattr(self.kv, name)

        async def call(*args: Any, **kwargs: Any) -> Any:
            return method(*args, **kwargs)
        return call


# ------------------------------------------------------------- before the restart

async def prime(kv, name: str) -> None:
    """Hold in the old arena what a working client holds: a spare, a lease kept after a get,
    and the shared index of values it read without asking."""
    await kv.put(f"spare-{name}", value(OLD))                           # a spare reserved ahead
    kv.fast_path.index_reads = False
    for _ in range(2):                                                  # the second from the held lease
        assert bytes((await kv.get("held"))[:1]) == bytes([OLD])
    kv.fast_path.index_reads = True
    for key in ("v", "w"):
        assert bytes((await kv.get(key))[:1]) == bytes([OLD])           # from the shared index
    stats = kv.fast_path.stats
    assert stats.cached_reads == 1 and stats.index_reads == 2 and len(kv.fast_path.spares) >= 1


def write_values(wire: KVClient, version: int) -> None:
    """The values the clients read after the restart: on the old node as it had them, then on
    the restarted one (no SSD: it starts empty) under the same keys with new bytes."""
    wire.batch_put({key: value(version) for key in ("held", "v", "w")})
    wire.put_tensor("t", tensor(version))
    wire.put_tensor("u", tensor(version))
    for i in range(N_LAYERS):
        wire.put_layer("blk", i, layer(version, i), n_layers=N_LAYERS)


# ------------------------------------------------------------- after the restart: one client each

def assert_version(data: Any, version: int) -> None:
    array = np.frombuffer(data, np.uint8)
    assert array.size == MIB and (array == version).all(), f"not version {version}: {array[:4]}"


async def get(kv, wire):
    assert_version(await kv.get("held"), NEW)           # not from the lease held on the old node


async def get_into(kv, wire):
    into = np.zeros(MIB, np.uint8)
    assert await kv.get_into("held", into) == MIB
    assert_version(into, NEW)


async def batch_get(kv, wire):
    got = await kv.batch_get(["v", "held", "absent"])
    assert_version(got[0], NEW)
    assert_version(got[1], NEW)
    assert got[2] is None


async def batch_get_into(kv, wire):
    into = np.zeros((2, MIB), np.uint8)
    assert await kv.batch_get_into(["held", "w"], list(into)) == [MIB, MIB]
    assert (into == NEW).all()


async def put(kv, wire):
    assert await kv.put("fresh", value(NEW)) is True
    assert_version(wire.get("fresh"), NEW)


async def batch_put(kv, wire):
    assert await kv.batch_put({"fresh1": value(NEW), "fresh2": value(NEW)}) == [True, True]
    assert_version(wire.get("fresh2"), NEW)


async def put_layer(kv, wire):
    for i in range(N_LAYERS):
        assert await kv.put_layer("blk-new", i, layer(NEW, i), n_layers=N_LAYERS) is True
    stored = wire.get_layers("blk-new", framework="torch")
    assert all(torch.equal(stored[i], layer(NEW, i)) for i in range(N_LAYERS))


async def get_layers(kv, wire):
    got = await kv.get_layers("blk", 1, 3, framework="torch")
    assert torch.equal(got[0], layer(NEW, 1)) and torch.equal(got[1], layer(NEW, 2))
    into = torch.zeros(SHAPE)
    assert await kv.get_layers("blk", 3, 4, into=into) is into
    assert torch.equal(into, layer(NEW, 3))


async def put_tensor(kv, wire):
    assert await kv.put_tensor("t-new", tensor(NEW)) is True
    assert np.array_equal(wire.get_tensor("t-new"), tensor(NEW))


async def get_tensor(kv, wire):
    assert np.array_equal(await kv.get_tensor("t"), tensor(NEW))


async def get_tensor_into(kv, wire):
    into = np.zeros(SHAPE, np.float32)
    assert await kv.get_tensor_into("t", into) is True
    assert np.array_equal(into, tensor(NEW))


async def batch_put_tensors(kv, wire):
    assert await kv.batch_put_tensors({"t1": tensor(NEW), "t2": tensor(NEW)}) == [True, True]
    assert np.array_equal(wire.get_tensor("t2"), tensor(NEW))


async def batch_get_tensors_into(kv, wire):
    into = np.zeros((2, *SHAPE), np.float32)
    assert await kv.batch_get_tensors_into(["t", "u"], list(into)) == [True, True]
    assert (into == NEW).all()


OPERATIONS = [get, get_into, batch_get, batch_get_into, put, batch_put, put_layer, get_layers, put_tensor,
              get_tensor, get_tensor_into, batch_put_tensors, batch_get_tensors_into]


async def scenario(kvstore_factory, daemons: list, sig: int, connect: Callable[[], Any]) -> None:
    clients = {op.__name__: connect() for op in OPERATIONS}
    try:
        with KVClient(unix_socket=daemons[0].unix_socket, fast_path="off") as wire:
            wire.execute("KV.ARENA")                                    # the node publishes its index
            write_values(wire, OLD)
            for name, kv in clients.items():
                await prime(kv, name)
        old_mappings = {name: kv.fast_path.mapping for name, kv in clients.items()}
        daemons.append(kvstore_factory.restart(daemons[0], sig))
        with KVClient(unix_socket=daemons[-1].unix_socket, fast_path="off") as wire:
            write_values(wire, NEW)
            for op in OPERATIONS:
                kv = clients[op.__name__]
                await op(kv, wire)
                assert kv.fast_path.stats.remaps == 1, op.__name__
                assert kv.fast_path.mapping is not old_mappings[op.__name__]
                assert kv.fast_path.stats.wire_calls == 0, f"{op.__name__} went over the wire"
    finally:
        for kv in clients.values():
            await kv.close()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["stopped", "killed"])
def test_kvclient_maps_the_new_arena_after_a_restart(kvstore_factory, sig):
    daemons = [kvstore_factory()]

    def connect() -> Blocking:
        return Blocking(KVClient(unix_socket=daemons[0].unix_socket, fast_path="required", **HOLD_LEASES))
    asyncio.run(scenario(kvstore_factory, daemons, sig, connect))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["stopped", "killed"])
def test_async_client_maps_the_new_arena_after_a_restart(kvstore_factory, sig):
    daemons = [kvstore_factory()]
    asyncio.run(scenario(kvstore_factory, daemons, sig,
                         lambda: AsyncKVClient(unix_socket=daemons[0].unix_socket, fast_path="required",
                                               **HOLD_LEASES)))


def test_a_block_half_written_before_a_restart_is_written_again_whole(kvstore_factory):
    """Layers written to the dead node are gone with it: the block on the new node is
    visible only once every layer is written to it, with the bytes written to it."""
    daemon = kvstore_factory()
    with KVClient(unix_socket=daemon.unix_socket, fast_path="required") as kv:
        kv.put_layer("half", 0, layer(OLD, 0), n_layers=2)
        kvstore_factory.restart(daemon, signal.SIGKILL)
        assert kv.put_layer("half", 1, layer(NEW, 1), n_layers=2) is True
        assert kv.match_prefix(["half"]) == 0                       # layer 0 is not on this node
        assert kv.put_layer("half", 0, layer(NEW, 0), n_layers=2) is True
        stored = kv.get_layers("half", framework="torch")
        assert torch.equal(stored[0], layer(NEW, 0)) and torch.equal(stored[1], layer(NEW, 1))
