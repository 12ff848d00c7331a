"""Unit tests of the shared index (kvstore/local/shared_index.py, client/shared_index.py), in one
process: an engine with a small arena, the node's table over it, and the client's
read-only view of the same memfd.

What is checked: a committed DRAM value is published where the engine has it, and every
way a value's bytes can change or go empties its bucket *before* that happens (delete,
overwrite elsewhere and in place, expiry set, eviction, flush, demotion to SSD, a move to
the GPU tier: a listener added after the index's sees the bucket already changed); a value
back in DRAM is published again at once; a value on SSD alone is published with the tag
of its payload (kept before activation, bounded, never outliving the value); keys are compared exactly (two keys with one
hash stay apart; a full set or a long key is a miss, never a wrong value); a bucket being
written is a miss; nothing is published before activation.
"""
from __future__ import annotations

import numpy as np
import pytest

from client.shared_index import SharedIndexView
from kvstore.store.engine import Engine
from kvstore.local.shared_index import SharedIndex, buckets_for
from proto import fastpath as fp

KiB, MiB = 1 << 10, 1 << 20


@pytest.fixture
def node():
    engine = Engine(4 * MiB, prefault=False)
    index = SharedIndex(engine)
    index.activate()
    yield engine, index, SharedIndexView(index.fd, index.buckets)
    engine.close()


def value(seed: int, size: int = 64 * KiB) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


def read(engine: Engine, view: SharedIndexView, key: bytes) -> bytes | None:
    """What a client would get from the index: the bytes, when the bucket held still."""
    found = view.find(key)
    if found is None:
        return None
    at, seq, offset, size = found
    data = bytes(engine.arena.view[offset:offset + size])
    return data if view.unchanged(at, seq) else None


def changed_first(engine: Engine, view: SharedIndexView, key: bytes, listeners: list) -> list[bool]:
    """A probe listener after the index's: whether the bucket of ``key`` had changed when
    the engine went on to let the bytes go."""
    at, seq, _, _ = view.find(key)
    seen: list[bool] = []
    listeners.append(lambda *args: seen.append(not view.unchanged(at, seq)))
    return seen


def test_a_committed_value_is_published_where_the_engine_has_it(node):
    engine, index, view = node
    engine.put(b"k", value(1))
    at, seq, offset, size = view.find(b"k")
    slot = engine.index[b"k"]
    assert (offset, size) == (engine.entries.dram_offset(slot), 64 * KiB) and seq % 2 == 0
    assert read(engine, view, b"k") == value(1)
    assert view.find(b"absent") is None
    assert index.info()["index_entries"] == 1


@pytest.mark.parametrize("change", ["delete", "overwrite elsewhere", "flush"])
def test_a_value_leaving_the_index_is_retracted_before_its_bytes_go(node, change):
    engine, _, view = node
    engine.put(b"k", value(1))
    seen = changed_first(engine, view, b"k", engine.drop_listeners)
    if change == "delete":
        engine.delete(b"k")
    elif change == "overwrite elsewhere":
        engine.put(b"k", value(2, 100 * KiB))             # another size: a new extent
    else:
        engine.flush()
    assert seen == [True]
    assert read(engine, view, b"k") == (value(2, 100 * KiB) if change == "overwrite elsewhere" else None)


def test_an_overwrite_in_place_is_retracted_before_the_bytes_change(node):
    engine, _, view = node
    engine.put(b"k", value(1))
    offset = view.find(b"k")[2]
    seen = changed_first(engine, view, b"k", engine.overwrite_listeners)
    engine.put(b"k", value(2))                            # same size, not held: rewritten in place
    assert seen == [True] and engine.entries.dram_offset(engine.index[b"k"]) == offset
    assert view.find(b"k") is None                        # until its next hit
    engine.get_entry(b"k")
    assert read(engine, view, b"k") == value(2)


def test_a_key_with_an_expiry_is_never_published(node):
    engine, _, view = node
    engine.put(b"k", value(1))
    seen = changed_first(engine, view, b"k", engine.expiry.listeners)
    engine.expiry.set(b"k", 2**62)
    assert seen == [True] and view.find(b"k") is None
    engine.get_entry(b"k")
    assert view.find(b"k") is None                        # a hit does not publish it
    engine.expiry.persist(b"k")
    engine.get_entry(b"k")
    assert read(engine, view, b"k") == value(1)           # without the expiry it is published again


