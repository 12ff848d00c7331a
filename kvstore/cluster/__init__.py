"""Cluster mode: hash slots over etcd membership.

`slots` (keyslot, the slot map), `mapchange` (the binary record
of a map's change that reaches every node), `assign` (the leader's even assignment),
`kv` (the part of etcd's API membership uses, with the real client in
`etcd_kv` and an in-process fake in `fake_etcd`), `membership` (leases,
election, the watched map), `node` (the ClusterState a server holds),
`routing` (MOVED/ASK/CROSSSLOT decisions), `runner` (start and stop from a
server), `services` (what a node runs on top: `peer` links to the other
nodes, `replication`, `heat` and `held_copies` for hot-block copies, `migration` for
values moving with their slots), `subcommand` (`kvstore cluster up|status`),
`etcd_server` (a throwaway etcd process), `simclock` (virtual time for
in-process simulations).
"""
