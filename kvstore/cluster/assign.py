"""The leader's slot assignment: even shares, as few slots moved as possible.

Every slot that moves costs its keys (a cache refills, but a move is a burst
of misses), so when nodes join or leave the leader keeps every slot where it
is unless its owner holds more than its share:

1. Each of the N live nodes gets a target of ``16384 // N`` slots, and the
   ``16384 % N`` nodes that hold the most today (ties by id) get one more, so
   rounding never forces a move.
2. A node may hold its target +- target / 8 (``SLACK_DIVISOR``): one over that
   gives up its highest slots down to its target; slots of nodes that left are
   free too.
3. Free slots go, in ascending runs, to the nodes furthest under their target.
4. A node still more than the slack under its target (a newcomer) takes whole
   runs: the node most over its target gives its highest slots, its excess or
   up to the slack below its target, then the next. Taking one slot of every
   node instead would add a range per node per join: a map grown join by join
   to 256 nodes held 10,850 ranges; this way it holds about 8 per node.

Moves are then exactly the slots of departed nodes plus what a newcomer
takes: ``16384 / N`` for a join or a leave, the minimum possible. The result depends only on the current map and the node set, so a
new leader computes the same map as the old one would have. Vectorised with
numpy: a 256-node reassignment takes well under a millisecond of Python.

When values should move with their slots, `plan_moves` turns the new
assignment into a step: slots whose owner is still alive stay with it, marked
as moving to their new owner, and `finish_moves` is the map once they moved
(node.py writes one, then the other).
"""
from __future__ import annotations

import numpy as np

from kvstore.cluster.slots import SLOTS, UNASSIGNED, SlotMap

SLACK_DIVISOR = 8           # a node may hold its share +- share/8, so a newcomer takes whole runs


def rebalance(current: SlotMap, nodes: dict[str, str], *, force: bool = False) -> SlotMap:
    """The map for live ``nodes`` (id -> address), derived from ``current``.

    Returns ``current`` itself when nothing would change (and ``force`` is
    false); otherwise a new map at the next epoch. Moves whose source or
    target left, or whose slot changed owner, are dropped.
    """
    ids = sorted(nodes)
    owners = _carried_over(current, ids)
    if ids:
        owners = _balanced(owners, len(ids))
    ordered = {node_id: nodes[node_id] for node_id in ids}
    candidate = SlotMap(current.epoch, ordered, owners.astype(np.int16), _kept_moves(current, ordered, owners))
    if candidate.same_as(current) and not force:
        return current
    return candidate.with_epoch(current.epoch + 1)


def moved_slots(old: SlotMap, new: SlotMap) -> int:
    """Slots that had an owner in ``old`` and have a different one (or none) in ``new``."""
    union = {node_id: i for i, node_id in enumerate(sorted(set(old.ids) | set(new.ids)))}
    before = np.array([union[i] for i in old.ids] + [UNASSIGNED])[old.owners]
    after = np.array([union[i] for i in new.ids] + [UNASSIGNED])[new.owners]
    return int(np.count_nonzero((before != UNASSIGNED) & (before != after)))


def _carried_over(current: SlotMap, ids: list[str]) -> np.ndarray:
    """Current owners as indices into ``ids`` (slots of departed nodes unassigned)."""
    index = {node_id: i for i, node_id in enumerate(ids)}
    remap = np.array([index.get(node_id, UNASSIGNED) for node_id in current.ids] + [UNASSIGNED], dtype=np.int32)
    return remap[current.owners]            # owner -1 picks the trailing UNASSIGNED


