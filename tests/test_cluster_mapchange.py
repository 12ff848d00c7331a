"""The slot map's binary change record (mapchange.py): exact, small, and refused when not for the map held."""
from __future__ import annotations

import random

import pytest

from kvstore.cluster.assign import finish_moves, plan_moves, rebalance
from kvstore.cluster.mapchange import apply_change, change_record
from kvstore.cluster.slots import SlotMap


def node_ids(count: int, start: int = 1) -> dict[str, str]:
    return {"%040x" % (i + start): f"10.0.{i // 250}.{i % 250 + 1}:7000" for i in range(count)}


def test_a_change_record_takes_a_map_to_the_next_and_only_that_map():
    nodes = node_ids(12)
    first = rebalance(SlotMap.empty(), nodes)
    nodes["%040x" % 99] = "10.0.1.1:7000"
    step = plan_moves(first, rebalance(first, nodes), nodes)
    final = finish_moves(step, nodes)
    assert step.migrating and final.epoch == step.epoch + 1
    del nodes["%040x" % 3]
    after = rebalance(final, nodes)                                     # a node gone
    moved = SlotMap(after.epoch + 1, {**after.nodes, "%040x" % 1: "10.9.9.9:1"}, after.owners)
    empty = SlotMap.empty().with_epoch(-1)
    for old, new in ((empty, first), (first, step), (step, final), (first, final), (final, after), (after, moved)):
        record = change_record(old, new)
        assert old is empty or len(record) < len(new.to_json()) / 4
        assert apply_change(old, record).same_as(new)
        if old is not empty:
            assert apply_change(SlotMap.from_json(old.to_json()), record).to_json() == new.to_json()
    record = change_record(step, final)
    assert apply_change(first, record) is None                          # not the map it was made for
    assert apply_change(step, record[:-1] + bytes([record[-1] ^ 1])) is None   # CRC
    assert apply_change(step, b"garbage") is None
    assert apply_change(step, b"") is None


def test_a_join_at_256_nodes_is_a_record_of_under_200_bytes():
    """A newcomer's slots come from a score of donor runs; at 256 nodes the record of that join must
    stay under 200 bytes so that 257 deliveries cost under two maps (the map is 26-27 KB)."""
    nodes = node_ids(256)
    slot_map = SlotMap.empty()
    for i in range(1, 257):
        slot_map = rebalance(slot_map, dict(list(nodes.items())[:i]))
    nodes["%040x" % 999] = "10.1.1.1:7000"
    joined = rebalance(slot_map, nodes)
    record = change_record(slot_map, joined)
    assert apply_change(slot_map, record).same_as(joined)
    assert len(record) < 200 < len(joined.to_json()) / 100


def test_damaged_records_are_refused_never_applied_wrong():
    nodes = node_ids(8)
    old = rebalance(SlotMap.empty(), nodes)
    nodes["%040x" % 50] = "10.0.9.1:7000"
    new = plan_moves(old, rebalance(old, nodes), nodes)
    record = change_record(old, new)
    rng = random.Random(3)
    for _ in range(300):
        damaged = bytearray(record)
        for _ in range(rng.randint(1, 3)):
            damaged[rng.randrange(len(damaged))] = rng.randrange(256)
        result = apply_change(old, bytes(damaged))
        assert result is None or result.same_as(new)
    for cut in range(len(record)):
        assert apply_change(old, record[:cut]) is None
    assert apply_change(old, record + b"\0") is None


@pytest.mark.parametrize("junk", [b"\x01\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01", b"\x02" + b"\0" * 20,
                                  b"\x01\x01\x05\x00\x00\x01\x80\xff\x01\x01" + b"\0" * 8])
def test_records_of_nonsense_are_refused(junk):
    old = rebalance(SlotMap.empty(), node_ids(3))
    assert apply_change(old, junk) is None