def test_demotion_and_a_move_to_the_gpu_retract_before_the_extent_is_freed(node):
    engine, _, view = node
    for key in (b"ssd", b"gpu"):
        engine.put(key, value(3))
    seen = {key: changed_first(engine, view, key, engine.moves.leave_listeners) for key in (b"ssd", b"gpu")}
    engine.moves.mark_on_ssd(engine.index[b"ssd"])
    engine.moves.demoted_to_ssd(engine.index[b"ssd"])
    engine.moves.moved_to_gpu(engine.index[b"gpu"])
    assert seen[b"ssd"][0] and seen[b"gpu"][1]            # each probe saw its own bucket changed first
    assert view.find(b"ssd") is None and view.find(b"gpu") is None


def test_a_value_back_in_dram_is_published_where_it_now_is(node):
    engine, _, view = node
    engine.put(b"k", value(4))
    slot = engine.index[b"k"]
    engine.moves.mark_on_ssd(slot)
    engine.moves.demoted_to_ssd(slot)
    assert view.find(b"k") is None                        # on SSD with no tag: not published
    extent = engine.reserve(64 * KiB)
    extent.view[:] = value(4)
    engine.moves.home_in_dram(slot, extent)               # promoted: no commit
    assert read(engine, view, b"k") == value(4)


def ssd_entry(view: SharedIndexView, key: bytes) -> tuple[int, int] | None:
    """(tag, size) of ``key`` when the index shows it on SSD alone."""
    found = view.find(key)
    if found is None or not found[2] & fp.INDEX_ON_SSD:
        return None
    return found[2] & fp.INDEX_TAG_MASK, found[3]


def demote_with_tag(engine: Engine, key: bytes) -> int:
    """Demote ``key`` as the tier manager does after writing its plain payload: its tag."""
    slot = engine.index[key]
    tag = fp.ssd_tag(bytes(engine.view(slot)))
    engine.moves.mark_on_ssd(slot, tag)
    engine.moves.demoted_to_ssd(slot)
    return tag


def test_a_value_on_ssd_alone_is_published_with_its_tag_until_it_changes(node):
    engine, _, view = node
    for key in (b"a", b"b", b"c", b"d"):
        engine.put(key, value(5))
    tags = {key: demote_with_tag(engine, key) for key in (b"a", b"b", b"c", b"d")}
    assert all(ssd_entry(view, key) == (tags[key], 64 * KiB) for key in tags)
    found = view.find(b"a")
    engine.delete(b"a")
    assert view.find(b"a") is None and not view.unchanged(found[0], found[1])
    engine.put(b"b", value(6))                            # overwritten: the SSD copy is stale
    assert read(engine, view, b"b") == value(6)
    engine.expiry.set(b"c", 2**62)
    assert view.find(b"c") is None
    extent = engine.reserve(64 * KiB)
    extent.view[:] = value(5)
    engine.moves.home_in_dram(engine.index[b"d"], extent)  # promoted: now read from DRAM
    assert ssd_entry(view, b"d") is None and read(engine, view, b"d") == value(5)


def test_a_compressed_copy_is_not_published_and_a_tag_does_not_outlive_its_value(node):
    engine, _, view = node
    engine.put(b"k", value(7))
    slot = engine.index[b"k"]
    engine.moves.mark_on_ssd(slot, 0)                     # lz4'd on SSD: only the node decodes it
    engine.moves.demoted_to_ssd(slot)
    assert view.find(b"k") is None
    engine.put(b"j", value(8))
    slot = engine.index[b"j"]
    engine.moves.mark_on_ssd(slot, 12345)
    engine.put(b"j", value(9))                            # overwritten: the copy on SSD is stale
    engine.put(b"new", value(10))                         # takes the freed slot id
    assert engine.index[b"new"] == slot
    engine.moves.mark_on_ssd(slot)
    engine.moves.demoted_to_ssd(slot)
    assert view.find(b"new") is None                      # the old value's tag went with it


@pytest.fixture
def unmapped():
    """An engine and its index before any client mapped the arena (not activated)."""
    engine = Engine(1 * MiB, prefault=False)
    yield engine, SharedIndex(engine)
    engine.close()


def test_values_loaded_from_ssd_before_the_first_mapping_are_published_when_it_is_made(unmapped):
    engine, index = unmapped
    for i in range(3):
        engine.add_from_ssd(b"k%d" % i, 1000 + i, None, tag=100 + i)
    engine.add_from_ssd(b"plain", 10, None)               # no tag: asked of the node
    index.activate()
    view = SharedIndexView(index.fd, index.buckets)
    assert [ssd_entry(view, b"k%d" % i) for i in range(3)] == [(100 + i, 1000 + i) for i in range(3)]
    assert view.find(b"plain") is None


