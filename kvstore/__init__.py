"""kvstore: a KV-cache store daemon for LLM serving that speaks the Redis protocol.

`kvstore serve` runs a node; README.md has the layout of this package.

Words, each with one meaning
----------------------------
block        a KV block: the attention keys and values of one run of ``block_tokens``
             tokens of a prompt, stored as the value of one block key (optionally laid
             out as ``n_layers`` equal layer slices behind a 128-byte header).
chain link   a block's parent key (``KV.PUT ... PARENT p``): eviction takes leaves only,
             so what stays cached of a prompt is a prefix. Links come from clients and
             are never trusted to form a tree.
entry slot   the small integer a key maps to in the node's index (`Engine.index`); its
             facts (tier, offset, size) sit in columns indexed by it (`slots.py`).
hash slot    one of Redis Cluster's 16,384 key ranges (`proto/slots.py`); a cluster
             node serves some of them (`cluster/`). Never an index entry.
extent       a piece of the DRAM arena (or of the GPU tier's), carved by the buddy
             allocator in power-of-two chunks.
hold         a read in flight on the node's own behalf (a big reply being sent, a copy to
             SSD): the extent stays put until the hold is released (`holds.py`).
lease        what a local client holds while it copies through the shared arena
             (``KV.LEASE``), with an id, an owner, a deadline and a validity word
             (`leases.py`).
reservation  an uncommitted extent a local client writes into (``KV.RESERVE``), committed
             by ``KV.PUBLISH``.
shared index where each DRAM value is (key, offset, size), published in shared memory for
             local clients so a get needs no round trip (`shared_index.py`).
pin          a soft pin (``KV.PIN``): the block is evicted last, and the pin expires.
tier         where a value lives: GPU, DRAM (the arena) or SSD (RocksDB); hot values move
             up, cold ones down (`tiering.py`).
copy         (cluster) a hot block's value on a node that does not own its hash slot;
             copies go first under memory pressure.

The path of a value through the node
------------------------------------
SET (a big value):
  server.py accepts the socket and makes a `Connection` (connection.py);
  protocol/reader.py parses the request and, at the value's bulk header, asks
  dispatch.value_destination for a place: engine.reserve carves an extent of the
  arena (allocator.py, arena.py), so the socket receives the value straight into
  it (recv_into, in the same loop turn when the value is already there);
  dispatch.dispatch looks the command up once in
  commands/table.py, checks arity, auth and ACL (acl.py), the cluster's slot map
  (cluster/routing.py), queues it inside MULTI, and runs commands/strings.set_
  (a plain ``SET key value`` skips those checks when none can matter:
  dispatch.run_plain), which commits the extent (commands/args.store -> engine.commit): the index
  entry, its columns (slots.py), the eviction policy's lists (eviction.py) and the
  tier manager's listener (tiering.py) learn of it; "+OK" goes to the
  connection's reply buffer and out with one send.
GET:
  dispatch asks the tier manager whether the value must first come up from SSD
  or GPU (the client waits, its later commands queued, while a worker thread
  copies it into DRAM); commands/strings.get finds the entry (engine.get_slot,
  which refreshes recency) and connection.write_value copies the value into the
  reply buffer while a few MiB are queued for the client, else queues a
  memoryview of the arena under a hold, released when the kernel has taken its
  last byte (sendmsg).
A local client skips both copies: it maps the arena (KV.ARENA, fd passed over
the Unix socket), finds the value in the shared index and copies it with no
round trip (shared_index.py), or else copies under a lease (commands/fastpath.py,
leases.py).
"""

__version__ = "0.1.0"
