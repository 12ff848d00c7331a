"""KVClusterClient: one store made of many nodes, with every method of KVClient.

The nodes share the key space by Redis Cluster's hash slots, so the client
keeps the slot map (read with ``CLUSTER SLOTS`` from any node) and one
`KVClient` per node, and sends each key where its slot lives. What this adds
over routing one key at a time:

- **Batches split per node and run in parallel.** A prompt's blocks land on
  different nodes (placement is per block), so a prefix is read from every
  node at once and the nodes' NICs add up; results come back in the caller's
  order.
- **One round for a prefix match.** Each node is asked ``KV.MATCH`` for its
  own keys of the chain (in chain order): it answers how many of them lead
  before its first miss, which names that node's first missing position in
  the whole chain; the answer is the smallest such position. A node never
  needs the others' keys. The requests go out on one connection per node
  before any reply is read (no thread hand-offs for a sub-millisecond
  question), and each key's slot is computed once and remembered.
- **Chain links for eviction.** A batch put links each block to its nearest
  ancestor on its own node (so each node evicts its part of a chain leaf
  first) and tells the node of each block's chain parent, when that is
  another node, which block follows it (``KV.LINK``, pipelined with that
  node's part of the batch): when the parent goes for good, its node has the
  rest of the chain dropped, so what a chain keeps cached stays a prefix. A
  single-key put with a parent elsewhere queues its link, sent in the
  background (`cluster_links`).
- **Redirections are followed.** ``MOVED`` (the map changed) refreshes the map
  and retries on the new owner; ``ASK`` (a slot being moved) retries once on
  the importing node after ``ASKING``, on the same connection.
- **Reads of hot blocks spread over their copies.** A node copies a block
  read more often than its ``--hot-reads`` to other nodes; the client polls
  each node's hot-key map (``KV.HOTKEYS``, nil while unchanged) at most once a
  second and sends reads of those keys to the owner and the copies in turn
  (from a random start, so clients do not move in step). Its
  connections send READONLY, so a copy holder serves them; a read a copy
  cannot serve (the copy went, the holder died) is retried on the owner.
- **The local fast path is per node**: each node's `KVClient` maps its node's
  arena when that node runs on this host (``fast_path="auto"``).
- **Block bytes go through a transport.** Reads, writes and prefix matches
  take the node's `BlockTransport` (client/block_transport.py), today RESP on
  the node's `KVClient`; everything else (tensors, layers, locate, the map)
  takes that client itself. Routing hands each call the node's transport.

A put that is not an overwrite (put-once) is not retried after ``MOVED``
changed the map mid-batch for nodes whose part had already run: as in
KVClient, a retry could not tell its own earlier put from someone else's.
"""
from __future__ import annotations

import itertools
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, suppress
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from client.block_transport import BlockTransport, RespTransport
from client.buffers import Key, key_bytes
from client.errors import ConnectionError, KVError, ResponseError
from client.hashing import BlockHasher
from client.operations import Items, Location, Value, with_parents
from client.put_pipeline import PutsFailed
from client.cluster_links import LinkSender
from client.sync_client import KVClient
from proto.slots import SLOTS, keyslot

REDIRECTS = 5                # MOVED/ASK hops followed for one request before giving up
ANCESTOR_HOPS = 64           # how far up a batch's links a block looks for an ancestor on its node
HOT_REFRESH_S = 1.0          # how often the hot-key maps are polled (only when reading)
SLOT_CACHE_KEYS = 1 << 16    # keys whose slot is remembered (a chain's keys are asked about again and again)


class ClusterDown(KVError):
    """No node could tell the slot map, or a slot has no owner."""


