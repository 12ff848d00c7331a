"""Command families, grouped as Redis groups them; importing this package
fills the command table (`table.TABLE`)."""
from kvstore.commands import counters, keyspace, kvcache, lcs, renames, server, strings, transactions  # noqa: F401  (they register themselves)
from kvstore.commands import fastpath  # noqa: F401  (local fast path: leases, reservations)
from kvstore.commands import layers  # noqa: F401  (layer-wise blocks)
from kvstore.commands import diagnostics  # noqa: F401  (SLOWLOG; LATENCY, as Redis with its monitor off)
from kvstore.commands import cluster  # noqa: F401  (CLUSTER, READONLY, READWRITE, ASKING)
from kvstore.commands import cluster_data  # noqa: F401  (node-to-node copies and moves, KV.HOTKEYS)
from kvstore.commands import cascade  # noqa: F401  (cluster: KV.LINK, KV.CASCADE)
from kvstore.commands import acl  # noqa: F401  (AUTH and the ACL container)
from kvstore.commands.table import TABLE, Command, CommandError, lookup

__all__ = ["TABLE", "Command", "CommandError", "lookup"]
