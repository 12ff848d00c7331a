"""Unit tests of the leaf-preferring sampled LRU (kvstore.eviction).

The policy is driven directly over slot ids, as the engine drives it. What is
checked: a chain's leaves go before their parents (the issue: "a block whose
children are cached outlives them"), pinned entries are never chosen and
soft-pinned ones only last, among leaves the oldest goes first (exactly when
every slot is sampled, approximately with the default sample), removing a
parent orphans its children so a reused slot id is never taken for their
parent, and growing keeps what was recorded.

The policy samples with a seeded generator, so every test is deterministic.
"""
from __future__ import annotations

import random

import pytest

from kvstore.eviction import NO_PARENT, SampledLRU


def insert_chain(policy: SampledLRU, first: int, length: int) -> list[int]:
    """Slots first..first+length-1, each the parent of the next."""
    slots = list(range(first, first + length))
    for i, slot in enumerate(slots):
        policy.insert(slot, slots[i - 1] if i else NO_PARENT)
    return slots


def evict(policy: SampledLRU, n: int | None = None, parents_taken: list | None = None) -> list[int]:
    """Take victims one by one (all of them when n is None).

    Victims that still had children when chosen are also added to ``parents_taken``.
    """
    victims = []
    while policy.count and (n is None or len(victims) < n):
        victim = policy.victim()
        if victim is None:
            break
        if parents_taken is not None and not policy.is_leaf(victim):
            parents_taken.append(victim)
        victims.append(victim)
        policy.remove(victim)
    return victims


# ----------------------------------------------------------------- basics

def test_empty_policy_has_no_victim():
    policy = SampledLRU()
    assert policy.victim() is None and policy.count == 0


def test_count_follows_inserts_and_removes():
    policy = SampledLRU()
    for slot in range(5):
        policy.insert(slot)
    policy.remove(3)
    assert policy.count == 4
    assert 3 not in evict(policy)


def test_nbytes_per_slot_is_the_column_widths():
    policy = SampledLRU()
    assert 0 < policy.nbytes_per_slot() <= 32


# ----------------------------------------------------------------- chains

def test_a_parent_is_not_a_leaf_while_it_has_children():
    policy = SampledLRU()
    root, mid, leaf = insert_chain(policy, 0, 3)
    assert not policy.is_leaf(root) and not policy.is_leaf(mid) and policy.is_leaf(leaf)
    assert policy.parent_of(leaf) == mid and policy.parent_of(root) == NO_PARENT


def test_the_only_leaf_goes_first_even_when_touched_last():
    """Sampling sees every slot of a small table: the leaf is found."""
    policy = SampledLRU(samples=256)
    chain = insert_chain(policy, 0, 8)
    policy.touch(chain[-1])
    assert policy.victim() == chain[-1]


@pytest.mark.parametrize("seed", range(5))
def test_a_chain_is_evicted_from_its_leaf_back(seed):
    policy = SampledLRU(seed=seed)
    chain = insert_chain(policy, 0, 10)
    for slot in chain:                        # the root is the most recently used
        policy.touch(slot)
    policy.touch(chain[0])
    assert evict(policy) == chain[::-1]


def test_no_parent_goes_while_one_of_its_children_is_cached():
    policy = SampledLRU(capacity=1024, seed=3)
    for chain in range(100):
        insert_chain(policy, chain * 8, 8)
    rng = random.Random(3)
    for _ in range(500):
        policy.touch(rng.randrange(800))
    parents_taken: list[int] = []
    evict(policy, 400, parents_taken)
    assert parents_taken == []


def test_every_victim_is_a_leaf_when_chosen():
    policy = SampledLRU(capacity=1024, samples=1024, seed=5)
    for chain in range(32):
        insert_chain(policy, chain * 4, 4)
    parents_taken: list[int] = []
    victims = evict(policy, None, parents_taken)
    assert parents_taken == [] and len(victims) == 128
    assert victims[:4] == [3, 2, 1, 0], "the oldest chain goes first, from its leaf back"


def test_branches_of_a_shared_prefix_go_before_it():
    """Two prompts share a root: both tails go before the root, whichever child is remembered."""
    policy = SampledLRU(samples=512)
    policy.insert(0)                          # the shared root, the oldest entry
    policy.insert(1, 0)
    policy.insert(2, 0)
    policy.insert(3, 1)
    policy.insert(4)                          # an unrelated, newer entry
    victims = evict(policy)
    assert victims.index(0) > max(victims.index(1), victims.index(2), victims.index(3))
    assert victims.index(3) < victims.index(1)


# ----------------------------------------------------------------- pins

