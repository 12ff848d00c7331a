"""The slot map's change record: what takes a node from one map to the next without the map.

Every map change reaches every node, so the record's size times N is what a
change costs etcd's watchers; a join at 256 nodes must cost less than two
maps in all, so a record has to fit in about 200 bytes while the newcomer's
slots come from twenty-odd donor runs. JSON spent 8-11 bytes a run and 40
hex digits an id; this binary form spends 2-4 bytes a run and 20 bytes an id.

Layout (unsigned LEB128 varints, ``v``; node ids as their 20 raw bytes)::

    0x01                            format version
    v base + 1, v epoch             the epoch it applies to (-1: no map yet), the new one
    v gone,  gone x id              nodes that left
    v added, added x (id, v len, address)   nodes that joined or changed address
    v groups, per group: v owner + 1, v runs, runs x (v gap, v length)
    v moves,  moves x (v gap, v length, v source, v target)
    4 bytes                         CRC-32 of the new map's JSON, big-endian

Owners and move ends are indexes into the new map's id-sorted nodes (owner -1:
unassigned). Runs of a group, and the move runs, ascend: each ``gap`` counts
the slots from the end of the previous run (0 at the first). A node whose map
is not ``base``, or whose result does not match the CRC, reads the whole map
instead, so any defect of a record costs one read, never a wrong map.
"""
from __future__ import annotations

import zlib
from functools import lru_cache

import numpy as np

from kvstore.cluster.slots import SLOTS, UNASSIGNED, SlotMap, SlotMapError, parse_nodes

VERSION = 1


class _Writer:
    def __init__(self) -> None:
        self.out = bytearray([VERSION])

    def uint(self, value: int) -> None:
        while value >= 0x80:
            self.out.append(value & 0x7F | 0x80)
            value >>= 7
        self.out.append(value)

    def raw(self, data: bytes) -> None:
        self.out += data

    def runs(self, runs: list[tuple[int, int]]) -> None:
        """Ascending ``(first, length)`` runs as gaps from the previous run's end."""
        end = 0
        for first, length in runs:
            self.uint(first - end)
            self.uint(length)
            end = first + length


class _Reader:
    def __init__(self, raw: bytes) -> None:
        self.raw, self.at = raw, 1

    def uint(self) -> int:
        value = shift = 0
        while True:
            byte = self.raw[self.at]
            self.at += 1
            value |= (byte & 0x7F) << shift
            if byte < 0x80:
                return value
            shift += 7
            if shift > 63:
                raise ValueError("varint too long")

    def take(self, size: int) -> bytes:
        if self.at + size > len(self.raw):
            raise IndexError("record ends early")
        chunk, self.at = self.raw[self.at:self.at + size], self.at + size
        return chunk

    def runs(self, count: int):
        """``(first, length)`` runs written by `_Writer.runs`; each checked to lie within the slots."""
        end = 0
        for _ in range(count):
            first = end + self.uint()
            end = first + self.uint()
            if end > SLOTS:
                raise ValueError("run past the last slot")
            yield first, end - first


def _runs(values: np.ndarray, mask: np.ndarray) -> list[tuple[int, int, int]]:
    """Maximal runs ``(first, length, value)`` of ``values`` over the slots where ``mask`` holds."""
    keyed = np.where(mask, values.astype(np.int64), -(2**40))
    starts = np.flatnonzero(np.diff(keyed, prepend=-(2**41)))
    lengths = np.diff(np.append(starts, SLOTS))
    return [(first, length, value) for first, length, value
            in zip(starts.tolist(), lengths.tolist(), keyed[starts].tolist()) if mask[first]]


