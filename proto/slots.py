"""Redis Cluster's hash slots: the key -> slot function both the node and the SDK compute.

A key's slot is CRC16-XMODEM of the key (or of its ``{hash tag}``) modulo
16384, exactly as Redis computes it, so cluster-aware Redis clients route to
the right node without knowing they talk to kvstore, and the SDK splits a
prefix's blocks over nodes the same way the nodes check them.
``binascii.crc_hqx(data, 0)`` *is* CRC16-XMODEM (polynomial 0x1021, initial
value 0), implemented in C: a few hundred nanoseconds a key.
"""
from __future__ import annotations

import binascii

SLOTS = 16384

_crc16 = binascii.crc_hqx


def keyslot(key: bytes) -> int:
    """The Redis Cluster slot of ``key``.

    Only the part between the first ``{`` and the first ``}`` after it is
    hashed, when that part is not empty (``{user1}.a`` and ``{user1}.b`` share a
    slot; ``{}x`` hashes whole), as Redis's keyHashSlot.
    """
    start = key.find(b"{")
    if start >= 0:
        end = key.find(b"}", start + 1)
        if end > start + 1:
            key = key[start + 1:end]
    return _crc16(key, 0) & (SLOTS - 1)