def test_pinned_entries_are_never_chosen():
    policy = SampledLRU(capacity=64, seed=1)
    rng = random.Random(1)
    for slot in range(64):
        policy.insert(slot, rng.randrange(slot) if slot and rng.random() < 0.5 else NO_PARENT)
    pinned = set(rng.sample(range(64), 40))
    for slot in pinned:
        policy.pin(slot)
    victims = evict(policy)
    assert not pinned & set(victims)
    assert len(victims) == 24 and policy.count == 40
    assert policy.victim() is None


def test_pins_count_and_unpin_releases():
    policy = SampledLRU()
    policy.insert(0)
    policy.pin(0)
    policy.pin(0)
    policy.unpin(0)
    assert policy.is_pinned(0) and policy.victim() is None
    policy.unpin(0)
    policy.unpin(0)                          # one unpin too many is harmless
    assert not policy.is_pinned(0) and policy.victim() == 0


def test_a_pinned_leaf_lets_its_parent_go():
    policy = SampledLRU(samples=256)
    root, leaf = insert_chain(policy, 0, 2)
    policy.pin(leaf)
    assert policy.victim() == root


def test_a_soft_pinned_child_is_not_taken_for_its_old_parent():
    """The oldest entry's chain leads to a soft-pinned block: an unpinned leaf goes instead."""
    policy = SampledLRU(samples=512)
    policy.insert(0)
    policy.insert(1, 0)
    policy.soft_pin(1)
    policy.insert(2)
    policy.insert(3)
    assert policy.victim() in (2, 3)


def test_soft_pinned_entries_go_last():
    policy = SampledLRU(capacity=16, samples=512, seed=2)
    for slot in range(8):
        policy.insert(slot)
    for slot in (0, 1, 2):                    # the oldest ones
        policy.soft_pin(slot)
    victims = evict(policy)
    assert set(victims[:5]) == {3, 4, 5, 6, 7}
    assert set(victims[5:]) == {0, 1, 2}


# ----------------------------------------------------------------- recency

def test_oldest_leaf_goes_first_when_every_slot_is_sampled():
    policy = SampledLRU(samples=512, seed=0)
    for slot in range(8):
        policy.insert(slot)
    for slot in (5, 2, 7, 0, 3, 6, 1, 4):
        policy.touch(slot)
    assert evict(policy) == [5, 2, 7, 0, 3, 6, 1, 4]


def test_default_sampling_evicts_from_the_old_half():
    policy = SampledLRU(capacity=2048, seed=9)
    order = list(range(2000))
    random.Random(9).shuffle(order)
    for slot in order:
        policy.insert(slot)
    age_rank = {slot: rank for rank, slot in enumerate(order)}
    victims = evict(policy, 200)
    assert max(age_rank[v] for v in victims) < 1000
    assert sum(age_rank[v] for v in victims) / len(victims) < 300


# ----------------------------------------------------------------- removal

def test_removing_a_parent_orphans_its_children():
    policy = SampledLRU()
    policy.insert(0)
    policy.insert(1, 0)
    policy.insert(2, 0)
    policy.remove(0)
    assert policy.parent_of(1) == NO_PARENT and policy.parent_of(2) == NO_PARENT
    policy.insert(0)                          # the slot id is reused by an unrelated entry
    policy.insert(3, 0)
    policy.remove(1)
    policy.remove(2)
    assert not policy.is_leaf(0), "a former child's removal must not touch the reused slot"
    policy.remove(3)
    assert policy.is_leaf(0)


def test_removing_a_child_makes_its_parent_a_leaf_again():
    policy = SampledLRU()
    root, mid, leaf = insert_chain(policy, 0, 3)
    policy.remove(leaf)
    assert policy.is_leaf(mid) and not policy.is_leaf(root)


def test_a_dead_parent_is_not_linked():
    policy = SampledLRU()
    policy.insert(0)
    policy.remove(0)
    policy.insert(1, 0)
    assert policy.parent_of(1) == NO_PARENT


# ----------------------------------------------------------------- growth

def test_growth_keeps_links_and_stamps():
    policy = SampledLRU(capacity=4, samples=512)
    chain = insert_chain(policy, 0, 4)
    policy.insert(100, chain[-1])
    assert policy.capacity >= 101
    assert policy.parent_of(100) == chain[-1] and not policy.is_leaf(chain[-1])
    assert evict(policy) == [100, *chain[::-1]]


def test_grow_at_least_doubles():
    policy = SampledLRU(capacity=10)
    policy.grow(11)
    assert policy.capacity == 20
    policy.grow(5)
    assert policy.capacity == 20
    policy.grow(100)
    assert policy.capacity == 100
