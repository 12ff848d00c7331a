"""Wire constants of the local fast path and of layer-wise blocks.

The store's command modules and the client SDK both import these, so each
command name, default and limit is spelled once (as `proto.wire` does for
the core KV commands).
"""
import xxhash

# Shared-memory fast path (kvstore/commands/fastpath.py, client/fastpath.py).
KV_ARENA = "KV.ARENA"            # map the DRAM arena: fd passing or /proc/<pid>/fd/<n>
KV_LEASE = "KV.LEASE"            # pin values for a direct read
KV_RELEASE = "KV.RELEASE"        # unpin; says whether each lease was still valid
KV_RESERVE = "KV.RESERVE"        # an extent for a direct write
KV_PUBLISH = "KV.PUBLISH"        # commit a written reservation under a key
KV_MPUBLISH = "KV.MPUBLISH"      # commit several (a batch), one command
KV_UNRESERVE = "KV.UNRESERVE"    # give back reservations never published
KV_LEASES = "KV.LEASES"          # lease, reservation and partial-block counters
KV_GPUARENA = "KV.GPUARENA"      # the GPU tier's CUDA IPC handle
KV_LEASEGPU = "KV.LEASEGPU"      # pin values where they live, GPU included
KV_TOUCH = "KV.TOUCH"            # reads served from the shared index count as hits

# Layer-wise blocks (kvstore/commands/layers.py, client/layers.py).
KV_BLOCK = "KV.BLOCK"            # open a partial block of n equal layer slots
KV_PUTLAYER = "KV.PUTLAYER"      # write one layer over the wire
KV_LAYERDONE = "KV.LAYERDONE"    # a layer written through the arena is complete
KV_GETLAYERS = "KV.GETLAYERS"    # read a range of layers over the wire (may wait)
KV_LEASELAYERS = "KV.LEASELAYERS"  # lease a range of layers for a direct read (may wait)

LEASE_TTL_MS = 5000              # default life of a read lease
RESERVATION_TTL_MS = 30000       # default life of a write reservation
PARTIAL_TIMEOUT_MS = 30000       # an unfinished block with no progress this long is dropped
MAX_TTL_MS = 600000
VALIDITY_WORDS = 65536           # live leases with a validity word per node (8 bytes each, shared)

# The shared index (kvstore/local/shared_index.py writes it, client/shared_index.py reads it): a memfd
# passed with KV.ARENA, an array of buckets in sets of INDEX_WAYS; a key's set is its index hash
# modulo the number of sets (a power of two). A bucket is INDEX_BUCKET_BYTES: four little-endian
# u64 words, then the key's bytes.
INDEX_WAYS = 8
INDEX_BUCKET_BYTES = 128
INDEX_BUCKET_WORDS = INDEX_BUCKET_BYTES // 8
INDEX_SEQ, INDEX_HASH, INDEX_OFFSET, INDEX_SIZE = 0, 1, 2, 3   # word 3: value size | key length << 32
INDEX_KEY_AT = 32                # the key's bytes start here in the bucket
INDEX_KEY_MAX = INDEX_BUCKET_BYTES - INDEX_KEY_AT              # longer keys are never published
INDEX_SEED = 0x6B7673696E646578  # b"kvsindex"
# A value only on SSD is published with INDEX_ON_SSD set in its offset word and, below it, its
# tag: the low 63 bits of the xxh3-64 of its uncompressed RocksDB payload. A local client reads
# the payload from the SSD directory KV.ARENA names (RocksDB's column family SSD_VALUE_CF) and
# trusts it only if it hashes to the tag.
INDEX_ON_SSD = 1 << 63
INDEX_TAG_MASK = INDEX_ON_SSD - 1
SSD_VALUE_CF = "value"


def index_hash(key: bytes) -> int:
    """The 64-bit hash that places ``key`` in the shared index; never 0 (an empty bucket)."""
    return xxhash.xxh3_64_intdigest(key, INDEX_SEED) or 1


def ssd_tag(payload) -> int:
    """The tag of a plain SSD payload (0: the value cannot be published)."""
    return xxhash.xxh3_64_intdigest(payload) & INDEX_TAG_MASK

# The header that opens every tensor value and layer-wise block (128 bytes, little-endian):
#   magic "KVT1", u32 n_layers, u64 bytes per layer, 16-byte dtype name (NUL padded),
#   u32 ndim, u32 flags, 8 x i64 shape of one layer, then zero padding.
# The node reads only the magic and the geometry; the SDK reads the rest.
HEADER_MAGIC = b"KVT1"
HEADER_SIZE = 128
HEADER_FORMAT = "<4sIQ16sII8q"
MAX_NDIM = 8
FLAG_LAYERED = 1                 # the value is n_layers slots (get_tensor adds a leading axis)
