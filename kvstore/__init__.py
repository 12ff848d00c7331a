"""kvstore: a KV-cache store daemon for LLM serving that speaks the Redis protocol.

`kvstore serve` runs a node. The rooms, each a package whose docstring lists its files:

net/       the network front: server (accept loop, cron, shutdown; builds the node),
           connection (+ client_state), protocol/ (RESP reader and writer), tls, client_pause
commands/  the command table, dispatch, and the command families as Redis groups them
store/     the index and DRAM: engine (writes, reads; owns holds, pins, expiry), entries
           (the index's columns), eviction, holds, pins, expiry, deadlines, allocator,
           arena, watch; knows nothing of RESP
tiers/     below DRAM: the tier manager (manager), index moves (moves), gpu, ssd
local/     what local clients share: leases, shared_index, layers
cluster/   hash slots over etcd: slot map, membership, routing, copies, migration
admin/     config, live_config, acl, info, metrics, slowlog
cli.py     the `kvstore` command line (serve, cluster, conductor, ...), the one door up

Words: a *block* is one block key's KV value; a *chain link* is its parent key; an
*entry* is a key's row in the index; a *hash slot* is one of Redis Cluster's
16,384 key ranges; an *extent* is a piece of an arena; a *hold* keeps an extent in
place while the node reads it; a *lease* is a local client's; a *tier* is where a
value lives (GPU, DRAM, SSD).

The path of a value through the node
------------------------------------
SET (a big value):
  net/server accepts the socket and makes a `Connection` (net/connection);
  net/protocol/reader parses the request and stops at the value's bulk header; the
  connection asks commands/dispatch.value_destination for a place and hands it to
  the reader (calls only go forward): engine.reserve carves an extent
  of the arena (store/allocator, store/arena), so the socket receives the value
  straight into it (recv_into, in the same loop turn when it is already there);
  dispatch.dispatch looks the command up once in commands/table, checks arity, auth
  and ACL (admin/acl), the cluster's slot map (cluster/routing), queues it inside
  MULTI, and runs commands/strings.set_ through dispatch._execute, where every
  command runs (a plain ``SET key value`` skips those checks when none can matter:
  dispatch.run_plain), which commits the extent
  (commands/args.store -> engine.commit): the index entry, its columns
  (store/entries), the eviction policy's lists (store/eviction) and the tier
  manager's listener (tiers/manager) learn of it; "+OK" goes to the connection's
  reply buffer and out with one send.
GET:
  dispatch asks the tier manager whether the value must first come up from SSD or
  GPU (the client waits, its later commands queued, while a worker thread copies it
  into DRAM); commands/strings.get finds the entry (engine.get_entry, which refreshes
  recency) and connection.write_value copies the value into the reply buffer while a
  few MiB are queued for the client, else queues a memoryview of the arena under a
  hold, released when the kernel has taken its last byte (sendmsg).
A local client skips both copies: it maps the arena (KV.ARENA, fd passed over the
Unix socket), finds the value in the shared index and copies it with no round trip
(local/shared_index), or else copies under a lease (commands/fastpath, local/leases).
"""

__version__ = "0.1.0"