def change_record(old: SlotMap, new: SlotMap) -> bytes:
    """What takes a node holding ``old`` to ``new`` (see the module's docstring)."""
    out = _Writer()
    out.uint(old.epoch + 1)
    out.uint(new.epoch)
    gone = [node_id for node_id in old.nodes if node_id not in new.nodes]
    added = {node_id: addr for node_id, addr in new.nodes.items() if old.nodes.get(node_id) != addr}
    out.uint(len(gone))
    for node_id in gone:
        out.raw(bytes.fromhex(node_id))
    out.uint(len(added))
    for node_id, addr in added.items():
        out.raw(bytes.fromhex(node_id))
        out.uint(len(addr.encode()))
        out.raw(addr.encode())
    _write_owners(out, old, new)
    _write_moves(out, new)
    out.raw(zlib.crc32(new.to_json()).to_bytes(4, "big"))
    return bytes(out.out)


def _write_owners(out: _Writer, old: SlotMap, new: SlotMap) -> None:
    index = {node_id: i for i, node_id in enumerate(new.ids)}
    remap = np.array([index.get(node_id, -2) for node_id in old.ids] + [UNASSIGNED], dtype=np.int32)
    carried = remap[old.owners.astype(np.int32)]        # old owners as indexes of the new map
    owners = new.owners.astype(np.int32)
    groups: dict[int, list[tuple[int, int]]] = {}
    for first, length, owner in _runs(owners, carried != owners):
        groups.setdefault(owner, []).append((first, length))
    out.uint(len(groups))
    for owner, runs in groups.items():
        out.uint(owner + 1)
        out.uint(len(runs))
        out.runs(runs)


def _write_moves(out: _Writer, new: SlotMap) -> None:
    index = {node_id: i for i, node_id in enumerate(new.ids)}
    pairs = np.full(SLOTS, -1, dtype=np.int64)
    for slot, (source, target) in new.migrating.items():
        pairs[slot] = index[source] * SLOTS + index[target]
    runs = _runs(pairs, pairs >= 0)
    out.uint(len(runs))
    end = 0
    for first, length, pair in runs:
        out.uint(first - end)
        out.uint(length)
        out.uint(pair // SLOTS)
        out.uint(pair % SLOTS)
        end = first + length


@lru_cache(maxsize=8)
def apply_change(old: SlotMap, raw: bytes) -> SlotMap | None:
    """``old`` changed by the record ``raw``; None when the record is not for ``old`` or does not
    give exactly the map it was made from (read the whole map then). Cached: the nodes of a
    simulation share their maps, so each record is applied once per process."""
    if not raw or raw[0] != VERSION:
        return None
    try:
        reader = _Reader(raw)
        if reader.uint() - 1 != old.epoch:
            return None
        new = _read_map(reader, old)
        if reader.at + 4 != len(raw):
            return None
        return new if zlib.crc32(new.to_json()) == int.from_bytes(reader.take(4), "big") else None
    except (ValueError, TypeError, KeyError, IndexError, OverflowError, SlotMapError):
        return None


def _read_map(reader: _Reader, old: SlotMap) -> SlotMap:
    epoch = reader.uint()
    nodes = dict(old.nodes)
    for _ in range(reader.uint()):
        nodes.pop(reader.take(20).hex(), None)
    for _ in range(reader.uint()):
        node_id = reader.take(20).hex()
        nodes[node_id] = reader.take(reader.uint()).decode()
    nodes = dict(sorted(parse_nodes(nodes).items()))
    ids = list(nodes)
    index = {node_id: i for i, node_id in enumerate(ids)}
    remap = np.array([index.get(node_id, UNASSIGNED) for node_id in old.ids] + [UNASSIGNED], dtype=np.int16)
    owners = remap[old.owners.astype(np.int32)]
    for _ in range(reader.uint()):
        owner = reader.uint() - 1
        for first, length in reader.runs(reader.uint()):
            owners[first:first + length] = owner
    migrating = {}
    end = 0
    for _ in range(reader.uint()):
        first = end + reader.uint()
        end = first + reader.uint()
        source, target = ids[reader.uint()], ids[reader.uint()]
        migrating.update((slot, (source, target)) for slot in range(first, min(end, SLOTS)))
    return SlotMap(epoch, nodes, owners, migrating)
