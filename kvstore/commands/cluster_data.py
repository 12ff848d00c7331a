"""Commands nodes send each other to move values (copies of hot blocks, slot moves), and KV.HOTKEYS.

Node to node (kvstore/cluster/replication.py and migration.py send them
through peer.py):

- ``KV.COPY owner lease-ms key value [key value ...]``: keep copies of
  ``owner``'s hot blocks, served to READONLY readers for ``lease-ms``;
  replies how many were kept (none of a slot ``owner`` does not own here).
- ``KV.UNCOPY key [key ...]``: remove copies; replies how many were here.
- ``KV.RENEW owner lease-ms key [key ...]``: extend the copies' leases;
  replies, per key, the reads its copy served since the last renewal (-1:
  no such copy here).
- ``KV.IMPORT epoch key parent tenant value [key parent tenant value ...]``:
  values of a slot moving here (or copies of a dead owner's blocks), pushed
  by a node whose map is at ``epoch``, stored only where no newer write was
  made here; ``parent`` is the chain parent or empty, ``tenant`` the name of
  the ACL user whose quota the value counts against or empty (the shared
  pool; kvstore/store/quotas.py); replies ``[keys stored, bytes stored]``,
  or ``-TRYAGAIN`` while this node's map is older.
- ``KV.IMPORTLINK parent child [parent child ...]``: right after a
  KV.IMPORT, in its pipeline, the chain links of the values it pushed:
  ``child`` follows ``parent``, so the cascade drops it when ``parent``
  goes (kvstore/cluster/moved_links.py). Unlike KV.LINK, a client's, it is
  not routed: the parents belong to slots still coming in. Replies how many
  were recorded (a parent not stored here records nothing; one that went
  here since its slot started coming in has its children dropped instead). At most
  ``KV_LINK_MAX`` links a command and ``LINK_KEY_MAX`` bytes a child key.
- ``KV.MIGRATED node-id epoch``: to the leader, ``node-id`` pushed what it
  could of the step map at ``epoch``.
- ``KV.DRAIN node-id``: to the leader, move ``node-id``'s slots to the
  others; replies how many nodes take them (0: none, leave at once).

They carry no key positions (``keys=(0, 0, 0)``), so the slot routing that
would redirect a client does not touch them; instead they run only in a
cluster, for a connection from a node's announced host (or the Unix socket),
after the usual authentication (nodes use the cluster's shared password).

For readers: ``KV.HOTKEYS [version]`` is the hot-key map of the keys this
node owns and replicates: ``[version, [[key, [host:port, ...]], ...]]``,
or nil when ``version`` is the map's current version, so a client can poll
it cheaply and spread its reads of those keys over the owner and the copies.
"""
from __future__ import annotations

from kvstore.cluster.cascade import LINK_KEY_MAX
from kvstore.cluster.migration import KV_DRAIN, KV_IMPORT, KV_MIGRATED
from kvstore.cluster.moved_links import KV_IMPORTLINK
from kvstore.cluster.replication import KV_COPY, KV_RENEW, KV_UNCOPY
from kvstore.commands.args import SYNTAX, parse_int, store
from kvstore.commands.cluster import DISABLED
from kvstore.commands.table import CommandError, Family
from kvstore.net.protocol import writer
from kvstore.store.arena import Extent
from proto.wire import KV_HOTKEYS, KV_LINK_MAX

FAMILY = Family()

MAX_LEASE_MS = 3_600_000


def _cluster(conn):
    cluster = conn.server.cluster
    if cluster is None or cluster.copies is None:
        raise CommandError(DISABLED)
    return cluster


def _from_a_node(conn):
    """The cluster, for a connection that comes from one of its nodes' hosts (or the Unix socket)."""
    cluster = _cluster(conn)
    if conn.addr.startswith("/"):
        return cluster
    host = conn.addr.rpartition(":")[0]
    announced = {addr.rpartition(":")[0].strip("[]") for addr in (*cluster.map.nodes.values(),
                                                                  *cluster.nodes.values())}
    if host not in announced:
        raise CommandError("only the cluster's nodes may send this command", "NOPERM")
    return cluster


def _lease_ms(arg: bytes) -> int:
    lease = parse_int(arg)
    if not 0 < lease <= MAX_LEASE_MS:
        raise CommandError(f"lease must be between 1 and {MAX_LEASE_MS} milliseconds")
    return lease


def _size(value) -> int:
    return value.size if isinstance(value, Extent) else len(value)


@FAMILY.command(KV_COPY, -5, "write denyoom", "cluster", "Keeps copies of an owner's hot blocks (between nodes).",
         keys=(0, 0, 0), values=lambda i: i >= 4 and i % 2 == 0)
