"""The on-SSD record: a small header that describes a value, and its payload.

A value is stored as two pieces under the same key: the *header* (this
module's :class:`RecordHeader`, ~30 bytes plus the parent key) and the
*payload* (the value's bytes, possibly transformed). Keeping them apart lets
a warm restart rebuild the index by reading headers only, never payloads.

Header layout, little-endian (``HEADER``)::

    magic     2s  b"KV"        rejects anything that is not a record
    version   B   2            bumped when the layout changes
    flags     B   Flags        LZ4 | SHUFFLE; unknown bits are rejected
    plen      H                length of the parent key (0: no parent)
    value_sz  Q                length of the value as the client sent it
    stored_sz Q                length of the payload on disk
    checksum  Q                xxh3-64 of the payload on disk
    tlen      B                length of the tenant's name (0: the shared pool)
    parent    plen bytes       the chain parent's key
    tenant    tlen bytes       the ACL user whose quota the value counts against

Version 1 records (no ``tlen``, no tenant: the shared pool) are still read.
The tenant is stored by name, not by the node's id for it: ids are given per
process (kvstore/store/quotas.py), names are what a restart can match.

The checksum covers the payload exactly as stored, so a read verifies before
it spends any time decompressing. A flipped bit in the payload, the checksum
or either size is caught (a size by the length check, the decompressor or the
header's own consistency rules); only the parent key and the tenant are not covered.

Why compression is per value and guarded: KV tensors in fp16/bf16 are close
to noise and lz4 saves nothing on them (ratio 1.00), while some values
(text, sparse tensors, bf16 after byte-shuffling) do compress. The encoder
first compresses a 16 KiB sample, plain and byte-shuffled, and compresses the
whole value only when the sample saved enough; the compressed form is kept
only when it is smaller than ``KEEP_RATIO`` of the value. Incompressible
values thus cost one small probe, not a full pass.

Byte-shuffle groups the low bytes of every 2-byte element, then the high
bytes (sign and exponent of fp16/bf16, which repeat a lot). It is a strided
numpy copy each way, and applies only to values of even length.
"""
from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

import lz4.block
import numpy as np
import xxhash

from kvstore.tiers import CorruptValue, TierError
from proto import fastpath as fp

MAGIC = b"KV"
VERSION = 2
HEADER = struct.Struct("<2sBBHQQQB")
HEADER_V1 = struct.Struct("<2sBBHQQQ")      # before the tenant: read, never written
MAX_PARENT_LEN = 0xFFFF
MAX_TENANT_LEN = 0xFF
PROBE_BYTES = 16 * 1024
KEEP_RATIO = 0.95


class Flags(enum.IntFlag):
    NONE = 0
    LZ4 = 1        # payload is the (possibly shuffled) value in lz4's raw format
    SHUFFLE = 2    # value was byte-shuffled as 2-byte elements before lz4


# The flag combinations a record may carry, by their stored bits (shuffling is
# only ever done for lz4). A dict lookup is also much cheaper than IntFlag
# arithmetic, which matters when a restart parses 100,000 headers.
LZ4_SHUFFLED = Flags.LZ4 | Flags.SHUFFLE
VALID_FLAGS = {int(f): f for f in (Flags.NONE, Flags.LZ4, LZ4_SHUFFLED)}


@dataclass(slots=True)
class RecordHeader:
    """What is known about a stored value without reading its payload.

    Not frozen: a frozen dataclass costs ~1 us more to build, and a read
    builds one per value (a restart, one per stored value).
    """

    flags: Flags
    value_size: int
    stored_size: int
    checksum: int
    parent: bytes | None = None
    tenant: bytes | None = None

    def pack(self) -> bytes:
        parent, tenant = self.parent or b"", self.tenant or b""
        return HEADER.pack(MAGIC, VERSION, self.flags, len(parent), self.value_size,
                           self.stored_size, self.checksum, len(tenant)) + parent + tenant

    @classmethod
    def unpack(cls, raw: bytes) -> RecordHeader:
        """Parse a packed header; raise CorruptValue if it is not one."""
        layout = HEADER if raw[2:3] == b"\x02" else HEADER_V1
        if len(raw) < layout.size:
            raise CorruptValue(f"record header is {len(raw)} bytes, expected at least {layout.size}")
        magic, version, bits, plen, value_size, stored_size, checksum, *tlen = layout.unpack_from(raw)
        if magic != MAGIC or version not in (1, VERSION):
            raise CorruptValue(f"record header has magic {magic!r} version {version}")
        flags = VALID_FLAGS.get(bits)
        tlen = tlen[0] if tlen else 0
        if flags is None or len(raw) != layout.size + plen + tlen:
            raise CorruptValue(f"record header has flags {bits:#x}, parent length {plen} and tenant length {tlen}")
        if flags is Flags.NONE and value_size != stored_size:
            raise CorruptValue(f"uncompressed record has sizes {value_size}/{stored_size}")
        if flags is LZ4_SHUFFLED and value_size % 2:
            raise CorruptValue(f"shuffled record has odd length {value_size}")
        end = layout.size + plen
        parent = raw[layout.size:end] if plen else None
        return cls(flags, value_size, stored_size, checksum, parent, raw[end:] if tlen else None)

    @property
    def size(self) -> int:
        """Bytes this header takes on disk (as written now)."""
        return HEADER.size + len(self.parent or b"") + len(self.tenant or b"")

    @property
    def disk_bytes(self) -> int:
        """Bytes the whole record takes on disk."""
        return self.size + self.stored_size

    @property
    def index_tag(self) -> int:
        """The tag the shared index publishes this value under, so a local client can read
        the payload from RocksDB itself (proto/fastpath.py): 0 for a compressed payload,
        which only the node decodes."""
        return self.checksum & fp.INDEX_TAG_MASK if self.flags is Flags.NONE else 0

    def verify(self, payload: bytes) -> bool:
        """Whether ``payload`` is exactly the payload this header describes."""
        return len(payload) == self.stored_size and xxhash.xxh3_64_intdigest(payload) == self.checksum


