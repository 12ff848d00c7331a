"""The command families a node serves, listed once: the command table is built from them.

Each family module declares its commands on its own `Family`; nothing registers
itself by being imported. The server builds one `CommandTable` from this list and
hands it to dispatch (through the connection) and to ACL (as its catalog).
"""
from __future__ import annotations

from kvstore.commands import (acl, cascade, cluster, cluster_data, counters, diagnostics, fastpath, keyspace,
                              kvcache, layers, lcs, renames, server, strings, transactions)
from kvstore.commands.table import CommandTable, Family

FAMILIES: tuple[Family, ...] = (
    counters.FAMILY, keyspace.FAMILY, kvcache.FAMILY, lcs.FAMILY, renames.FAMILY, server.FAMILY,
    strings.FAMILY, transactions.FAMILY,
    fastpath.FAMILY,        # the local fast path: leases, reservations
    layers.FAMILY,          # layer-wise blocks
    diagnostics.FAMILY,     # SLOWLOG; LATENCY, as Redis with its monitor off
    cluster.FAMILY,         # CLUSTER, READONLY, READWRITE, ASKING
    cluster_data.FAMILY,    # node-to-node copies and moves, KV.HOTKEYS
    cascade.FAMILY,         # cluster: KV.LINK, KV.CASCADE
    acl.FAMILY,             # AUTH and the ACL container
)


def build_table() -> CommandTable:
    return CommandTable(FAMILIES)
