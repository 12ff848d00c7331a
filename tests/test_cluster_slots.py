"""Hash slots against a real redis-server in cluster mode, and the slot map's JSON validation."""
from __future__ import annotations

import json
import random

import numpy as np
import pytest
import redis

from kvstore.cluster.slots import SLOTS, SlotMap, SlotMapError, keyslot

A, B, C = "a" * 40, "b" * 40, "c" * 40


@pytest.fixture
def redis_cluster_node(redis_factory):
    """A redis-server started with --cluster-enabled yes (it answers CLUSTER KEYSLOT with no slots assigned)."""
    return redis_factory.cluster_node()[0]


def tricky_keys(count: int) -> list[bytes]:
    """Random keys, many with braces in odd places (empty tags, unclosed, nested, several)."""
    rng = random.Random(7)
    parts = [b"{", b"}", b"{}", b"a", b"user", b"\x00", b"\xff", b"{x}", b"}{", b"123456789", b"kv:"]
    keys = [b"", b"{", b"}", b"{}", b"{}{a}", b"{a}{b}", b"a{b}c", b"{{a}}", b"{a", b"a}", b"\xff" * 40]
    while len(keys) < count:
        if rng.random() < 0.5:
            keys.append(b"".join(rng.choice(parts) for _ in range(rng.randint(1, 8))))
        else:
            keys.append(rng.randbytes(rng.randint(1, 64)))
    return keys


def test_keyslot_matches_redis(redis_cluster_node):
    keys = tricky_keys(3000)
    r = redis.Redis(redis_cluster_node.host, redis_cluster_node.port)
    pipe = r.pipeline(transaction=False)
    for key in keys:
        pipe.execute_command("CLUSTER", "KEYSLOT", key)
    expected = pipe.execute()
    assert [keyslot(k) for k in keys] == expected


@pytest.mark.parametrize("key, slot", [(b"123456789", 0x31C3 & (SLOTS - 1)), (b"foo", 12182),
                                       (b"{user1000}.following", keyslot(b"user1000")), (b"{}a", 10875),
                                       (b"a{}{b}", keyslot(b"a{}{b}")), (b"x{b}{c}", keyslot(b"b"))])
def test_keyslot_known_vectors(key, slot):
    assert keyslot(key) == slot


def three_node_map(epoch: int = 5) -> SlotMap:
    owners = [A] * 5461 + [B] * 5462 + [C] * 5461
    return SlotMap.build(epoch, {A: "127.0.0.1:7001", B: "127.0.0.1:7002", C: "127.0.0.1:7003"}, owners,
                         migrating={100: (A, B)})


def test_map_round_trips_through_json():
    slot_map = three_node_map()
    again = SlotMap.from_json(slot_map.to_json())
    assert again.same_as(slot_map)
    assert again.ranges == [(0, 5460, A), (5461, 10922, B), (10923, 16383, C)]
    assert again.counts == {A: 5461, B: 5462, C: 5461}
    assert again.owner(100) == A and again.migrating == {100: (A, B)}
    assert again.assigned == SLOTS


def test_partial_map_leaves_gaps_unassigned():
    owners = [A] * 100 + [None] * (SLOTS - 200) + [A] * 100
    slot_map = SlotMap.from_json(SlotMap.build(1, {A: "h:1"}, owners).to_json())
    assert slot_map.assigned == 200 and slot_map.owner(5000) is None
    assert slot_map.ranges == [(0, 99, A), (SLOTS - 100, SLOTS - 1, A)]


def doc() -> dict:
    """The older form: ranges and moves by node id (still read)."""
    m = three_node_map()
    return {"epoch": m.epoch, "nodes": dict(m.nodes), "slots": [list(r) for r in m.ranges],
            "migrating": [[slot, src, dst] for slot, (src, dst) in m.migrating.items()]}


def mutated(change) -> bytes:
    d = doc()
    change(d)
    return json.dumps(d).encode()


def compact(change) -> bytes:
    d = json.loads(three_node_map().to_json())
    change(d)
    return json.dumps(d).encode()


def test_compact_form_is_written_and_the_older_form_still_read():
    d = json.loads(three_node_map().to_json())
    assert d["runs"] == [5461, 0, 5462, 1, 5461, 2] and d["migrating"] == [[100, 0, 1]]
    assert SlotMap.from_json(json.dumps(doc()).encode()).same_as(three_node_map())


