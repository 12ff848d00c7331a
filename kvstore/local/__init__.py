"""What local clients share with the node: the arena, leases and the shared index.

`leases` (leases and reservations a local client holds while it copies through the
arena), `shared_index` (where each DRAM value is, published in shared memory so a
get needs no round trip), `layers` (blocks written layer by layer while readers wait).
"""
