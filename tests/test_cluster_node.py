"""ClusterState: which maps it applies, which it refuses, and the per-slot answers dispatch asks for."""
from __future__ import annotations

import pytest

from kvstore.cluster.slots import SLOTS, SlotMap, SlotMapError, keyslot
from kvstore.cluster.node import ClusterState

A, B = "a" * 40, "b" * 40
NODES = {A: "127.0.0.1:7001", B: "127.0.0.1:7002"}


def halves(epoch: int, migrating=None) -> SlotMap:
    return SlotMap.build(epoch, NODES, [A] * (SLOTS // 2) + [B] * (SLOTS // 2), migrating)


def test_answers_follow_the_map_in_force():
    state = ClusterState(A, NODES[A])
    assert not state.ok and state.owner(0) is None and not state.is_mine(0)
    assert state.apply(halves(1))
    assert state.ok
    assert state.owner(0) == A and state.is_mine(0) and state.mine[0] == 1
    assert state.owner(SLOTS - 1) == B and not state.is_mine(SLOTS - 1)
    assert state.addr_of(B) == "127.0.0.1:7002"
    assert state.is_mine(keyslot(b"foo")) == (keyslot(b"foo") < SLOTS // 2)


def test_migration_is_seen_from_both_ends():
    moving = halves(2, migrating={7: (A, B)})
    source, target = ClusterState(A, NODES[A]), ClusterState(B, NODES[B])
    source.apply(moving)
    target.apply(moving)
    assert source.migrating_to(7) == B and source.importing_from(7) is None
    assert target.importing_from(7) == A and target.migrating_to(7) is None
    assert source.migrating_to(8) is None and source.owner(7) == A


def test_older_or_conflicting_maps_are_refused_and_the_map_in_force_stays():
    state = ClusterState(A, NODES[A])
    state.apply(halves(5))
    with pytest.raises(SlotMapError, match="older"):
        state.apply(halves(4))
    conflicting = SlotMap.build(5, NODES, [B] * SLOTS)
    with pytest.raises(SlotMapError, match="different map"):
        state.apply(conflicting)
    assert state.map.epoch == 5 and state.is_mine(0)
    assert state.apply(halves(5)) is False          # the same map again: no change


def test_malformed_or_stale_raw_maps_are_counted_and_not_applied():
    state = ClusterState(A, NODES[A])
    state.on_map(halves(3).to_json())
    state.on_map(b"{not json")
    state.on_map(halves(2).to_json())
    assert state.refused == 2 and state.map.epoch == 3 and state.is_mine(0)


def test_listeners_see_old_and_new_maps():
    state = ClusterState(A, NODES[A])
    seen = []
    state.add_listener(lambda old, new: seen.append((old.epoch, new.epoch)))
    state.add_listener(lambda old, new: 1 / 0)      # a failing listener does not stop the others
    state.apply(halves(1))
    state.apply(halves(2))
    assert seen == [(0, 1), (1, 2)]
