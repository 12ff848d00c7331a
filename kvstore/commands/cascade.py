"""Commands of the eviction cascade across cluster nodes (kvstore/cluster/cascade.py).

- ``KV.LINK parent child [parent child ...]`` (a cluster client, in the batch
  put it sends the parents' node): ``child`` follows ``parent`` in a chain and
  lives on another node, so when ``parent`` goes for good this node tells
  ``child``'s owner to drop it. The parents are the command's keys (routed
  and redirected as any key: ``MOVED`` for a parent of a slot served
  elsewhere); the children are not keys. Replies how many links were
  recorded (a parent not cached here records nothing). At most
  ``KV_LINK_MAX`` links a command and ``LINK_KEY_MAX`` bytes a child key. A
  user restricted to some keys needs write access to the children too (a
  cascade drops them), so a tenant cannot link another tenant's blocks.
- ``KV.CASCADE drop-us key [key ...]`` (node to node): drop these keys, and
  what follows them, unless written after ``drop-us`` (wall-clock
  microseconds of the drop that started the cascade). Replies how many were
  queued (keys this node does not serve are ignored). At most
  ``CASCADE_MAX`` keys a command.
- ``KV.UPLINK slot child [slot child ...]`` (node to node, sent by the node a
  KV.LINK reached): the block before ``child`` (cached here) lives in ``slot``
  on another node; if that node dies, ``child`` is dropped. Replies how many
  were noted. At most ``CASCADE_MAX`` pairs a command.

A standalone node has no cascade: both answer as other cluster commands do
there.
"""
from __future__ import annotations

from kvstore.admin import acl
from kvstore.cluster.cascade import CASCADE_MAX, KV_CASCADE, KV_UPLINK, LINK_KEY_MAX
from kvstore.cluster.slots import SLOTS
from kvstore.commands.args import parse_int
from kvstore.commands.cluster import DISABLED
from kvstore.commands.cluster_data import _from_a_node, links_of
from kvstore.commands.table import CommandError, Family
from kvstore.net.protocol import writer
from proto.wire import KV_LINK

FAMILY = Family()


def _cascade(cluster):
    if cluster is None or cluster.cascade is None:
        raise CommandError(DISABLED)
    return cluster.cascade


@FAMILY.command(KV_LINK, -3, "write fast", "kvcache", "Records that blocks on other nodes follow blocks of this node "
         "in their chains, so they are dropped when these go.", keys=(1, -1, 2), spans_slots=True)
def kv_link(conn, args):
    cascade = _cascade(conn.server.cluster)
    links = links_of(KV_LINK, args)
    if not all(conn.user.may_access(child, acl.WRITE) for _, child in links):
        raise CommandError(acl.NOPERM_KEY, "NOPERM")
    return writer.integer(sum(cascade.link(parent, child) for parent, child in links))


@FAMILY.command(KV_CASCADE, -3, "write fast", "cluster", "Drops blocks whose chain predecessor another node dropped "
         "(between nodes).", keys=(0, 0, 0))
def kv_cascade(conn, args):
    cascade = _cascade(_from_a_node(conn))
    if len(args) - 2 > CASCADE_MAX:
        raise CommandError(f"KV.CASCADE takes at most {CASCADE_MAX} keys, got {len(args) - 2}")
    drop_us = parse_int(args[1], "the drop time must be an integer of microseconds")
    return writer.integer(cascade.receive(drop_us, args[2:]))


@FAMILY.command(KV_UPLINK, -3, "write fast", "cluster", "Notes the slot of the block before each of these blocks, "
         "which another node holds (between nodes).", keys=(0, 0, 0))
def kv_uplink(conn, args):
    cascade = _cascade(_from_a_node(conn))
    pairs = args[1:]
    if len(pairs) % 2:
        raise CommandError("wrong number of arguments for 'kv.uplink' command")
    if len(pairs) // 2 > CASCADE_MAX:
        raise CommandError(f"KV.UPLINK takes at most {CASCADE_MAX} pairs, got {len(pairs) // 2}")
    slots = [parse_int(slot, "a slot must be an integer") for slot in pairs[0::2]]
    if any(not 0 <= slot < SLOTS for slot in slots):
        raise CommandError(f"a slot is between 0 and {SLOTS - 1}")
    children = pairs[1::2]
    if any(len(child) > LINK_KEY_MAX for child in children):
        raise CommandError(f"a linked child key is longer than {LINK_KEY_MAX} bytes")
    return writer.integer(sum(cascade.uplink(slot, bytes(child)) for slot, child in zip(slots, children)))
