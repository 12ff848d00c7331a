"""Cluster commands: CLUSTER (SLOTS, SHARDS, NODES, INFO, KEYSLOT, MYID, ...), READONLY, READWRITE, ASKING.

These are how cluster-aware clients learn the topology (redis-py reads
CLUSTER SLOTS, redis-benchmark and redis-cli read CLUSTER NODES), so replies
are Redis 7's byte for byte: the same fields, order and line endings. The
answers come from the slot map in force (``server.cluster``, a ClusterState);
without ``--cluster`` every one of them answers as a Redis without cluster
support does. The topology is kept in etcd and changed only by the leader, so
the subcommands that edit it in Redis (ADDSLOTS, SETSLOT, MEET, ...) refuse.
There is no cluster bus: nodes report bus port 0 and no links.
"""
from __future__ import annotations

import time

from kvstore.cluster.slots import keyslot
from kvstore.commands.table import CommandError, Family
from kvstore.net.protocol import writer

FAMILY = Family()

DISABLED = "This instance has cluster support disabled"
TOPOLOGY = ("addslots", "addslotsrange", "bumpepoch", "delslots", "delslotsrange", "failover", "flushslots", "forget",
            "meet", "replicate", "reset", "saveconfig", "set-config-epoch", "setslot")
SUBCOMMANDS = {
    "slots": (2, "Returns the mapping of cluster slots to nodes."),
    "shards": (2, "Returns the mapping of cluster slots to shards."),
    "nodes": (2, "Returns the cluster configuration for a node."),
    "info": (2, "Returns information about the state of a node."),
    "keyslot": (3, "Returns the hash slot for a key."),
    "myid": (2, "Returns the ID of a node."),
    "links": (2, "Returns a list of all TCP links to and from peer nodes."),
    "replicas": (3, "Lists the replica nodes of a master node."),
    "slaves": (3, "Lists the replica nodes of a master node."),
    "count-failure-reports": (3, "Returns the number of active failure reports active for a node."),
    "help": (2, "Returns helpful text about the different subcommands."),
    "addslots": (-3, "Assigns new hash slots to a node."),
    "addslotsrange": (-4, "Assigns new hash slot ranges to a node."),
    "bumpepoch": (2, "Advances the cluster config epoch."),
    "delslots": (-3, "Sets hash slots as unbound for a node."),
    "delslotsrange": (-4, "Sets hash slot ranges as unbound for a node."),
    "failover": (-2, "Forces a replica to perform a manual failover of its master."),
    "flushslots": (2, "Deletes all slots information from a node."),
    "forget": (3, "Removes a node from the nodes table."),
    "meet": (-4, "Forces a node to handshake with another node."),
    "replicate": (3, "Configure a node as replica of a master node."),
    "reset": (-2, "Resets a node."),
    "saveconfig": (2, "Forces a node to save the cluster configuration to disk."),
    "set-config-epoch": (3, "Sets the configuration epoch for a new node."),
    "setslot": (-4, "Binds a hash slot to a node."),
}
HELP = ["CLUSTER <subcommand> [<arg> [value] [opt] ...]. Subcommands are:",
        "COUNT-FAILURE-REPORTS <node-id>", "    Return number of failure reports for <node-id> (always 0).",
        "INFO", "    Return information about the cluster.",
        "KEYSLOT <key>", "    Return the hash slot for <key>.",
        "LINKS", "    Return information about links to peers (none: there is no cluster bus).",
        "MYID", "    Return the node id.",
        "NODES", "    Return cluster configuration seen by node. Output format:",
        "    <id> <ip:port@cport> <flags> <master> <pings> <pongs> <epoch> <link> <slot> ...",
        "REPLICAS <node-id>", "    Return <node-id> replicas.",
        "SHARDS", "    Return information about slot range mappings and the nodes associated with them.",
        "SLOTS", "    Return information about slots range mappings. Each range is made of:",
        "    start, end, master and replicas IP addresses, ports and ids",
        "HELP", "    Prints this help.",
        "The topology (nodes, slots, epochs) is kept in etcd and assigned by the cluster's leader."]


def _cluster_of(conn):
    cluster = getattr(conn.server, "cluster", None)
    if cluster is None:
        raise CommandError(DISABLED)
    return cluster