def test_compact_map_size_does_not_grow_with_node_ids_per_range():
    ids = ["%040x" % i for i in range(256)]
    owners = [ids[(slot * 7919) % 256] for slot in range(SLOTS)]           # every slot its own run
    slot_map = SlotMap.build(1, {node_id: f"10.0.{i // 250}.{i % 250}:7000" for i, node_id in enumerate(ids)},
                             owners)
    assert len(slot_map.to_json()) < 20 * 256 + 8 * SLOTS                # ids once, a few bytes a run
    assert SlotMap.from_json(slot_map.to_json()).same_as(slot_map)


@pytest.mark.parametrize("raw", [
    b"", b"not json", b"[]", b"\xff\xfe",
    mutated(lambda d: d.pop("epoch")),
    mutated(lambda d: d.update(extra=1)),
    mutated(lambda d: d.update(epoch=-1)),
    mutated(lambda d: d.update(epoch=1.5)),
    mutated(lambda d: d.update(epoch=True)),
    mutated(lambda d: d.update(epoch="3")),
    mutated(lambda d: d["nodes"].update({"xyz": "h:1"})),
    mutated(lambda d: d["nodes"].update({A.upper(): "h:1"})),
    mutated(lambda d: d["nodes"].update({A: "nohost"})),
    mutated(lambda d: d["nodes"].update({A: "h:0"})),
    mutated(lambda d: d["nodes"].update({A: "h:70000"})),
    mutated(lambda d: d["nodes"].update({A: "bad host:1"})),
    mutated(lambda d: d["nodes"].update({A: 7001})),
    mutated(lambda d: d["nodes"].update({A: "127.0.0.1:7002"})),            # two nodes, one address
    mutated(lambda d: d["slots"].append([0, 0, A])),                        # overlap
    mutated(lambda d: d["slots"].append([16384, 16384, A])),
    mutated(lambda d: d["slots"].__setitem__(0, [10, 5, A])),
    mutated(lambda d: d["slots"].__setitem__(0, [0, 5460, "d" * 40])),      # unknown owner
    mutated(lambda d: d["slots"].__setitem__(0, [0, "5460", A])),
    mutated(lambda d: d["slots"].__setitem__(0, [0, 5460])),
    mutated(lambda d: d.update(slots={})),
    compact(lambda d: d["runs"].extend([1, 0])),                            # 16385 slots
    compact(lambda d: d["runs"].__setitem__(0, 5460)),                      # 16383 slots
    compact(lambda d: d["runs"].__setitem__(1, 3)),                         # no such node
    compact(lambda d: d["runs"].__setitem__(1, -2)),
    compact(lambda d: d["runs"].__setitem__(1, "0")),
    compact(lambda d: d["runs"].append(1)),
    compact(lambda d: d.update(runs=[0, 0, 16384, 1])),
    compact(lambda d: d.update(runs={})),
    compact(lambda d: d["migrating"].__setitem__(0, [100, 0, 3])),
    compact(lambda d: d["migrating"].__setitem__(0, [100, 1, 2])),           # source is not the owner
    compact(lambda d: d["migrating"].__setitem__(0, [100, A, B])),           # ids in the compact form
    compact(lambda d: d.update(slots=[])),
    mutated(lambda d: d["migrating"].append([100, A, C])),                  # slot moved twice
    mutated(lambda d: d["migrating"].__setitem__(0, [100, B, C])),          # source is not the owner
    mutated(lambda d: d["migrating"].__setitem__(0, [100, A, A])),
    mutated(lambda d: d["migrating"].__setitem__(0, [100, A, "d" * 40])),
    b"{" * 100000,
    b" " * (3 * 1024 * 1024),
])
def test_malformed_maps_are_refused(raw):
    with pytest.raises(SlotMapError):
        SlotMap.from_json(raw)


def test_parsed_map_is_immutable():
    slot_map = SlotMap.from_json(three_node_map().to_json())
    with pytest.raises(ValueError):
        slot_map.owners[0] = 1
    assert np.array_equal(SlotMap.from_json(slot_map.to_json()).owners, slot_map.owners)
