"""In-process links between simulated store nodes: the real node-to-node commands, a modelled NIC.

A simulated node (sim_cluster.py) runs the real `HotCopies` and `Migrator`, which talk to other
nodes through `Peers.link(addr).call(*args)`. `SimPeers` gives them the same interface without
sockets: a call is encoded as peer.py would send it, waits for the bytes to cross the two NICs,
runs the real command handler (kvstore/commands/cluster_data.py: KV.COPY, KV.IMPORT, KV.DRAIN,
...) on the target node, and parses the handler's RESP reply with peer.py's own reader, so a
`-TRYAGAIN` or `-NOTLEADER` reaches the caller as the same `PeerReplyError`.

The NIC model. Every node has one transmit and one receive queue of ``nic_bytes_per_s``; a
transfer starts when both the sender's transmit and the receiver's receive queue are free and
holds both for ``bytes / nic_bytes_per_s`` (first come, first served), plus a fixed latency.
Values are stored in the simulation at ``value_bytes`` each but stand for blocks of
``block_bytes``: an argument the command table marks as a value counts as a whole block on the
wire. Client reads and writes are not put on the NICs (sim_cluster.py counts their bytes per
node instead): the queues carry what nodes send each other. A node that is down refuses
connections at once, as a killed process does.
"""
from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass

from kvstore.cluster.peer import PeerError, PeerReplyError, read_reply
from kvstore.commands.families import build_table
from kvstore.commands.table import CommandError
from kvstore.net.protocol import writer

COMMANDS = build_table()


@dataclass(frozen=True)
class NicModel:
    nic_bytes_per_s: float = 12.5e9     # 100 Gbit/s
    latency_s: float = 50e-6
    block_bytes: int = 160 * 2**20      # a 512-token block of a 70B model (320 KiB a token)
    value_bytes: int = 64               # what a value takes in a simulated node's arena


@dataclass
class _Conn:
    """What the node-to-node handlers read from a connection."""

    server: object          # the target node: its .cluster
    engine: object
    addr: str               # the sender's announced address (the handlers check its host)
    user: object = None     # nodes speak as a user allowed everything (KV.LINK asks)

    def __post_init__(self) -> None:
        self.user = _Unrestricted()


class _Unrestricted:
    """The user a node's peer link authenticates as: allowed every key, in the shared pool
    of no tenant's quota."""

    tenant = 0

    @staticmethod
    def may_access(key: bytes, access) -> bool:
        return True


class SimNetwork:
    """The simulated nodes by address, which of them are up, and their NIC queues."""

    def __init__(self, model: NicModel):
        self.model = model
        self.nodes: dict[str, object] = {}      # addr -> node (with .cluster and .engine)
        self.down: set[str] = set()
        self._tx_free: dict[str, float] = {}
        self._rx_free: dict[str, float] = {}
        self.bytes_sent = 0                     # modelled bytes that crossed a link
        self.calls = 0
        self.copies_sent: Counter[bytes] = Counter()    # hot copies pushed (KV.COPY), per key

    def add(self, addr: str, node) -> None:
        self.nodes[addr] = node
        self.down.discard(addr)

    def kill(self, addr: str) -> None:
        self.down.add(addr)

    def peers_of(self, addr: str) -> SimPeers:
        return SimPeers(self, addr)

    def wire_bytes(self, args) -> int:
        """What ``args`` weigh on the wire, values counted as whole blocks."""
        cmd = COMMANDS.lookup(_as_bytes(args[0]))
        size = 0
        for i, arg in enumerate(args):
            if cmd is not None and cmd.value_args is not None and cmd.value_args(i):
                size += self.model.block_bytes
            else:
                size += len(_as_bytes(arg))
        return size

    async def transfer(self, sender: str, target: str, size: int) -> None:
        """Wait until ``size`` bytes have crossed from ``sender`` to ``target``."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        start = max(now, self._tx_free.get(sender, 0.0), self._rx_free.get(target, 0.0))
        end = start + size / self.model.nic_bytes_per_s
        self._tx_free[sender] = self._rx_free[target] = end
        self.bytes_sent += size
        await asyncio.sleep(end - now + self.model.latency_s)

    async def deliver(self, sender: str, target: str, args):
        """One command from ``sender`` run on ``target``: its parsed reply (an error as a value)."""
        if target in self.down or target not in self.nodes:
            raise PeerError(f"cannot connect to node {target}: connection refused")
        self.calls += 1
        await self.transfer(sender, target, self.wire_bytes(args))
        if target in self.down:
            raise PeerError(f"lost node {target}: connection reset")
        node = self.nodes[target]
        argv = [_as_bytes(arg) if not isinstance(arg, memoryview) else arg for arg in args]
        if argv[0] == b"KV.COPY":
            self.copies_sent.update(bytes(key) for key in argv[3::2])
        cmd = COMMANDS.lookup(argv[0])
        try:
            reply = cmd.handler(_Conn(node, node.engine, sender), argv)
        except CommandError as e:
            reply = writer.error(str(e), e.code)
        reader = asyncio.StreamReader()
        reader.feed_data(reply)
        reader.feed_eof()
        return await read_reply(reader)


def _as_bytes(arg) -> bytes:
    if isinstance(arg, str):
        return arg.encode()
    if isinstance(arg, int):
        return b"%d" % arg
    return bytes(arg)


class SimLink:
    """`PeerLink`'s calling interface over the simulated network."""

    def __init__(self, network: SimNetwork, sender: str, target: str):
        self.network, self.sender, self.addr = network, sender, target

    async def call(self, *args):
        reply = await self.network.deliver(self.sender, self.addr, args)
        if isinstance(reply, PeerReplyError):
            raise reply
        return reply

    async def pipeline(self, commands: list) -> list:
        return [await self.network.deliver(self.sender, self.addr, args) for args in commands]


class SimPeers:
    """`Peers` for one simulated node."""

    def __init__(self, network: SimNetwork, addr: str):
        self.network, self.addr = network, addr

    def link(self, addr: str) -> SimLink:
        return SimLink(self.network, self.addr, addr)

    def keep_only(self, addrs) -> None:
        """Nothing to close: links hold no connection."""

    def close(self) -> None:
        """Nothing to close: links hold no connection."""