def _host_port(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    return host.strip("[]"), int(port)


@FAMILY.command("CLUSTER", -2, "loading stale", "cluster", "A container for Redis Cluster commands.", keys=(0, 0, 0),
         subcommands=SUBCOMMANDS)
def cluster_(conn, args):
    cluster = _cluster_of(conn)
    sub = args[1].lower().decode()
    if sub in TOPOLOGY:
        raise CommandError(f"CLUSTER {sub.upper()} is not supported: the topology is kept in etcd and the "
                           f"cluster's leader assigns the slots (nodes join with kvstore serve --cluster)")
    if sub == "keyslot":
        return writer.integer(keyslot(args[2]))
    if sub == "myid":
        return writer.bulk(cluster.my_id)
    if sub in ("replicas", "slaves", "count-failure-reports"):
        node_id = args[2].decode(errors="replace")
        if node_id not in cluster.map.nodes:
            raise CommandError(f"Unknown node {node_id}")
        return writer.EMPTY_ARRAY if sub != "count-failure-reports" else writer.ZERO
    if sub == "links":
        return writer.EMPTY_ARRAY
    if sub == "help":
        return writer.array([writer.simple(line) for line in HELP])
    return {"slots": _slots, "shards": _shards, "nodes": _nodes, "info": _info}[sub](conn, cluster)


def _slots(conn, cluster) -> bytes:
    """Per range: ``[first, last, [host, port, id, {}]]`` (no replicas)."""
    slot_map, ranges = cluster.map, []
    for first, last, node_id in slot_map.ranges:
        host, port = _host_port(slot_map.nodes[node_id])
        node = writer.array([writer.bulk(host), writer.integer(port), writer.bulk(node_id), conn.enc.map([])])
        ranges.append(writer.array([writer.integer(first), writer.integer(last), node]))
    return writer.array(ranges)


def _shards(conn, cluster) -> bytes:
    """One shard per node: its slot ranges flattened, and the node as a one-element list."""
    b, slot_map, shards = writer.bulk, cluster.map, []
    for node_id, addr in slot_map.nodes.items():
        host, port = _host_port(addr)
        bounds = [writer.integer(n) for pair in slot_map.ranges_of(node_id) for n in pair]
        node = conn.enc.map([(b("id"), b(node_id)), (b("port"), writer.integer(port)), (b("ip"), b(host)),
                             (b("endpoint"), b(host)), (b("role"), b("master")),
                             (b("replication-offset"), writer.integer(0)), (b("health"), b("online"))])
        shards.append(conn.enc.map([(b("slots"), writer.array(bounds)), (b("nodes"), writer.array([node]))]))
    return writer.array(shards)


def _nodes(conn, cluster) -> bytes:
    slot_map = cluster.map
    nodes = dict(slot_map.nodes)
    nodes.setdefault(cluster.my_id, cluster.announce)       # a node always knows itself
    now_ms = int(time.time() * 1000)
    lines = []
    for node_id, addr in nodes.items():
        mine = node_id == cluster.my_id
        slots = "".join(f" {s}" if s == e else f" {s}-{e}" for s, e in slot_map.ranges_of(node_id))
        if mine:
            slots += _moves(cluster)
        lines.append(f"{node_id} {addr}@0 {'myself,master' if mine else 'master'} - 0 {0 if mine else now_ms} "
                     f"{slot_map.epoch} connected{slots}\n")
    return conn.enc.verbatim("".join(lines))


def _moves(cluster) -> str:
    """Redis's ``[slot->-target]`` / ``[slot-<-source]`` marks, shown on the node's own line."""
    marks = []
    for slot, (source, target) in sorted(cluster.map.migrating.items()):
        if source == cluster.my_id:
            marks.append(f" [{slot}->-{target}]")
        elif target == cluster.my_id:
            marks.append(f" [{slot}-<-{source}]")
    return "".join(marks)


def _info(conn, cluster) -> bytes:
    slot_map = cluster.map
    serving = sum(1 for count in slot_map.counts.values() if count)
    fields = [("cluster_state", "ok" if cluster.ok else "fail"), ("cluster_slots_assigned", slot_map.assigned),
              ("cluster_slots_ok", slot_map.assigned), ("cluster_slots_pfail", 0), ("cluster_slots_fail", 0),
              ("cluster_known_nodes", len(slot_map.nodes.keys() | {cluster.my_id})), ("cluster_size", serving),
              ("cluster_current_epoch", slot_map.epoch), ("cluster_my_epoch", slot_map.epoch),
              ("cluster_stats_messages_sent", 0), ("cluster_stats_messages_received", 0),
              ("total_cluster_links_buffer_limit_exceeded", 0)]
    return conn.enc.verbatim("".join(f"{name}:{value}\r\n" for name, value in fields))


@FAMILY.command("READONLY", 1, "fast loading stale", "cluster", "Enables read-only queries for a connection to a "
         "Redis Cluster replica node.", keys=(0, 0, 0))
def readonly(conn, args):
    _cluster_of(conn)
    conn.redirects.readonly = True
    return writer.OK


@FAMILY.command("READWRITE", 1, "fast loading stale", "cluster", "Enables read-write queries for a connection to a "
         "Redis Cluster replica node.", keys=(0, 0, 0))
def readwrite(conn, args):
    _cluster_of(conn)
    conn.redirects.readonly = False
    return writer.OK


@FAMILY.command("ASKING", 1, "fast", "cluster", "Signals that a cluster client is following an -ASK redirect.",
         keys=(0, 0, 0))
def asking(conn, args):
    _cluster_of(conn)
    conn.redirects.asking = True
    return writer.OK
