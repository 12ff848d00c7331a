"""Unit tests of the leaf-only sampled LRU (kvstore.store.eviction).

The policy is driven directly over slot ids, as the engine drives it. What is
checked: a chain's leaves go before their parents ("a block whose children
are cached outlives them"), held entries are never chosen and soft-pinned
ones only last, among leaves the oldest goes first (exactly when every leaf
is sampled, approximately with the default sample), removing a parent
orphans its children so a reused slot id is never taken for their parent,
and growing keeps what was recorded. Places (the engine's tiers): the last
block of a chain in DRAM is DRAM's leaf while the tail is on SSD, a clean-only
choice returns clean leaves and nothing else. Links from clients: a slot is
never its own parent and a replacement never adopts children that could close
a cycle; a random mix of every operation keeps the bookkeeping exact; a long
chain drains in time linear in its length.

The policy samples with a seeded generator, so every test is deterministic.
"""
from __future__ import annotations

import random

import pytest

from kvstore.store.eviction import KIND_OF_MARKS, KINDS, NO_PARENT, SampledLRU

DRAM, SSD = 0, 1


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


def test_nbytes_per_entry_is_the_column_widths():
    policy = SampledLRU()
    assert 0 < policy.nbytes_per_entry() <= 32


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

def test_held_entries_are_never_chosen():
    policy = SampledLRU(capacity=64, seed=1)
    rng = random.Random(1)
    for slot in range(64):
        policy.insert(slot, rng.randrange(slot) if slot and rng.random() < 0.5 else NO_PARENT)
    held = set(rng.sample(range(64), 40))
    for slot in held:
        policy.hold(slot)
    victims = evict(policy)
    assert not held & set(victims)
    assert len(victims) == 24 and policy.count == 40
    assert policy.victim() is None


def test_holds_count_and_release_lets_go():
    policy = SampledLRU()
    policy.insert(0)
    policy.hold(0)
    policy.hold(0)
    policy.release_hold(0)
    assert policy.is_held(0) and policy.victim() is None
    policy.release_hold(0)
    policy.release_hold(0)                   # one release too many is harmless
    assert not policy.is_held(0) and policy.victim() == 0


def test_a_held_leaf_lets_its_parent_go_only_when_progress_matters():
    policy = SampledLRU(samples=256)
    root, leaf = insert_chain(policy, 0, 2)
    policy.hold(leaf)
    assert policy.victim(allow_parent=False) is None, "a demotion waits for the read"
    assert policy.victim() == root


def test_a_parent_goes_only_when_every_leaf_is_held():
    policy = SampledLRU(samples=256)
    root, leaf = insert_chain(policy, 0, 2)
    other = 2
    policy.insert(other)                     # newer than the chain
    policy.hold(leaf)
    assert policy.victim() == other
    policy.remove(other)
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


def test_growth_is_geometric():
    policy = SampledLRU(capacity=80)
    policy.grow(81)
    assert policy.capacity == 90
    policy.grow(5)
    assert policy.capacity == 90
    policy.grow(1000)
    assert policy.capacity == 1000


# ----------------------------------------------------------------- places

def test_the_last_block_in_dram_is_drams_leaf_while_the_tail_is_on_ssd():
    policy = SampledLRU(samples=256, places=2)
    chain = insert_chain(policy, 0, 6)
    for slot in chain[3:]:
        policy.move(slot, SSD)
    assert policy.victim(DRAM, allow_parent=False) == chain[2]
    assert policy.victim(SSD, allow_parent=False) == chain[5]


def test_moving_a_block_back_up_makes_its_parent_a_non_leaf_again():
    policy = SampledLRU(samples=256, places=2)
    root, mid, leaf = insert_chain(policy, 0, 3)
    policy.move(leaf, SSD)
    policy.move(mid, SSD)
    assert policy.victim(DRAM, allow_parent=False) == root
    policy.move(mid, DRAM)
    assert policy.victim(DRAM, allow_parent=False) == mid
    assert policy.victim(SSD, allow_parent=False) == leaf


def test_clean_only_returns_clean_leaves_and_nothing_else():
    """The engine lets a clean DRAM copy go without writing it: a dirty entry, a
    parent above a held leaf or a soft-pinned one must never come back."""
    policy = SampledLRU(samples=256, places=2)
    root, leaf = insert_chain(policy, 0, 2)
    policy.hold(leaf)
    policy.insert(2)
    policy.soft_pin(2)
    policy.mark_clean(2)
    policy.insert(3)
    assert policy.victim(DRAM, clean_only=True) is None
    policy.mark_clean(3)
    assert policy.victim(DRAM, clean_only=True) == 3


def test_soft_pinned_leaves_go_before_a_parent_of_a_held_leaf():
    policy = SampledLRU(samples=256)
    root, leaf = insert_chain(policy, 0, 2)
    policy.hold(leaf)
    policy.insert(2)
    policy.soft_pin(2)
    assert policy.victim() == 2


# ----------------------------------------------------------------- links from clients

def test_a_slot_is_never_its_own_parent():
    policy = SampledLRU()
    policy.insert(0, 0)
    assert policy.parent_of(0) == NO_PARENT and policy.is_leaf(0)
    assert policy.victim() == 0