def kv_copy(conn, args):
    cluster = _from_a_node(conn)
    if len(args) % 2 == 0:
        raise CommandError(SYNTAX)
    owner, lease = args[1].decode(errors="replace"), _lease_ms(args[2])
    kept = sum(cluster.copies.held.store(owner, lease, args[i], args[i + 1], lambda k, v: store(conn, k, v))
               for i in range(3, len(args), 2))
    return writer.integer(kept)


@FAMILY.command(KV_UNCOPY, -2, "write fast", "cluster", "Removes copies of hot blocks (between nodes).", keys=(0, 0, 0))
def kv_uncopy(conn, args):
    held = _from_a_node(conn).copies.held
    return writer.integer(sum(held.drop(key) for key in args[1:]))


@FAMILY.command(KV_RENEW, -4, "write fast", "cluster", "Extends the leases of copies of hot blocks and returns "
         "their reads (between nodes).", keys=(0, 0, 0))
def kv_renew(conn, args):
    held = _from_a_node(conn).copies.held
    reads = held.renew(args[1].decode(errors="replace"), _lease_ms(args[2]), args[3:])
    return writer.array([writer.integer(n) for n in reads])


@FAMILY.command(KV_IMPORT, -6, "write denyoom", "cluster", "Stores values of a slot moving to this node, never "
         "over a newer write (between nodes).", keys=(0, 0, 0), values=lambda i: i > 1 and i % 4 == 1)
def kv_import(conn, args):
    cluster = _from_a_node(conn)
    if (len(args) - 2) % 4:
        raise CommandError(SYNTAX)
    epoch = parse_int(args[1])
    if epoch > cluster.map.epoch:
        raise CommandError(f"slot map epoch {epoch} is not applied here yet", "TRYAGAIN")
    moves = cluster.moves
    keys = size = 0
    tenants = conn.engine.quotas
    with moves.storing():
        for i in range(2, len(args), 4):
            key, parent, tenant, value = args[i:i + 4]
            if moves.accepts(key):
                store(conn, key, value, parent or None, owner=tenants.named(tenant or None))
                entry = conn.engine.lookup(key)
                if entry is not None:
                    moves.stamp_import(epoch, entry)
                keys += 1
                size += _size(value)
    moves.count_import(keys, size)
    return writer.array([writer.integer(keys), writer.integer(size)])


@FAMILY.command(KV_IMPORTLINK, -3, "write fast", "cluster", "Records the chain links of values a slot move "
         "pushed here (between nodes).", keys=(0, 0, 0))
def kv_importlink(conn, args):
    cascade = _from_a_node(conn).cascade
    if cascade is None:
        raise CommandError(DISABLED)
    return writer.integer(sum(cascade.link_moved(parent, child) for parent, child in links_of(KV_IMPORTLINK, args)))


def links_of(name: str, args: list) -> list[tuple[bytes, bytes]]:
    """The (parent, child) pairs a KV.LINK or KV.IMPORTLINK carries, checked: whole pairs,
    at most KV_LINK_MAX of them, child keys of at most LINK_KEY_MAX bytes."""
    parents, children = args[1::2], args[2::2]
    if len(parents) != len(children):
        raise CommandError(SYNTAX)
    if len(children) > KV_LINK_MAX:
        raise CommandError(f"{name} takes at most {KV_LINK_MAX} links, got {len(children)}")
    if any(len(child) > LINK_KEY_MAX for child in children):
        raise CommandError(f"a linked child key is longer than {LINK_KEY_MAX} bytes")
    return list(zip(parents, children))


@FAMILY.command(KV_MIGRATED, 3, "admin fast", "cluster", "Tells the leader a node finished its part of a slot "
         "move (between nodes).", keys=(0, 0, 0))
def kv_migrated(conn, args):
    cluster = _from_a_node(conn)
    cluster.moves_done(args[1].decode(errors="replace"), parse_int(args[2]))
    return writer.OK


@FAMILY.command(KV_DRAIN, 2, "admin fast", "cluster", "Asks the leader to move a node's slots to the others "
         "(between nodes).", keys=(0, 0, 0))
def kv_drain(conn, args):
    taking = _from_a_node(conn).drain_node(args[1].decode(errors="replace"))
    if taking is None:
        raise CommandError("this node is not the cluster's leader", "NOTLEADER")
    return writer.integer(taking)


@FAMILY.command(KV_HOTKEYS, -1, "readonly fast", "kvcache", "Returns the hot blocks this node owns and the nodes "
         "holding their copies; nil when the given version is current.", keys=(0, 0, 0))
def kv_hotkeys(conn, args):
    copies = _cluster(conn).copies
    if len(args) > 2:
        raise CommandError(SYNTAX)
    if len(args) == 2 and parse_int(args[1]) == copies.version:
        return conn.enc.null
    entries = [writer.array([writer.bulk(key), writer.bulk_array(addrs)]) for key, addrs in copies.hot_map()]
    return writer.array([writer.integer(copies.version), writer.array(entries)])
