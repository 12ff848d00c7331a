"""The eviction cascade across nodes: when a block goes for good, the blocks after it in its chains go too.

Why. A prefix match stops at the first missing block, so a block whose
predecessor is gone is never read again: it only takes room, and the chain's
cached blocks stop being a prefix of it. One node keeps chains prefix-closed
with leaf-first eviction over parent links (kvstore/store/eviction.py), but in a
cluster a chain's blocks live on different nodes, each evicting its own oldest
at its own pressure, so a chain loses block i on one node while block j > i
stays on another. No amount of touching in order closes that gap; dropping
what can no longer be reached does.

What goes. A final drop (the engine's ``final_drop_listeners``: evicted from
its last tier, expired, deleted, dropped by a cascade; not a demotion, not a
value replaced by a new one of its key, not a value leaving with a slot move)
of a key of a slot this node serves, is moving away, or is taking in (a slot
move's step, migration.py) is followed by the drop of

- its local descendants: its children through the engine's parent links (a
  cluster batch put links each block to its nearest ancestor on its node),
  each of which cascades in turn;
- its remote children: the blocks that follow it on other nodes. A cluster
  batch put knows which blocks' chain predecessors live on another node and
  records each such link there with ``KV.LINK parent child ...``, pipelined
  in the batch that node receives anyway. On the parent's final drop they are
  sent, batched per owner, as ``KV.CASCADE drop-us key ...`` over the peer
  links; the owner drops them and cascades on. A child of a slot that the
  map shows moving goes to both ends of the move: the source drops it if it
  has not sent it yet, the target if it has it, and a target that has not
  received it yet takes no push of it any more.

Bounded work. Local drops wait in one queue, at most ``DROPS_PER_TICK`` taken
per loop tick (clients are served in between), so a long chain or a FLUSHALL
never stalls the loop. Sends are background tasks, one at a time per peer; a
batch a peer does not take is lost (it is a cache: the blocks stay until
evicted by themselves). The queue and the outgoing batches are capped; a
cascade past a cap is cut short and counted.

Bounded memory. A key keeps at most ``LINKS_PER_KEY`` remote children (a new
link takes the oldest one's place), the node at most ``max_links`` links in
all (more are refused and counted). A key's links go with its final drop and
stay through a re-put of the key (the same content-addressed block has the
same children). Keys received are never forwarded (only a node's own links
are sent), so two nodes that disagree on the map cannot bounce a cascade.

Ordering. A cascade may reach a node after the client found the hole and
wrote the chain again. It carries the time of the drop that started it, and a
node never drops a value committed, or rewritten in place, after that time:
write times of the last ``FRESH_SECONDS`` (for at most one key per 8 KiB of
DRAM) answer that question. Clocks of different hosts differ by
milliseconds; a cascade that loses that race drops a fresh block and the
rest of its chain after it, which costs misses, never a wrong value, and
leaves the chain a prefix.

Slot moves. While a step lasts, a slot's values are on its source, on the
wire, or on its target; both ends act for it (a source drops what it still
holds, a target what it imported; a cascade once acted only for the slots a
node served, and every value a target evicted during a step, or a source was
told to drop, left the rest of its chain behind). Links travel with the moved
values, in the same push (moved_links.py). An imported value counts as no
write for the ordering question (it was written before it moved); a source
whose copy was written after a drop keeps it, and the target, not knowing,
may drop the pushed one: misses, never a wrong value.

A dead node. Its links die with it, so the blocks that followed its blocks on
other nodes would stay, unreachable. So each link is also told to the child's
node (``KV.UPLINK slot child ...``, batched per peer like the cascades): that
node notes the slot of the block before each such child. When a map takes a
slot from a node that left the map without a move (it died: a clean leave
moves its slots in a step first, and their values and links with them), every
node drops the children it noted under that slot, and they cascade on. The notes
share the node's link budget and go with the child's final drop. A note may come
before its child (the batch put reaches the nodes in parallel): it waits, at most
``PENDING_UPLINKS`` of them, the oldest going first, for the child's commit.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from kvstore.cluster.node import ClusterState
from kvstore.cluster.peer import PeerError, PeerReplyError, Peers
from kvstore.cluster.slots import keyslot
from kvstore.cluster.tasks import BackgroundTasks

log = logging.getLogger("kvstore.cluster")

KV_CASCADE = "KV.CASCADE"
KV_UPLINK = "KV.UPLINK"
CASCADE_MAX = 1024          # keys one KV.CASCADE may carry
LINK_KEY_MAX = 1024         # bytes of a child key a link may name
LINKS_PER_KEY = 16          # remote children kept per key
PENDING_UPLINKS = 4096      # notes waiting for their child's commit
LINK_BUDGET_SHARE = 32768   # DRAM bytes per link allowed (about 1/256 of DRAM at ~128 bytes a link) ...
MIN_LINKS = 4096            # ... but never fewer than this
DROPS_PER_TICK = 256        # local drops per loop tick
QUEUE_MAX = 100_000         # local drops waiting
OUTGOING_MAX = 65_536       # keys waiting to be sent to other nodes
FRESH_SECONDS = 5.0         # how long a commit time is kept for the ordering question ...
FRESH_KEYS = (1024, 65_536)  # ... for this many keys at least and at most: one per FRESH_SHARE bytes of DRAM
FRESH_SHARE = 8192


def now_us() -> int:
    """Wall-clock microseconds: comparable between nodes (monotonic clocks are not)."""
    return time.time_ns() // 1000


@dataclass
class Outgoing:
    """Keys waiting for one peer, and the time of the earliest drop among them."""

    since_us: int
    keys: list[bytes] = field(default_factory=list)


@dataclass
class CascadeStats:
    links_displaced: int = 0    # links that made room for a newer one of the same key
    links_refused: int = 0      # links over the node's budget
    dropped: int = 0            # values this node dropped because of a cascade
    sent: int = 0               # keys sent to the other nodes
    send_failures: int = 0      # keys lost with a batch a peer did not take
    kept_fresh: int = 0         # values a cascade found written after its drop
    cut_short: int = 0          # drops and sends over a cap


class Cascade:
    """One node's side of the cascade: its remote links, its drop queue and its outgoing batches."""

    def __init__(self, engine, cluster: ClusterState, peers: Peers):
        self.engine = engine
        self.cluster = cluster
        self.peers = peers
        self.max_links = max(MIN_LINKS, engine.limit // LINK_BUDGET_SHARE)
        self.fresh_keys = min(FRESH_KEYS[1], max(FRESH_KEYS[0], engine.limit // FRESH_SHARE))
        self.children: dict[bytes, list[bytes]] = {}        # own key -> children on other nodes
        self.link_count = 0
        self.uplinks: dict[int, set[bytes]] = {}            # a slot -> own keys whose predecessor lives there
        self.uplink_of: dict[bytes, int] = {}               # own key -> its predecessor's slot (on another node)
        self.up_outgoing: dict[str, list] = {}              # peer address -> [slot, child, ...] to tell it
        self.pending_up: OrderedDict[bytes, int] = OrderedDict()    # a note whose child is not here yet
        self.queue: deque[tuple[bytes, int]] = deque()     # (own key, drop time) to drop here
        self.outgoing: dict[str, Outgoing] = {}            # peer address -> keys to send
        self.outgoing_count = 0
        self.sending: set[str] = set()
        self.commits: OrderedDict[bytes, int] = OrderedDict()   # key -> commit time, recent ones
        self.stats = CascadeStats()
        self.departing: bytes | None = None     # the key a slot move is taking out of the index now
        self._scheduled = False
        self._loop = asyncio.get_running_loop()
        self._tasks = BackgroundTasks()

    def attach(self) -> None:
        """Listen to the engine; commands reach this object as ``cluster.cascade``."""
        self.engine.final_drop_listeners.append(self._on_final_drop)
        self.engine.commit_listeners.append(self._on_commit)
        self.engine.overwrite_listeners.append(self._on_commit)     # a same-size re-put, written in place
        self.cluster.add_listener(self._on_map)
        self.cluster.cascade = self

    # ------------------------------------------------------------ links (KV.LINK)

    def link(self, parent: bytes, child: bytes) -> bool:
        """Record that ``child`` (on another node) follows ``parent`` (here); False when ``parent``
        is not cached, the link is there already, or the node's budget is spent."""
        entry = self.engine.lookup(parent)
        if entry is None or child == parent:
            return False
        key = self.engine.key_of(entry)          # the index's own key object: no second copy
        children = self.children.get(key, [])
        if child in children:
            return False
        if len(children) >= LINKS_PER_KEY:
            children.pop(0)
            self.stats.links_displaced += 1
        elif self.link_count + len(self.uplink_of) >= self.max_links:
            self.stats.links_refused += 1
            return False
        else:
            self.link_count += 1
        children.append(bytes(child))
        self.children[key] = children
        self._tell_child(bytes(child), keyslot(key))
        return True

    # ------------------------------------------------------------ a dead node's links (KV.UPLINK)

    def _tell_child(self, child: bytes, slot: int) -> None:
        """Tell ``child``'s owner that the block before it lives in ``slot``."""
        owner = self.cluster.owner(keyslot(child))
        addr = None if owner is None or owner == self.cluster.my_id else self.cluster.addr_of(owner)
        if addr is None:
            return
        if self.outgoing_count >= OUTGOING_MAX:
            self.stats.cut_short += 1
            return
        self.up_outgoing.setdefault(addr, []).extend((slot, child))
        self.outgoing_count += 1
        self._schedule()

    def uplink(self, slot: int, child: bytes) -> bool:
        """Note that the block before ``child`` lives in ``slot`` on another node; False when it is
        noted already, the link budget is spent, or ``child`` is not here yet (the note then
        waits for its commit)."""
        entry = self.engine.lookup(child)
        if entry is None:
            self.pending_up[child] = slot
            self.pending_up.move_to_end(child)
            if len(self.pending_up) > PENDING_UPLINKS:
                self.pending_up.popitem(last=False)
            return False
        if child in self.uplink_of:
            return False
        if self.link_count + len(self.uplink_of) >= self.max_links:
            self.stats.links_refused += 1
            return False
        key = self.engine.key_of(entry)
        self.uplink_of[key] = slot
        self.uplinks.setdefault(slot, set()).add(key)
        return True

    def _forget_uplink(self, key: bytes) -> None:
        slot = self.uplink_of.pop(key, None)
        if slot is not None:
            noted = self.uplinks[slot]
            noted.discard(key)
            if not noted:
                del self.uplinks[slot]

    def _on_map(self, old, new) -> None:
        """Drop the children noted under the slots a node lost by dying (it left the map with
        no move of the slot), whose blocks before them died with it."""
        gone = {node for node in old.nodes if node not in new.nodes}
        if not gone or not self.uplinks:
            return
        owners, at = old.owner_list, now_us()
        for slot in [s for s in self.uplinks if owners[s] in gone and s not in old.migrating]:
            for key in self.uplinks[slot].copy():
                self._forget_uplink(key)
                self._queue(key, at)

    def link_moved(self, parent: bytes, child: bytes, drop_us: int | None = None) -> bool:
        """A link that came with a slot move's push (KV.IMPORTLINK): recorded as `link` does; when
        ``parent`` is not here because it went since its slot started coming in (evicted, dropped by
        a cascade, deleted, refused: the import guard saw it go), ``child`` goes now instead, as
        the parent's final drop would have sent it had the link come first."""
        if self.link(parent, child):
            return True
        moves = self.cluster.moves
        if moves is not None and self.engine.lookup(parent) is None and moves.went_since_import(parent):
            self._send_later(bytes(child), now_us() if drop_us is None else drop_us)
        return False

    # ------------------------------------------------------------ what the engine tells

    def _on_commit(self, key: bytes, entry: int = -1) -> None:
        """Remember when ``key`` was written (a commit, or a rewrite in place, which commits nothing);
        a value a slot move pushed here was written before, on its source: no write here."""
        if self.pending_up:
            slot = self.pending_up.pop(key, None)
            if slot is not None:
                self.uplink(slot, key)
        moves = self.cluster.moves
        if moves is not None and moves.guard.storing:
            return
        commits, now = self.commits, now_us()
        commits[key] = now
        commits.move_to_end(key)
        oldest = now - int(FRESH_SECONDS * 1e6)
        while len(commits) > self.fresh_keys or next(iter(commits.values())) < oldest:
            commits.popitem(last=False)

    def _on_final_drop(self, entry: int, key: bytes) -> None:
        remote = self.children.pop(key, ())
        self.link_count -= len(remote)
        if self.uplink_of:
            self._forget_uplink(key)
        if key == self.departing:
            self.departing = None
            return              # a value leaving with a slot move: its links went with it (moved_links.py)
        if not self._serves(key):
            return              # a copy of another node's block, or a value of a slot no longer here
        at = now_us()
        engine = self.engine
        for child in engine.eviction.children_of(entry):
            self._queue(engine.key_of(child), at)
        for child in remote:
            self._send_later(child, at)

    # ------------------------------------------------------------ cascades from other nodes (KV.CASCADE)

    def receive(self, drop_us: int, keys) -> int:
        """Queue the drop of the keys this node serves, moves away or takes in (others are ignored:
        never forwarded)."""
        queued = 0
        for key in keys:
            if self._serves(key):
                queued += self._queue(bytes(key), drop_us)
        return queued

    # ------------------------------------------------------------ dropping here

    def _serves(self, key: bytes) -> bool:
        """Whether this node acts for ``key``'s slot: it serves it (moving away or not) or takes it in."""
        slot = keyslot(key)
        return self.cluster.is_mine(slot) or self.cluster.importing_from(slot) is not None

    def _queue(self, key: bytes, drop_us: int) -> bool:
        if len(self.queue) >= QUEUE_MAX:
            self.stats.cut_short += 1
            return False
        self.queue.append((key, drop_us))
        self._schedule()
        return True

    def _schedule(self) -> None:
        if not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self._tick)

    def _tick(self) -> None:
        """One loop tick's share: some queued drops (each may queue more), then the sends."""
        self._scheduled = False
        for _ in range(min(DROPS_PER_TICK, len(self.queue))):
            self._drop_here(*self.queue.popleft())
        self._flush()
        if self.queue:
            self._schedule()

    def _drop_here(self, key: bytes, drop_us: int) -> None:
        if self.commits.get(key, -1) > drop_us:
            self.stats.kept_fresh += 1          # written again after the drop that started this
        elif not self._serves(key):
            return
        elif self.engine.delete(key):
            self.stats.dropped += 1             # its final drop cascades on (the listener above)
        elif self.cluster.moves is not None and self.cluster.importing_from(keyslot(key)) is not None:
            self.cluster.moves.refuse(key)      # still on its way here: take no push of it

    # ------------------------------------------------------------ sending to other nodes

    def _send_later(self, key: bytes, drop_us: int) -> None:
        """Have ``key``'s owner drop it, and the target too while the map shows its slot moving."""
        slot = keyslot(key)
        owner = self.cluster.owner(slot)
        move = self.cluster.map.migrating.get(slot)
        self._send_to(owner, key, drop_us)
        if move is not None and move[1] != owner:
            self._send_to(move[1], key, drop_us)

    def _send_to(self, owner: str | None, key: bytes, drop_us: int) -> None:
        if owner == self.cluster.my_id:
            self._queue(key, drop_us)           # ours, or the map moved the child here
            return
        addr = None if owner is None else self.cluster.addr_of(owner)
        if addr is None:
            return
        if self.outgoing_count >= OUTGOING_MAX:
            self.stats.cut_short += 1
            return
        batch = self.outgoing.get(addr)
        if batch is None:
            batch = self.outgoing[addr] = Outgoing(drop_us)
        batch.since_us = min(batch.since_us, drop_us)   # a key received may carry an earlier drop
        batch.keys.append(key)
        self.outgoing_count += 1
        self._schedule()

    def _flush(self) -> None:
        for addr in {*self.outgoing, *self.up_outgoing} - self.sending:
            batch = self.outgoing.pop(addr, None)
            keys = batch.keys if batch is not None else []
            commands = [(KV_CASCADE, batch.since_us, *keys[i:i + CASCADE_MAX])
                        for i in range(0, len(keys), CASCADE_MAX)]
            up = self.up_outgoing.pop(addr, [])
            commands += [(KV_UPLINK, *up[i:i + 2 * CASCADE_MAX]) for i in range(0, len(up), 2 * CASCADE_MAX)]
            self.outgoing_count -= len(keys) + len(up) // 2
            self.sending.add(addr)
            self._tasks.spawn(self._send(addr, commands, len(keys)))

    async def _send(self, addr: str, commands: list, keys: int) -> None:
        """One peer's commands (its cascade, in commands of at most CASCADE_MAX keys, then the
        links it is told of); lost on an error."""
        try:
            replies = await self.peers.link(addr).pipeline(commands)
            failed = [reply for reply in replies if isinstance(reply, PeerReplyError)]
            if failed:
                raise failed[0]
            self.stats.sent += keys
        except (PeerError, PeerReplyError) as e:
            self.stats.send_failures += keys
            log.debug("A cascade of %d keys to %s was lost: %s", keys, addr, e)
        finally:
            self.sending.discard(addr)
            if addr in self.outgoing or addr in self.up_outgoing:
                self._schedule()

    # ------------------------------------------------------------ INFO and leaving

    @property
    def pending(self) -> int:
        """Drops and sends not done yet (0: every cascade started here has left this node)."""
        return len(self.queue) + self.outgoing_count + len(self.sending)

    def info(self) -> dict[str, int]:
        s = self.stats
        return {"cluster_cascade_links": self.link_count, "cluster_cascade_uplinks": len(self.uplink_of),
                "cluster_cascade_links_displaced": s.links_displaced,
                "cluster_cascade_links_refused": s.links_refused, "cluster_cascade_dropped": s.dropped,
                "cluster_cascade_sent": s.sent, "cluster_cascade_send_failures": s.send_failures,
                "cluster_cascade_kept_fresh": s.kept_fresh, "cluster_cascade_cut_short": s.cut_short,
                "cluster_cascade_pending": self.pending}

    def close(self) -> None:
        """Stop: the engine's later drops (a shutdown's) cascade nothing, and neither do the drops
        and sends still waiting (a tick already scheduled finds nothing to do)."""
        self.engine.final_drop_listeners.remove(self._on_final_drop)
        self.engine.commit_listeners.remove(self._on_commit)
        self.engine.overwrite_listeners.remove(self._on_commit)
        self.cluster.remove_listener(self._on_map)
        self.cluster.cascade = None
        self.queue.clear()
        self.outgoing.clear()
        self.up_outgoing.clear()
        self.pending_up.clear()
        self.outgoing_count = 0
        self._tasks.cancel_all()