def test_a_replacement_under_another_parent_does_not_adopt_its_children():
    """a -> b -> c, then a re-put under c: adopting b would close the cycle a -> b -> c -> a."""
    policy = SampledLRU(samples=256)
    a, b, c = insert_chain(policy, 0, 3)
    policy.insert(3, c)                      # the new value of a, hanging from c
    policy.adopt_children(a, 3)
    policy.remove(a)
    assert policy.parent_of(b) == NO_PARENT and policy.parent_of(3) == c
    assert evict(policy) == [3, c, b]


def test_a_replacement_under_the_same_parent_takes_over_the_children():
    policy = SampledLRU(samples=256)
    root, mid, leaf = insert_chain(policy, 0, 3)
    policy.insert(3, root)                   # the new value of mid
    policy.adopt_children(mid, 3)
    policy.remove(mid)
    assert policy.parent_of(leaf) == 3 and not policy.is_leaf(3)
    assert evict(policy) == [leaf, 3, root]


def assert_bookkeeping_exact(policy: SampledLRU, live: set[int]) -> None:
    """Every live entry's children list, same-place count and candidate list agree."""
    in_lists = 0
    for slot in range(policy.capacity):
        if policy._place[slot] < 0:
            assert slot not in live
            continue
        children, child = [], policy._first_child[slot]
        while child != NO_PARENT:
            assert policy._parent[child] == slot
            children.append(child)
            child = policy._next_sibling[child]
        same = sum(policy._place[c] == policy._place[slot] for c in children)
        at = policy._leaf_pos[slot]
        if same:
            assert at == -same, (slot, at, same)
        else:
            lid = policy._place[slot] * KINDS + KIND_OF_MARKS[policy._marks[slot]]
            assert at >= 0 and policy._lists[lid][at] == slot, (slot, at, lid)
            in_lists += 1
    assert in_lists == sum(len(members) for members in policy._lists) and policy.count == len(live)


def acyclic(policy: SampledLRU, live: set[int]) -> bool:
    for slot in live:
        node, steps = slot, 0
        while node != NO_PARENT:
            node, steps = policy.parent_of(node), steps + 1
            if steps > len(live):
                return False
    return True


@pytest.mark.parametrize("seed", range(4))
def test_a_random_mix_of_operations_keeps_the_bookkeeping_exact(seed):
    rng = random.Random(seed)
    policy = SampledLRU(capacity=4, samples=8, seed=seed, places=3)
    live: set[int] = set()
    free = list(range(60))
    for _ in range(3000):
        op = rng.random()
        if op < 0.3 and free:
            slot = free.pop(rng.randrange(len(free)))
            parent = rng.choice(sorted(live)) if live and rng.random() < 0.8 else rng.choice([NO_PARENT, slot])
            policy.insert(slot, parent, rng.randrange(3))
            live.add(slot)
        elif op < 0.4 and live:
            slot = rng.choice(sorted(live))
            policy.remove(slot)
            live.discard(slot)
            free.append(slot)
        elif op < 0.55 and live:
            policy.move(rng.choice(sorted(live)), rng.randrange(3))
        elif op < 0.65 and live:
            slot = rng.choice(sorted(live))
            policy.hold(slot) if rng.random() < 0.5 else policy.release_hold(slot)
        elif op < 0.7 and live:
            policy.soft_pin(rng.choice(sorted(live)), rng.random() < 0.5)
        elif op < 0.75 and live:
            policy.mark_clean(rng.choice(sorted(live)), rng.random() < 0.5)
        elif op < 0.8 and live:
            policy.touch(rng.choice(sorted(live)))
        elif op < 0.85 and live and free:   # a key re-put, under any parent
            old, new = rng.choice(sorted(live)), free.pop()
            parent = rng.choice(sorted(live)) if rng.random() < 0.5 else policy.parent_of(old)
            policy.insert(new, parent, policy._place[old])
            policy.adopt_children(old, new)
            policy.remove(old)
            live.discard(old)
            live.add(new)
            free.append(old)
        else:
            place, clean_only, allow_parent = rng.randrange(3), rng.random() < 0.3, rng.random() < 0.5
            victim = policy.victim(place, clean_only=clean_only, allow_parent=allow_parent)
            if victim is not None:
                assert policy._place[victim] == place and not policy.is_held(victim)
                if clean_only or not allow_parent:
                    assert policy._leaf_pos[victim] >= 0, "only a leaf of its place"
                if clean_only:
                    assert policy._marks[victim] & 1, "only a clean entry"
                policy.remove(victim)
                live.discard(victim)
                free.append(victim)
        assert_bookkeeping_exact(policy, live)
        assert acyclic(policy, live)


# ----------------------------------------------------------------- cost

def test_a_chain_drains_from_its_tail_while_newer_leaves_wait():
    """Once a chain's tail goes, its (older) parent is the next victim, not a newer
    leaf: the chain drains block after block."""
    policy = SampledLRU(samples=8, seed=4)
    chain = insert_chain(policy, 0, 500)
    for slot in range(500, 600):            # newer, unrelated values
        policy.insert(slot)
    victims = evict(policy, 600)
    start = victims.index(chain[-1])
    assert victims[start:start + 500] == chain[::-1]


@pytest.mark.timeout(120)
def test_a_long_chain_drains_in_linear_time():
    """200,000 blocks in one chain: walking down from the oldest block for every
    victim would take hours; a leaf list takes seconds."""
    policy = SampledLRU(capacity=1 << 18)
    chain = insert_chain(policy, 0, 200_000)
    policy.insert(200_000)
    victims = evict(policy, 200_000)
    assert victims == chain[::-1]