def _balanced(owners: np.ndarray, n: int) -> np.ndarray:
    owners = owners.copy()
    held = np.bincount(owners[owners != UNASSIGNED], minlength=n)
    base, extra = divmod(SLOTS, n)
    target = np.full(n, base)
    by_holding = sorted(range(n), key=lambda i: (-held[i], i))
    target[by_holding[:extra]] += 1
    slack = base // SLACK_DIVISOR
    # Release the slots of a node over target + slack beyond its target, its highest first: rank
    # a slot within its owner's slots (ascending), free those ranked at or past the limit.
    limit = np.where(held > target + slack, target, held)
    order = np.argsort(owners, kind="stable")
    grouped = owners[order]
    rank = np.arange(SLOTS) - np.searchsorted(grouped, grouped, side="left")
    assigned = grouped != UNASSIGNED
    over = np.zeros(SLOTS, dtype=bool)
    over[assigned] = rank[assigned] >= limit[grouped[assigned]]
    owners[order[over]] = UNASSIGNED
    count = np.bincount(owners[owners != UNASSIGNED], minlength=n)
    # Free slots, in ascending runs, to the nodes furthest under their target, up to it.
    free = np.flatnonzero(owners == UNASSIGNED)
    taken = 0
    for i in sorted(range(n), key=lambda i: (count[i] - target[i], i)):
        if taken == len(free) or count[i] >= target[i]:
            break
        give = min(int(target[i] - count[i]), len(free) - taken)
        owners[free[taken:taken + give]] = i
        count[i] += give
        taken += give
    # A node still far under its target (a newcomer) takes whole runs: each donor, the most over
    # its target first, gives its highest slots, at least its excess and up to ``slack`` below target.
    for i in range(n):
        need = int(target[i] - count[i])
        if need <= slack and count[i] > 0:
            continue
        while need > 0:
            donor = max(range(n), key=lambda j: (count[j] - target[j], -j))
            give = min(need, max(int(count[donor] - target[donor]), min(slack, int(count[donor] - target[donor] + slack))))
            if give <= 0 or donor == i:
                break
            mine = np.flatnonzero(owners == donor)
            owners[mine[len(mine) - give:]] = i
            count[donor] -= give
            count[i] += give
            need -= give
    return owners


def _kept_moves(current: SlotMap, nodes: dict[str, str], owners: np.ndarray) -> dict[int, tuple[str, str]]:
    ids = list(nodes)
    return {slot: (src, dst) for slot, (src, dst) in current.migrating.items()
            if src in nodes and dst in nodes and owners[slot] == ids.index(src)}


def plan_moves(current: SlotMap, target: SlotMap, live) -> SlotMap:
    """The first step from ``current`` to ``target`` when values should move with their slots.

    A slot whose owner is still registered (``live``: node ids) stays with it,
    marked as moving to its new owner (Redis's MIGRATING/IMPORTING, answered
    with ASK); a slot whose owner is gone goes to its new owner at once, since
    there is nothing to move. Returns ``target`` itself when no slot moves.
    The step has ``target``'s epoch; `finish_moves` gives the map after it.
    """
    old_owner, new_owner = current.owner_list, target.owner_list
    moving = {slot: (old_owner[slot], new_owner[slot]) for slot in range(SLOTS)
              if old_owner[slot] in live and new_owner[slot] is not None and old_owner[slot] != new_owner[slot]}
    if not moving:
        return target
    nodes = dict(target.nodes)
    nodes.update({source: current.nodes[source] for source, _ in moving.values()})
    owners = list(new_owner)
    for slot, (source, _) in moving.items():
        owners[slot] = source
    return SlotMap.build(target.epoch, nodes, owners, moving)


def finish_moves(step: SlotMap, nodes: dict[str, str]) -> SlotMap:
    """The map once ``step``'s moves are over: each moving slot with its target, at the next epoch.

    Nodes outside ``nodes`` (the live, not draining ones) leave the map unless
    they still own a slot (the next assignment hands those slots on).
    """
    owners = list(step.owner_list)
    for slot, (_, target) in step.migrating.items():
        owners[slot] = target
    owning = set(owners) - {None}
    kept = {node_id: addr for node_id, addr in step.nodes.items() if node_id in nodes or node_id in owning}
    return SlotMap.build(step.epoch + 1, kept, owners)
