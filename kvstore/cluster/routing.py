"""Whether this node serves a keyed command, decided as Redis Cluster decides it.

`redirect` is Redis's getNodeByQuery/clusterRedirectClient for one command's
keys: it returns None when the command runs here, or the exact error reply a
Redis Cluster node gives (MOVED, ASK, CROSSSLOT, TRYAGAIN, CLUSTERDOWN), in
Redis's order of checks:

1. the first key's slot has no owner: ``CLUSTERDOWN Hash slot not served``;
2. keys in different slots: ``CROSSSLOT``;
3. the map does not cover every slot: ``CLUSTERDOWN The cluster is down``;
4. the slot is moving away from this node and some key is not here (any more):
   ``ASK slot target``;
5. the slot is moving to this node and the client sent ASKING: served here,
   unless several keys are asked and some are not here yet (``TRYAGAIN``);
6. another node owns the slot: ``MOVED slot host:port``.

The host in MOVED/ASK is the announced host exactly as CLUSTER SLOTS reports
it, since clients match the two strings.
"""
from __future__ import annotations

from collections.abc import Callable

from kvstore.cluster.node import ClusterState
from kvstore.cluster.slots import keyslot
from kvstore.net.protocol import writer

SLOT_NOT_SERVED = writer.error("Hash slot not served", "CLUSTERDOWN")
CLUSTER_DOWN = writer.error("The cluster is down", "CLUSTERDOWN")
CROSSSLOT = writer.error("Keys in request don't hash to the same slot", "CROSSSLOT")
TRYAGAIN = writer.error("Multiple keys request during rehashing of slot", "TRYAGAIN")


def redirect(cluster: ClusterState, keys: list[bytes], asking: bool,
             has_key: Callable[[bytes], bool]) -> bytes | None:
    """None when this node runs the command, else the error reply to send.

    ``keys`` are the command's key arguments (none: it runs here); ``asking``
    is the connection's ASKING flag; ``has_key(key)`` says whether the key is
    stored here (asked only while the slot is moving).
    """
    if not keys:
        return None
    slot = keyslot(keys[0])
    if cluster.owner(slot) is None:
        return SLOT_NOT_SERVED
    for key in keys[1:]:
        if keyslot(key) != slot:
            return CROSSSLOT
    return redirect_slot(cluster, slot, keys, asking, has_key)


def redirect_slot(cluster: ClusterState, slot: int, keys: list[bytes], asking: bool,
                  has_key: Callable[[bytes], bool]) -> bytes | None:
    """`redirect` for keys already known to share ``slot`` (a command that spans
    slots groups its keys once and asks per group, hashing each key once)."""
    owner = cluster.owner(slot)
    if owner is None:
        return SLOT_NOT_SERVED
    if not cluster.ok:
        return CLUSTER_DOWN
    target, source = cluster.migrating_to(slot), cluster.importing_from(slot)
    if target is not None or source is not None:
        missing = sum(1 for key in keys if not has_key(key))
        if target is not None and missing:
            return _redirection("ASK", slot, cluster.addr_of(target))
        if source is not None and asking:
            return TRYAGAIN if missing and len(set(keys)) > 1 else None
    if owner != cluster.my_id:
        return _redirection("MOVED", slot, cluster.addr_of(owner))
    return None


def _redirection(kind: str, slot: int, addr: str) -> bytes:
    return b"-%s %d %s\r\n" % (kind.encode(), slot, addr.encode())
