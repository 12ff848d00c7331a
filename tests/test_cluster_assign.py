"""The leader's assignment: full coverage, even shares, minimal and deterministic moves under churn."""
from __future__ import annotations

import hashlib
import math
import random

import numpy as np

from kvstore.cluster.assign import SLACK_DIVISOR, moved_slots, rebalance
from kvstore.cluster.slots import SLOTS, SlotMap


def node_id(n: int) -> str:
    return hashlib.sha1(b"node-%d" % n).hexdigest()


def nodes_of(numbers) -> dict[str, str]:
    return {node_id(n): f"10.0.{n // 200}.{n % 200 + 1}:7000" for n in numbers}


def check_balanced(slot_map: SlotMap, nodes: dict[str, str]) -> None:
    """Every slot served; each node within its share +- share / SLACK_DIVISOR (and the one rounding slot)."""
    assert slot_map.assigned == SLOTS
    assert set(slot_map.nodes) == set(nodes)
    counts = slot_map.counts.values()
    base = SLOTS // len(nodes)
    slack = base // SLACK_DIVISOR
    assert base - slack <= min(counts) and max(counts) <= base + 1 + slack


def test_first_map_gives_every_slot_to_the_one_node():
    nodes = nodes_of([0])
    first = rebalance(SlotMap.empty(), nodes)
    assert first.epoch == 1 and first.counts == {node_id(0): SLOTS}
    assert rebalance(first, nodes) is first          # nothing to change: same map, same epoch


def test_growing_to_256_nodes_moves_the_ideal_share_each_join():
    current = SlotMap.empty()
    for n in range(1, 257):
        nodes = nodes_of(range(n))
        new = rebalance(current, nodes)
        check_balanced(new, nodes)
        assert new.epoch == current.epoch + 1
        if n > 1:
            moved = moved_slots(current, new)
            assert moved <= math.ceil(SLOTS / n)
            assert moved <= 1.2 * SLOTS / n
            # Only the newcomer receives slots: no slot moves between two old nodes.
            gained = new.slots_of(node_id(n - 1))
            assert moved == int(np.count_nonzero(gained))
        current = new


def test_nodes_started_together_get_exact_shares():
    first = rebalance(SlotMap.empty(), nodes_of(range(7)))
    counts = first.counts.values()
    assert max(counts) - min(counts) <= 1 and len(first.ranges) == 7


def test_a_map_grown_join_by_join_stays_a_few_runs_a_node():
    """A newcomer takes whole runs (each donor's highest slots, up to share / 8 below its share),
    not one slot of every node, so the map does not fragment with history."""
    current = SlotMap.empty()
    for n in range(1, 257):
        current = rebalance(current, nodes_of(range(n)))
    assert len(current.ranges) <= 8 * 256
    assert len(current.to_json()) <= 40_000


def test_leaves_move_only_the_leavers_slots():
    nodes = nodes_of(range(64))
    current = rebalance(SlotMap.empty(), nodes)
    rng = random.Random(3)
    for _ in range(40):
        leaver = rng.choice(sorted(nodes))
        held = current.counts[leaver]
        del nodes[leaver]
        new = rebalance(current, nodes)
        check_balanced(new, nodes)
        assert moved_slots(current, new) == held
        assert held <= 1.2 * SLOTS / (len(nodes) + 1)
        current = new


def test_churn_stays_within_bound_and_deterministic():
    rng = random.Random(11)
    alive = set(range(256))
    current = rebalance(SlotMap.empty(), nodes_of(alive))
    next_number = 256
    for _ in range(200):
        before = len(alive)
        if rng.random() < 0.5 and len(alive) > 2:
            alive.discard(rng.choice(sorted(alive)))
        else:
            alive.add(next_number)
            next_number += 1
        nodes = nodes_of(alive)
        new = rebalance(current, nodes)
        again = rebalance(current, dict(reversed(list(nodes.items()))))
        assert again.same_as(new)
        check_balanced(new, nodes)
        ideal = SLOTS / max(before, len(alive))
        assert moved_slots(current, new) <= 1.2 * ideal
        current = new


def test_moves_of_live_nodes_survive_and_moves_touching_a_leaver_are_dropped():
    nodes = nodes_of(range(3))
    a, b, c = sorted(nodes)
    base = rebalance(SlotMap.empty(), nodes)
    slot_of_a = int(np.flatnonzero(base.slots_of(a))[0])
    slot_of_b = int(np.flatnonzero(base.slots_of(b))[0])
    with_moves = SlotMap(base.epoch, base.nodes, base.owners, {slot_of_a: (a, b), slot_of_b: (b, c)})
    del nodes[c]
    new = rebalance(with_moves, nodes)
    assert new.migrating == {slot_of_a: (a, b)}


def test_force_bumps_the_epoch_of_an_unchanged_map():
    nodes = nodes_of(range(2))
    first = rebalance(SlotMap.empty(), nodes)
    forced = rebalance(first, nodes, force=True)
    assert forced.epoch == first.epoch + 1
    assert forced.owner_list == first.owner_list


def test_every_node_leaving_unassigns_everything():
    first = rebalance(SlotMap.empty(), nodes_of(range(3)))
    empty = rebalance(first, {})
    assert empty.assigned == 0 and empty.nodes == {} and empty.epoch == first.epoch + 1