def encode(value, parent: bytes | None = None, *, compress: bool = True,
           shuffle: bool = True, tenant: bytes | None = None) -> tuple[RecordHeader, bytes]:
    """Header and payload for ``value`` (any contiguous buffer) written by ``tenant``."""
    if parent is not None and len(parent) > MAX_PARENT_LEN:
        raise TierError(f"parent key is {len(parent)} bytes, the limit is {MAX_PARENT_LEN}")
    if tenant is not None and len(tenant) > MAX_TENANT_LEN:
        raise TierError(f"tenant name is {len(tenant)} bytes, the limit is {MAX_TENANT_LEN}")
    view = memoryview(value).cast("B")
    flags = choose_transform(view, shuffle) if compress else Flags.NONE
    payload = None
    if flags:
        source = shuffle_bytes(view) if flags & Flags.SHUFFLE else view
        packed = lz4.block.compress(source, store_size=False)
        if len(packed) < KEEP_RATIO * len(view):
            payload = packed
        else:
            flags = Flags.NONE
    if payload is None:
        payload = value if isinstance(value, bytes) else view.tobytes()
    header = RecordHeader(flags, len(view), len(payload), xxhash.xxh3_64_intdigest(payload), parent, tenant)
    return header, payload


def choose_transform(view: memoryview, shuffle: bool) -> Flags:
    """Flags worth applying to the whole value, judged on a sample of it."""
    sample = view[:PROBE_BYTES]
    if not len(sample):
        return Flags.NONE
    candidates = {Flags.LZ4: sample}
    if shuffle and len(view) % 2 == 0:
        candidates[LZ4_SHUFFLED] = shuffle_bytes(sample)
    sizes = {flags: len(lz4.block.compress(data, store_size=False)) / len(data)
             for flags, data in candidates.items()}
    best = min(sizes, key=sizes.get)
    return best if sizes[best] < KEEP_RATIO else Flags.NONE


def decode(header: RecordHeader, payload: bytes) -> bytes:
    """The value's bytes from a verified payload."""
    if not header.flags:
        return payload
    data = _decompress(header, payload)
    return unshuffle_bytes(data) if header.flags & Flags.SHUFFLE else data


def decode_into(header: RecordHeader, payload: bytes, out) -> int:
    """Write the value into ``out`` (a writable buffer); return its length."""
    size = header.value_size
    target = memoryview(out).cast("B")
    if len(target) < size:
        raise ValueError(f"buffer of {len(target)} bytes cannot hold a value of {size} bytes")
    data = _decompress(header, payload) if header.flags & Flags.LZ4 else payload
    if header.flags & Flags.SHUFFLE:
        unshuffle_into(data, target)
    else:
        target[:size] = data
    return size


def _decompress(header: RecordHeader, payload: bytes) -> bytes:
    try:
        data = lz4.block.decompress(payload, uncompressed_size=header.value_size)
    except lz4.block.LZ4BlockError as exc:
        raise CorruptValue(f"lz4 payload does not decompress: {exc}") from exc
    if len(data) != header.value_size:
        raise CorruptValue(f"payload decompressed to {len(data)} bytes, header says {header.value_size}")
    return data


def shuffle_bytes(data) -> bytes:
    """Low byte of every 2-byte element, then every high byte."""
    return np.frombuffer(data, dtype=np.uint8).reshape(-1, 2).T.tobytes()


def unshuffle_bytes(data) -> bytes:
    """Inverse of :func:`shuffle_bytes`."""
    out = bytearray(len(data))
    unshuffle_into(data, out)
    return bytes(out)


def unshuffle_into(data, out) -> None:
    """Inverse of :func:`shuffle_bytes`, written into the first ``len(data)`` bytes of ``out``."""
    planes = np.frombuffer(data, dtype=np.uint8).reshape(2, -1)
    pairs = np.frombuffer(out, dtype=np.uint8)[:planes.size].reshape(-1, 2)
    pairs[:, 0] = planes[0]     # plane by plane, so numpy's inner loop runs along the long axis
    pairs[:, 1] = planes[1]