class KVClusterClient:
    """A blocking client of a kvstore cluster; thread-safe like `KVClient`.

    ``nodes``: "host:port" of any nodes of the cluster (one is enough; the
    rest are learned from the slot map). Other arguments are those of
    `KVClient` (password, timeout, retries, pool_size, fast_path, ...).
    """

    def __init__(self, nodes: Sequence[str], *, parallelism: int = 16, **client_args: Any):
        if not nodes:
            raise ValueError("name at least one node (host:port)")
        self._client_args = client_args
        self._transports: dict[str, BlockTransport] = {}
        self._transports_lock = threading.Lock()
        self._seeds = list(nodes)
        # (node addresses, owner index per slot), replaced whole by `refresh`: an operation reads
        # it once, so a refresh in another thread never mixes two maps.
        self._map: tuple[list[str], np.ndarray] = ([], np.full(SLOTS, -1, dtype=np.int32))
        self._pool = ThreadPoolExecutor(max_workers=parallelism, thread_name_prefix="kvcluster")
        self._ask_transports: dict[str, BlockTransport] = {}
        self._ask_lock = threading.Lock()
        self._hot: dict[bytes, list[str]] = {}          # hot key -> owner and copy holders
        self._hot_versions: dict[str, Any] = {}         # per node: its hot-key map's version ...
        self._hot_entries: dict[str, list] = {}         # ... and its entries at that version
        self._hot_polled = 0.0
        self._hot_turn = itertools.count(random.randrange(1 << 16))   # whose turn among a hot key's holders
        self._slots: dict[Key, int] = {}                # key -> its slot, for at most SLOT_CACHE_KEYS keys
        self._links = LinkSender(self._pool, self._client)     # single puts' chain links, sent in the background
        self.refresh()

    # ------------------------------------------------------------ the map

    def refresh(self) -> None:
        """Read the slot map again (CLUSTER SLOTS) from the first node that answers."""
        errors = []
        for addr in [*self._map[0], *self._seeds]:
            try:
                ranges = self._client(addr).execute("CLUSTER", "SLOTS")
            except KVError as exc:
                errors.append(f"{addr}: {exc}")
                continue
            self._apply(ranges)
            return
        raise ClusterDown("no node answered CLUSTER SLOTS: " + "; ".join(errors))

    def _apply(self, ranges: list) -> None:
        addrs: list[str] = []
        owner = np.full(SLOTS, -1, dtype=np.int32)
        for start, end, master, *_ in ranges:
            host = bytes(master[0]).decode() if isinstance(master[0], (bytes, bytearray)) else master[0]
            addr = f"{host}:{master[1]}"
            if addr not in addrs:
                addrs.append(addr)
            owner[start:end + 1] = addrs.index(addr)
        self._map = (addrs, owner)

    @property
    def nodes(self) -> list[str]:
        """The nodes that own slots, as the map last read says."""
        return list(self._map[0])

    def node_of(self, key: Key) -> str:
        """The "host:port" that owns ``key``'s slot."""
        addrs, owner = self._map
        index = owner[keyslot(key_bytes(key))]
        if index < 0:
            raise ClusterDown(f"slot {keyslot(key_bytes(key))} has no owner")
        return addrs[index]

    def _client(self, addr: str) -> KVClient:
        """The one client of node ``addr``, opened on first use."""
        return self._transport(addr).client

    def _transport(self, addr: str) -> BlockTransport:
        """The one transport of node ``addr`` (over its one client), opened on first use.
        Double-checked under a lock: two threads asking at once must not each open one (the
        loser's would never be closed)."""
        transport = self._transports.get(addr)
        if transport is None:
            with self._transports_lock:
                transport = self._transports.get(addr)
                if transport is None:
                    host, _, port = addr.rpartition(":")
                    client = KVClient(host.strip("[]"), int(port), readonly=True, **self._client_args)
                    transport = self._transports[addr] = RespTransport(client)
        return transport

    # ------------------------------------------------------------ routing

    def _on_key(self, key: Key, run: Callable[[BlockTransport], Any]) -> Any:
        """Run ``run(transport)`` on the owner of ``key``, following MOVED and ASK."""
        addr = self.node_of(key)
        for _ in range(REDIRECTS):
            try:
                return run(self._transport(addr))
            except ResponseError as exc:
                addr = self._redirected(exc, key, run)
                if not isinstance(addr, str):
                    return addr[0]
        raise ClusterDown(f"too many redirections for key {key!r}")

    def _redirected(self, exc: ResponseError, key: Key, run: Callable[[BlockTransport], Any]):
        """Where to retry after a redirection: an address, or (result,) when ASK already ran it."""
        words = str(exc).split()
        if exc.code == "MOVED" and len(words) >= 3:
            self.refresh()
            return self.node_of(key)
        if exc.code == "ASK" and len(words) >= 3:
            return (self._asking(words[2], run),)
        raise exc

    def _asking(self, addr: str, run: Callable[[BlockTransport], Any]) -> Any:
        """Run once on the node importing the slot, after ASKING on the same connection.

        A one-connection client over the wire (no fast path: its lease commands
        would be routed on their own) guarantees ASKING and the request share it.
        """
        with self._ask_lock:
            transport = self._ask_transports.get(addr)
            if transport is None:
                host, _, port = addr.rpartition(":")
                args = {**self._client_args, "pool_size": 1, "fast_path": "off"}
                transport = self._ask_transports[addr] = RespTransport(KVClient(host.strip("[]"), int(port), **args))
            transport.client.execute("ASKING")
            return run(transport)

    def _slots_of(self, keys: Sequence[Key]) -> list[int]:
        """The slot of each key, remembered (a prompt's keys come back in every match and read)."""
        known, slots = self._slots, []
        for key in keys:
            slot = known.get(key)
            if slot is None:
                if len(known) >= SLOT_CACHE_KEYS:
                    known.clear()
                slot = known[key] = keyslot(key_bytes(key))
            slots.append(slot)
        return slots

    def _by_node(self, keys: Sequence[Key]) -> dict[str, list[int]]:
        """Indices of ``keys`` grouped by owner, in the caller's order within each node."""
        addrs, owner_of = self._map
        owners = owner_of[self._slots_of(keys)]
        if (owners < 0).any():
            raise ClusterDown("a key's slot has no owner")
        groups: list[list[int]] = [[] for _ in addrs]
        for index, owner in enumerate(owners.tolist()):
            groups[owner].append(index)
        return {addr: indices for addr, indices in zip(addrs, groups) if indices}

    def _scatter(self, keys: Sequence[Key], run: Callable[[BlockTransport, list[int]], list[Any]],
                 tail_first: bool = True, also: Iterable[str] = (),
                 failures: dict[str, tuple[list[int], Exception]] | None = None) -> list[Any]:
        """Run ``run(transport, indices)`` on every node with keys, in parallel; results in key order.

        Each node gets its part ``tail_first`` (last key first): a batch is
        usually a chain's blocks in chain order, and a node touched tail first
        ends with the head most recently used, so its LRU drops the chain's tail
        before its head although it holds only scattered blocks of it (the
        node's KV.MATCH refreshes tail first too).

        A node that answers MOVED for its part gets the map read again and
        that part is sent again where it now belongs; a part that meets ASK (a
        slot in the middle of a move) is run key by key, each following its
        own redirection. Nodes named in ``also`` are run too, with no keys (a
        cluster put's chain links for a node that stores none of the batch).
        A node's error is raised once every node has answered, or, given
        ``failures``, recorded there (address -> (its indices, the error)).
        """
        results: list[Any] = [None] * len(keys)
        pending = self._by_node(keys)
        for addr in also:
            pending.setdefault(addr, [])
        if tail_first:
            pending = {addr: indices[::-1] for addr, indices in pending.items()}
        for _ in range(REDIRECTS):
            futures = {addr: self._pool.submit(run, self._transport(addr), indices)
                       for addr, indices in pending.items()}
            moved: list[int] = []
            failed: dict[str, tuple[list[int], Exception]] = {}
            for addr, future in futures.items():
                try:
                    for index, value in zip(pending[addr], future.result()):
                        results[index] = value
                except ResponseError as exc:
                    if exc.code == "MOVED":
                        moved += pending[addr]
                    elif exc.code == "ASK":
                        for i in pending[addr]:
                            results[i] = self._on_key(keys[i], lambda c, i=i: run(c, [i])[0])
                    else:
                        failed[addr] = (pending[addr], exc)
                except (KVError, OSError) as exc:       # a node gone, timed out, refusing
                    failed[addr] = (pending[addr], exc)
            if failed and failures is None:
                raise next(iter(failed.values()))[1]
            if failures is not None:
                failures.update(failed)
            if not moved:
                return results
            self.refresh()
            regrouped = self._by_node([keys[i] for i in moved])
            pending = {addr: [moved[j] for j in local] for addr, local in regrouped.items()}
        raise ClusterDown("too many redirections for a batch")

    # ------------------------------------------------------------ hot keys

    def _poll_hot(self) -> None:
        """Refresh the hot-key map from every node, at most once per HOT_REFRESH_S."""
        now = time.monotonic()
        if now - self._hot_polled < HOT_REFRESH_S:
            return
        self._hot_polled = now
        nodes = list(self._map[0])
        replies = self._pool.map(self._hot_keys_of, nodes)
        hot: dict[bytes, list[str]] = {}
        for addr, entries in zip(nodes, replies):
            for key, holders in entries:
                hot[bytes(key)] = [addr, *(bytes(h).decode() for h in holders)]
        self._hot = hot

    def _hot_keys_of(self, addr: str) -> list:
        """A node's hot keys and their copy holders (its last answer while unchanged)."""
        try:
            reply = self._client(addr).execute("KV.HOTKEYS", self._hot_versions.get(addr, -1))
        except KVError:
            return []
        if reply is not None:
            self._hot_versions[addr], self._hot_entries[addr] = reply[0], reply[1]
        return self._hot_entries.get(addr, [])

    def _read(self, key: Key, run: Callable[[BlockTransport], Any]) -> Any:
        """A read: a hot key's goes to its owner and copies in turn, and to the next
        holder when one fails (a copy gone or a holder dead, the owner included).

        In turn rather than at random: with a few readers, random picks often
        leave a holder idle while another has two readers queued (6 readers over
        3 holders: one holder idle 9 % of the time), and its NIC's share is lost.
        """
        self._poll_hot()
        holders = self._hot.get(key_bytes(key))
        if not holders:
            return self._on_key(key, run)
        start = next(self._hot_turn) % len(holders)
        owner_failed: ConnectionError | None = None
        for addr in holders[start:] + holders[:start]:
            try:
                return self._on_key(key, run) if addr == holders[0] else run(self._transport(addr))
            except ConnectionError as e:      # a dead holder (the owner too): the others answer meanwhile
                if addr == holders[0]:
                    owner_failed = e
            except ResponseError:
                if addr == holders[0]:
                    raise                     # a copy's refusal (it went) passes to the next holder
        raise owner_failed                    # the owner is one of the holders: only its failure gets here

    # ------------------------------------------------------------ one key

    def put(self, key: Key, value: Value, *, parent: Key | None = None, overwrite: bool = False) -> bool:
        stored = self._on_key(key, lambda t: t.write(key, value, parent=parent, overwrite=overwrite))
        return self._linked(stored, parent, key)

    def get(self, key: Key) -> bytearray | None:
        return self._read(key, lambda t: t.read(key))

    def get_into(self, key: Key, buffer: Any) -> int | None:
        return self._read(key, lambda t: t.read_into(key, buffer))

    def put_tensor(self, key: Key, tensor: Any, *, parent: Key | None = None) -> bool:
        return self._linked(self._on_key(key, lambda t: t.client.put_tensor(key, tensor, parent=parent)), parent, key)

    def get_tensor(self, key: Key, *, framework: str = "numpy") -> Any:
        return self._read(key, lambda t: t.client.get_tensor(key, framework=framework))

    def get_tensor_into(self, key: Key, tensor: Any) -> bool:
        return self._read(key, lambda t: t.client.get_tensor_into(key, tensor))

    def put_layer(self, key: Key, layer: int, data: Any, **options: Any) -> Any:
        stored = self._on_key(key, lambda t: t.client.put_layer(key, layer, data, **options))
        last = layer == options.get("n_layers", 0) - 1          # the block is whole (and its parent before it)
        return self._linked(stored, options.get("parent"), key) if last else stored

    def _linked(self, stored: Any, parent: Key | None, key: Key) -> Any:
        """``stored``, after queueing the block's chain link for its parent's node when that is
        another node (client/cluster_links.py: sent in the background, batched per node). A block
        cached already is linked too, as a batch put links it: its parent's node may not know the
        link (the block came without its parent, or the parent came by a slot move)."""
        if parent is not None:
            addr = self.node_of(parent)
            if addr != self.node_of(key):
                self._links.add(addr, parent, key)
        return stored

    def get_layers(self, key: Key, start: int = 0, stop: int | None = None, **options: Any) -> Any:
        return self._on_key(key, lambda t: t.client.get_layers(key, start, stop, **options))

    def batch_put_layers(self, items: Sequence[tuple[Key, int, Any]], *, n_layers: int,
                         parents: Sequence[Key | None] | None = None, timeout_ms: int | None = None) -> list[bool]:
        """KVClient.batch_put_layers, each node's slots in one batch, in parallel; a block whose last
        layer is in is linked to its parent's node as put_layer links it."""
        links = [None] * len(items) if parents is None else list(parents)

        def put(t: BlockTransport, ix: list[int]) -> list[bool]:
            return t.client.batch_put_layers([items[i] for i in ix], n_layers=n_layers,
                                           parents=[links[i] for i in ix], timeout_ms=timeout_ms)
        stored = self._scatter([key for key, _, _ in items], put, tail_first=False)
        return [self._linked(done, parent, key) if layer == n_layers - 1 else done
                for (key, layer, _), parent, done in zip(items, links, stored)]

    def batch_get_layers(self, keys: Sequence[Key], start: int = 0, stop: int | None = None, *,
                         into: Sequence[Any] | None = None, **options: Any) -> list[Any]:
        """KVClient.batch_get_layers, each node's blocks in one batch, in parallel."""
        return self._scatter(keys, lambda t, ix: t.client.batch_get_layers(
            [keys[i] for i in ix], start, stop, into=None if into is None else [into[i] for i in ix], **options))

    # ------------------------------------------------------------ batches

    def exists(self, *keys: Key) -> int:
        """How many of keys are cached (KV.LOCATE: one round trip per node, whatever the slots)."""
        return sum(location is not None for location in self.locate(keys))

    def delete(self, *keys: Key) -> int:
        """Remove keys; how many existed. DEL stays within one slot, as Redis Cluster requires."""
        def per_node(t: BlockTransport, indices: list[int]) -> list[int]:
            slots: dict[int, list[int]] = {}
            for i in indices:
                slots.setdefault(keyslot(key_bytes(keys[i])), []).append(i)
            counts = {i: 0 for i in indices}
            for same_slot in slots.values():
                counts[same_slot[0]] = t.client.delete(*(keys[i] for i in same_slot))
            return [counts[i] for i in indices]
        return sum(self._scatter(keys, per_node))

    def batch_put(self, items: Items, *, parents: Sequence[Key | None] | None = None,
                  overwrite: bool = True) -> list[bool]:
        pairs, links = with_parents(items, parents)

        def put(t: BlockTransport, ix: list[int], local: list[Key | None], chain: list) -> list[bool]:
            return t.batch_write([pairs[i] for i in ix], parents=local, overwrite=overwrite, chain_links=chain)
        return self._put_chain([k for k, _ in pairs], links, put)

    def batch_get(self, keys: Sequence[Key]) -> list[bytearray | None]:
        return self._scatter(keys, lambda t, ix: t.batch_read([keys[i] for i in ix]))

    # ------------------------------------------------------------ puts that overlap

    def put_nowait(self, key: Key, value: Value, *, parent: Key | None = None, overwrite: bool = False) -> None:
        """put() without waiting for the commit: the owner's client takes the bytes
        (KVClient.put_nowait) and `flush` waits for every node's commits. A commit its node
        refused, the slot having moved meanwhile (MOVED) included, is one `flush` names."""
        self._client(self.node_of(key)).put_nowait(key, value, parent=parent, overwrite=overwrite)
        self._linked(None, parent, key)

    def batch_put_nowait(self, items: Items, *, parents: Sequence[Key | None] | None = None,
                         overwrite: bool = False) -> None:
        """put_nowait() for many pairs: each node's part to its client, each block under its
        nearest ancestor on its node, the links between nodes sent as batch_put sends them."""
        pairs, links = with_parents(items, parents)
        keys = [k for k, _ in pairs]
        local, remote = self._chain_links(keys, links)
        for addr, ix in self._by_node(keys).items():
            self._client(addr).batch_put_nowait([pairs[i] for i in ix], parents=[local[i] for i in ix],
                                                overwrite=overwrite)
        for addr, chain in remote.items():
            for parent, child in chain:
                self._links.add(addr, parent, child)

    def flush(self) -> int:
        """Wait for every put_nowait commit on every node: how many were acknowledged since the
        last flush. Raises PutsFailed naming the keys, of all nodes, whose commit failed."""
        done, failures = 0, {}
        for transport in list(self._transports.values()):
            try:
                done += transport.client.flush()
            except PutsFailed as exc:
                failures.update(exc.failures)
        if failures:
            raise PutsFailed(failures)
        return done

    def batch_get_into(self, keys: Sequence[Key], buffers: Sequence[Any]) -> list[int | None]:
        return self._scatter(keys, lambda t, ix: t.batch_read_into([keys[i] for i in ix], [buffers[i] for i in ix]))

    def batch_put_tensors(self, items: Items, *, parents: Sequence[Key | None] | None = None) -> list[bool]:
        pairs, links = with_parents(items, parents)

        def put(t: BlockTransport, ix: list[int], local: list[Key | None], chain: list) -> list[bool]:
            stored = t.client.batch_put_tensors([pairs[i] for i in ix], parents=local)
            t.client.batch_put([], chain_links=chain)         # tensors go one by one: the links follow
            return stored
        return self._put_chain([k for k, _ in pairs], links, put)

    def _put_chain(self, keys: list[Key], links: list[Key | None],
                   put: Callable[[BlockTransport, list[int], list[Key | None], list], list[bool]]) -> list[bool]:
        """A batch put, each node's part by ``put(transport, indices, local parents, chain links)``,
        in chain order (not tail first), so an ancestor is there when its descendant is linked to it."""
        local, remote = self._chain_links(keys, links)
        by_node = {self._transport(addr): chain for addr, chain in remote.items()}
        failures: dict[str, tuple[list[int], Exception]] = {}
        stored = self._scatter(keys, lambda t, ix: put(t, ix, [local[i] for i in ix], by_node.pop(t, [])),
                               tail_first=False, also=remote, failures=failures)
        if failures:
            self._give_back(keys, links, [i for indices, _ in failures.values() for i in indices])
            raise next(iter(failures.values()))[1]
        return stored

    def _give_back(self, keys: list[Key], links: list[Key | None], failed: list[int]) -> None:
        """After a node failed its part of a batch put: delete the blocks that follow a block not
        written (through the batch's links, parents before children). No prefix lookup reaches
        them, and nothing links them to the missing block, so no cascade would ever drop them.
        Best effort: a node that fails this too keeps them."""
        index = {key_bytes(key): i for i, key in enumerate(keys)}
        cut = set(failed)
        for i, parent in enumerate(links):
            if parent is not None and index.get(key_bytes(parent)) in cut:
                cut.add(i)
        after = [keys[i] for i in sorted(cut - set(failed))]
        if after:
            with suppress(KVError, OSError):
                self.delete(*after)

    def _chain_links(self, keys: list[Key], links: list[Key | None]) -> tuple[list[Key | None], dict[str, list]]:
        """Each block's nearest ancestor (through the batch's own links) on the block's node, and, per
        node, the (parent, child) links of the blocks whose chain parent lives on that other node.

        A chain's blocks are spread over nodes. Linked to the nearest ancestor
        it holds, each node keeps a chain of its own blocks and evicts them
        leaf first (tail first). A parent's node records its children elsewhere
        (KV.LINK, sent with its part of the batch), so when it drops the parent
        for good it has them dropped too (kvstore/cluster/cascade.py): they can
        no longer be reached by a prefix match. The walk up stops after
        ANCESTOR_HOPS links (an ancestor on the same node is about N hops up
        among N nodes), so a batch costs O(keys) however long its chain.
        """
        owner = {key: self.node_of(key) for key in keys}

        def node_of(key: Key) -> str:
            return owner[key] if key in owner else self.node_of(key)

        up = dict(zip(keys, links))
        local: list[Key | None] = []
        remote: dict[str, list] = {}
        for key, parent in zip(keys, links):
            if parent is not None and node_of(parent) != owner[key]:
                remote.setdefault(node_of(parent), []).append((parent, key))
            for _ in range(ANCESTOR_HOPS):          # bounded: links may loop, chains may be long
                if parent is None or node_of(parent) == owner[key]:
                    break
                parent = up.get(parent)
            local.append(parent)
        return local, remote

    def batch_get_tensors_into(self, keys: Sequence[Key], tensors: Sequence[Any]) -> list[bool]:
        return self._scatter(keys, lambda t, ix: t.client.batch_get_tensors_into([keys[i] for i in ix],
                                                                          [tensors[i] for i in ix]))

    def locate(self, keys: Sequence[Key]) -> list[Location | None]:
        return self._scatter(keys, lambda t, ix: t.client.locate([keys[i] for i in ix]))

    # ------------------------------------------------------------ prefixes

    def match_prefix(self, keys: Sequence[Key]) -> int:
        """How many leading keys of a chain are cached, over all nodes in one round.

        A round that meets a redirection (a slot moved or moving) or a broken
        connection is run again the general way, which follows MOVED and ASK.
        """
        if not keys:
            return 0
        try:
            leading = self._match_round(keys)
        except (ResponseError, ConnectionError):
            leading = self._scatter(keys, lambda t, ix: _leading_flags(t.match_prefix([keys[i] for i in ix]),
                                                                       len(ix)), tail_first=False)
        return leading.index(False) if False in leading else len(keys)

    def _match_round(self, keys: Sequence[Key]) -> list[bool]:
        """Per key, whether it leads its node's part: KV.MATCH sent to every node, then the replies read.

        The nodes answer at once while this thread waits once, which on a
        few cores beats a thread per node (each hand-off costs about what a
        node's answer does). Connections are borrowed in address order, so
        two threads never wait on each other's pools. An error closes the
        borrowed connections (their replies unread) and is raised.
        """
        leading = [False] * len(keys)
        with ExitStack() as borrowed:
            sent = [(borrowed.enter_context(self._transport(addr).match_sent([keys[i] for i in indices])), indices)
                    for addr, indices in sorted(self._by_node(keys).items())]
            for answer, indices in sent:
                for i in indices[:answer()]:
                    leading[i] = True
        return leading

    def match_tokens(self, hasher: BlockHasher, token_ids: Any) -> int:
        return self.match_prefix(hasher.keys(token_ids)) * hasher.block_tokens

    # ------------------------------------------------------------ whole cluster

    def stats(self) -> dict[str, int]:
        """Every node's KV.STATS counters, added up."""
        totals: dict[str, int] = {}
        for counters in self._pool.map(lambda addr: self._client(addr).stats(), self.nodes):
            for name, value in counters.items():
                totals[name] = totals.get(name, 0) + value
        return totals

    def ping(self) -> bool:
        return all(self._pool.map(lambda addr: self._client(addr).ping(), self.nodes))

    def execute(self, *args: Any) -> Any:
        """Any command: sent to the owner of its first argument after the name (a key for most
        commands), or to any node when it has none."""
        if len(args) > 1:
            return self._on_key(args[1], lambda t: t.client.execute(*args))
        return self._client(self.nodes[0]).execute(*args)

    def close(self) -> None:
        self._links.close()             # before the clients go: a link sent later would open a new one
        self._pool.shutdown(wait=False)
        for transport in [*self._transports.values(), *self._ask_transports.values()]:
            try:
                transport.close()
            except ConnectionError:
                pass
        self._transports.clear()
        self._ask_transports.clear()

    def __enter__(self) -> KVClusterClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _leading_flags(leading: int, count: int) -> list[bool]:
    """Per key of a node's part: True while it is among the part's leading cached keys."""
    return [True] * leading + [False] * (count - leading)
