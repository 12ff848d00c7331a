"""Hash slots and the slot map: which node serves which of Redis Cluster's 16,384 slots.

A key's slot is CRC16-XMODEM of the key (or of its ``{hash tag}``) modulo 16384,
exactly as Redis computes it, so cluster-aware Redis clients route to the right
node without knowing they talk to kvstore. ``binascii.crc_hqx(data, 0)`` *is*
CRC16-XMODEM (polynomial 0x1021, initial value 0), implemented in C: one call per
key costs a few hundred nanoseconds, cheap enough for every command.

The slot map is the one piece of shared state of a cluster: an epoch, the nodes
(id -> ``host:port``), the owner of every slot, and the slots being moved. The
leader writes it to etcd as JSON; every node reads it back through `from_json`,
which refuses anything malformed (a bad map is logged and never applied).
Owners are written by node index (position in the id-sorted ``nodes``) as
runs, ``"runs": [length, index, length, index, ...]`` over slots 0..16383
(index -1: unassigned), and moves as ``[slot, source index, target index]``,
so a run costs a few bytes rather than a 40-digit id; the older form,
``"slots": [[first, last, node id], ...]`` with moves by id, is still read. A map
is immutable once built, so one parsed map can be shared by every node of an
in-process simulation, and its derived views (ranges, per-slot owner list) are
computed once.

What reaches the nodes when the map changes is not the map but a change
record (mapchange.py), from which each node builds the new map itself.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from functools import cached_property, lru_cache

import numpy as np

from proto.slots import SLOTS, keyslot

MAX_MAP_BYTES = 2 * 1024 * 1024       # well above a fully fragmented map (16,384 ranges), below etcd's limits
NODE_ID = re.compile(r"[0-9a-f]{40}")
ADDRESS = re.compile(r"(\S+):(\d{1,5})")
UNASSIGNED = -1

def keys_by_slot(keys: list[bytes]) -> dict[int, list[bytes]]:
    """The keys grouped by their slot, in first-seen order."""
    groups: dict[int, list[bytes]] = {}
    for key in keys:
        groups.setdefault(keyslot(key), []).append(key)
    return groups


class SlotMapError(ValueError):
    """A slot map that must not be applied; the message says what is wrong."""


def check_address(addr: str) -> tuple[str, int]:
    """``host:port`` split and checked (an IPv6 host keeps its colons)."""
    match = ADDRESS.fullmatch(addr)
    if match is None or not 0 < int(match[2]) < 65536:
        raise SlotMapError(f"bad node address {addr!r} (want host:port)")
    return match[1], int(match[2])


@dataclass(frozen=True, eq=False)
class SlotMap:
    """Who serves each slot at one epoch.

    ``ids`` are the nodes in id order and ``owners[slot]`` an index into them
    (-1: nobody serves the slot). ``migrating`` maps a slot being moved to its
    (source, target) node ids; the source still owns it until the move ends, and
    serves the keys it still has (Redis's ASK protocol).
    """

    epoch: int
    nodes: dict[str, str]                     # node id -> "host:port"
    owners: np.ndarray                        # int16[SLOTS], index into ids
    migrating: dict[int, tuple[str, str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.owners.flags.writeable = False

    @classmethod
    def empty(cls) -> "SlotMap":
        """Epoch 0: no nodes, no slot served (what a node holds before any map)."""
        return cls(0, {}, np.full(SLOTS, UNASSIGNED, dtype=np.int16))

    @classmethod
    def build(cls, epoch: int, nodes: dict[str, str], owner_of, migrating=None) -> "SlotMap":
        """A map from ``owner_of``: per-slot node ids (None: unassigned) or index array over sorted ids."""
        ordered = dict(sorted(nodes.items()))
        if isinstance(owner_of, np.ndarray):
            owners = owner_of.astype(np.int16)
        else:
            index = {node_id: i for i, node_id in enumerate(ordered)}
            owners = np.array([UNASSIGNED if o is None else index[o] for o in owner_of], dtype=np.int16)
        return cls(epoch, ordered, owners, dict(migrating or {}))

    # ---------------------------------------------------------------- queries

    @cached_property
    def ids(self) -> tuple[str, ...]:
        return tuple(self.nodes)

    @cached_property
    def owner_list(self) -> list[str | None]:
        """The owner id of every slot as a Python list (one index per lookup on the hot path)."""
        names = list(self.ids) + [None]             # index -1 -> None
        return [names[i] for i in self.owners.tolist()]

    def owner(self, slot: int) -> str | None:
        return self.owner_list[slot]

    def slots_of(self, node_id: str) -> np.ndarray:
        """A boolean mask over slots: those ``node_id`` owns."""
        if node_id not in self.nodes:
            return np.zeros(SLOTS, dtype=bool)
        return self.owners == self.ids.index(node_id)

    @cached_property
    def assigned(self) -> int:
        return int(np.count_nonzero(self.owners != UNASSIGNED))

    @cached_property
    def counts(self) -> dict[str, int]:
        """Slots per node, every node of the map included."""
        held = np.bincount(self.owners[self.owners != UNASSIGNED], minlength=len(self.ids))
        return dict(zip(self.ids, held.tolist()))

    @cached_property
    def ranges(self) -> list[tuple[int, int, str]]:
        """Maximal runs of slots with the same owner: ``(first, last, node id)``, unassigned runs left out."""
        owners = self.owners.astype(np.int32)
        starts = np.flatnonzero(np.diff(owners, prepend=-2))
        ends = np.append(starts[1:] - 1, SLOTS - 1)
        who = owners[starts]
        served = who != UNASSIGNED
        names = [self.ids[i] for i in who[served].tolist()]
        return list(zip(starts[served].tolist(), ends[served].tolist(), names))

    def ranges_of(self, node_id: str) -> list[tuple[int, int]]:
        return [(s, e) for s, e, owner in self.ranges if owner == node_id]

    def same_as(self, other: "SlotMap") -> bool:
        """Same epoch, nodes, owners and moves."""
        if (self.epoch, self.nodes, self.migrating) != (other.epoch, other.nodes, other.migrating):
            return False
        if self.ids == other.ids:
            return bool(np.array_equal(self.owners, other.owners))
        return self.owner_list == other.owner_list

    def with_epoch(self, epoch: int) -> "SlotMap":
        return SlotMap(epoch, self.nodes, self.owners, self.migrating)

    # ---------------------------------------------------------------- JSON

    def to_json(self) -> bytes:
        return self._json

    @cached_property
    def _json(self) -> bytes:
        owners = self.owners.astype(np.int32)
        starts = np.flatnonzero(np.diff(owners, prepend=-2))
        lengths = np.diff(np.append(starts, SLOTS))
        runs = np.column_stack([lengths, owners[starts]]).ravel().tolist()
        index = {node_id: i for i, node_id in enumerate(self.ids)}
        doc = {"epoch": self.epoch, "nodes": self.nodes, "runs": runs,
               "migrating": [[slot, index[src], index[dst]] for slot, (src, dst) in sorted(self.migrating.items())]}
        return json.dumps(doc, separators=(",", ":")).encode()

    @staticmethod
    def from_json(raw: bytes) -> "SlotMap":
        """Parse and validate a map written by a leader; raises SlotMapError."""
        return _parse(bytes(raw))


@lru_cache(maxsize=8)
def _parse(raw: bytes) -> SlotMap:
    """Cached: every node of a process (a simulation) parses the same bytes once."""
    if len(raw) > MAX_MAP_BYTES:
        raise SlotMapError(f"slot map of {len(raw)} bytes is over the {MAX_MAP_BYTES} byte limit")
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise SlotMapError(f"slot map is not JSON: {e}") from None
    if not isinstance(doc, dict) or set(doc) not in ({"epoch", "nodes", "runs", "migrating"},
                                                     {"epoch", "nodes", "slots", "migrating"}):
        raise SlotMapError("slot map must be an object with exactly epoch, nodes, runs (or slots), migrating")
    epoch = doc["epoch"]
    if type(epoch) is not int or not 0 <= epoch < 2**63:
        raise SlotMapError(f"bad epoch {epoch!r}")
    nodes = parse_nodes(doc["nodes"])
    index = {node_id: i for i, node_id in enumerate(sorted(nodes))}
    owners = _parse_runs(doc["runs"], len(index)) if "runs" in doc else _parse_ranges(doc["slots"], index)
    slot_map = SlotMap(epoch, dict(sorted(nodes.items())), owners)
    moves = _parse_migrating(doc["migrating"], slot_map, by_index="runs" in doc)
    return SlotMap(epoch, slot_map.nodes, owners, moves) if moves else slot_map


def parse_nodes(nodes) -> dict[str, str]:
    if not isinstance(nodes, dict) or len(nodes) > SLOTS:
        raise SlotMapError("nodes must be an object of at most 16384 node id -> host:port")
    seen: set[str] = set()
    for node_id, addr in nodes.items():
        if not NODE_ID.fullmatch(node_id):
            raise SlotMapError(f"bad node id {node_id!r} (want 40 lowercase hex digits)")
        if not isinstance(addr, str):
            raise SlotMapError(f"bad node address {addr!r} (want host:port)")
        check_address(addr)
        if addr in seen:
            raise SlotMapError(f"two nodes announce {addr}")
        seen.add(addr)
    return nodes


def _is_slot(value) -> bool:
    return type(value) is int and 0 <= value < SLOTS


def _parse_ranges(ranges, index: dict[str, int]) -> np.ndarray:
    if not isinstance(ranges, list) or len(ranges) > SLOTS:
        raise SlotMapError("slots must be a list of at most 16384 [first, last, node id]")
    owners = np.full(SLOTS, UNASSIGNED, dtype=np.int16)
    for item in ranges:
        if not (isinstance(item, list) and len(item) == 3 and _is_slot(item[0]) and _is_slot(item[1])
                and item[0] <= item[1]):
            raise SlotMapError(f"bad slot range {item!r}")
        first, last, node_id = item
        if node_id not in index:
            raise SlotMapError(f"slots {first}-{last} owned by unknown node {node_id!r}")
        if np.any(owners[first:last + 1] != UNASSIGNED):
            raise SlotMapError(f"slot range {first}-{last} overlaps another")
        owners[first:last + 1] = index[node_id]
    return owners


def _parse_runs(runs, nodes: int) -> np.ndarray:
    if not isinstance(runs, list) or len(runs) % 2 or len(runs) > 2 * SLOTS:
        raise SlotMapError("runs must be a list of at most 16384 pairs length, node index")
    if not all(type(v) is int for v in runs):
        raise SlotMapError("runs must hold integers only")
    lengths, owners = np.array(runs[0::2], dtype=np.int64), np.array(runs[1::2], dtype=np.int64)
    if np.any(lengths < 1) or int(lengths.sum()) != SLOTS:
        raise SlotMapError(f"runs must cover the {SLOTS} slots with positive lengths")
    if np.any((owners < UNASSIGNED) | (owners >= nodes)):
        raise SlotMapError(f"runs name a node index outside the {nodes} nodes")
    return np.repeat(owners, lengths).astype(np.int16)


def _parse_migrating(moves, slot_map: SlotMap, by_index: bool = False) -> dict[int, tuple[str, str]]:
    if not isinstance(moves, list) or len(moves) > SLOTS:
        raise SlotMapError("migrating must be a list of [slot, source, target]")
    result: dict[int, tuple[str, str]] = {}
    ids = slot_map.ids
    for item in moves:
        if not (isinstance(item, list) and len(item) == 3 and _is_slot(item[0])):
            raise SlotMapError(f"bad migration {item!r}")
        slot, src, dst = item
        if by_index:
            if not all(type(v) is int and 0 <= v < len(ids) for v in (src, dst)):
                raise SlotMapError(f"bad migration {item!r}")
            src, dst = ids[src], ids[dst]
        if slot in result or slot_map.owner(slot) != src or dst not in slot_map.nodes or dst == src:
            raise SlotMapError(f"migration {item!r} must move a slot once, from its owner to another node")
        result[slot] = (src, dst)
    return result