def test_tags_are_kept_for_at_most_as_many_values_as_the_table_has_buckets(unmapped):
    engine, index = unmapped
    most = buckets_for(engine.arena.size)
    for i in range(most + 10):
        engine.add_from_ssd(b"k%d" % i, 10, None, tag=i + 1)
    assert len(index._ssd_tags) == most
    engine.delete(b"k0")
    engine.add_from_ssd(b"again", 10, None, tag=7)
    assert len(index._ssd_tags) == most and index._ssd_tags[engine.index[b"again"]] == 7


def test_eviction_retracts_the_evicted_values():
    engine = Engine(1 * MiB, prefault=False)
    try:
        index = SharedIndex(engine)
        index.activate()
        view = SharedIndexView(index.fd, index.buckets)
        for n in range(40):
            engine.put(f"k{n}".encode(), value(n))        # 2.5 MiB through a 1 MiB arena
        present = [n for n in range(40) if f"k{n}".encode() in engine.index]
        assert engine.stats.evictions > 0
        for n in range(40):
            got = read(engine, view, f"k{n}".encode())
            assert got == (value(n) if n in present else None)
        assert index.info()["index_entries"] == len(present)
    finally:
        engine.close()


def test_keys_sharing_a_hash_stay_apart_and_a_full_set_is_a_miss(node, monkeypatch):
    engine, index, view = node
    monkeypatch.setattr(fp, "index_hash", lambda key: 12345)
    keys = [f"same{n}".encode() for n in range(fp.INDEX_WAYS + 1)]
    for n, key in enumerate(keys):
        engine.put(key, value(n, 4 * KiB))
    for n, key in enumerate(keys[:-1]):
        assert read(engine, view, key) == value(n, 4 * KiB)
    assert view.find(keys[-1]) is None and index.stats.index_set_full == 1
    engine.delete(keys[0])                                # a bucket frees; the next hit takes it
    engine.get_entry(keys[-1])
    assert read(engine, view, keys[-1]) == value(fp.INDEX_WAYS, 4 * KiB)


def test_a_long_key_is_not_published_and_a_bucket_being_written_is_a_miss(node):
    engine, index, view = node
    long_key = b"x" * (fp.INDEX_KEY_MAX + 1)
    engine.put(long_key, value(5))
    assert view.find(long_key) is None
    engine.put(b"k", value(6))
    at = view.find(b"k")[0]
    index._words[at + fp.INDEX_SEQ] += 1                 # as if the node were half-way through a write
    assert view.find(b"k") is None
    index._words[at + fp.INDEX_SEQ] += 1
    assert read(engine, view, b"k") == value(6)


def test_nothing_is_published_before_the_first_mapping():
    engine = Engine(1 * MiB, prefault=False)
    try:
        index = SharedIndex(engine)
        engine.put(b"early", value(7))
        assert not index.active and not engine.commit_listeners
        index.activate()
        index.activate()                                  # once only
        view = SharedIndexView(index.fd, index.buckets)
        assert view.find(b"early") is None                # committed before: published on a hit
        engine.get_entry(b"early")
        assert read(engine, view, b"early") == value(7)
        assert engine.commit_listeners.count(index._on_commit) == 1
    finally:
        engine.close()


def test_the_table_grows_with_the_arena_in_powers_of_two():
    assert buckets_for(1 * MiB) == 4096
    assert buckets_for(1 << 30) == 65536
    assert buckets_for(1 << 40) == 1 << 18
    with pytest.raises(ValueError):
        SharedIndexView(-1, 12)


def test_nothing_follows_writes_before_a_mapping_or_a_value_on_ssd(unmapped):
    """The index costs a node's writes nothing until a client maps the arena or a plain value
    lands on SSD (the redis-py and redis-benchmark paths stay as they were)."""
    engine, index = unmapped

    def following() -> int:
        listeners = engine.drop_listeners + engine.overwrite_listeners + engine.expiry.listeners
        return sum(getattr(listener, "__self__", None) is index for listener in listeners)
    engine.put(b"k", value(1))
    engine.put(b"k", value(2))
    assert following() == 0
    engine.moves.mark_on_ssd(engine.index[b"k"], 5)
    assert following() == 3
    index.activate()
    assert following() == 3
