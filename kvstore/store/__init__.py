"""The store's memory and index: what a key maps to and where its bytes sit in DRAM.

`engine` (the key index, reserve/commit, eviction under pressure; it owns the
next three), `holds` (reads in flight that keep an extent in place), `pins`
(KV.PIN soft pins and their deadlines), `expiry` (TTLs and the active expiry
cycle), `deadlines` (the keys with a TTL, sampleable in O(samples)), `entries`
(the index's columns), `eviction` (approximate LRU over chain leaves),
`allocator` (the buddy allocator), `slabs` (size classes in pages carved by it),
`room` (eviction that frees what a write needs, bounded per loop turn), `quotas`
(tenants' shares of DRAM and SSD, and whom eviction spares), `arena` (the
shared-memory DRAM arena), `watch` (WATCH's touched-key signal). Nothing here
knows RESP.
"""
