"""The simulated DRAM cache of each prefill node, and where every block lives.

Each node holds at most `capacity_blocks` blocks. Eviction is the store's own
policy (`kvstore.store.eviction.SampledLRU`: sampled LRU that evicts chain leaves
first), used as a library so a replay measures the policy we ship; this module
only maps trace block ids to the policy's slot ids and recycles freed slots.

`BlockDirectory` answers the scheduler's question, "how long a prefix of
these blocks does each node hold?", in one pass over the request's blocks
instead of one pass per node: it keeps, per block, a bitmask of the nodes
holding it, and walks the prefix ANDing masks until no node is left.
"""
from __future__ import annotations

import numpy as np

from kvstore.store.eviction import NO_PARENT, SampledLRU


class NodeCache:
    """One node's block cache: block id -> slot, eviction by SampledLRU."""

    def __init__(self, node: int, capacity_blocks: int, directory: BlockDirectory,
                 seed: int = 0):
        if capacity_blocks < 1:
            raise ValueError("a node cache needs room for at least one block")
        self.node = node
        self.capacity_blocks = capacity_blocks
        self.directory = directory
        self.policy = SampledLRU(capacity=min(capacity_blocks, 1 << 16), seed=seed + node)
        self.slots: dict[int, int] = {}
        self._block_of: dict[int, int] = {}
        self._free: list[int] = []
        self.evictions = 0

    def __contains__(self, block: int) -> bool:
        return block in self.slots

    def __len__(self) -> int:
        return len(self.slots)

    def touch(self, blocks) -> None:
        for b in blocks:
            self.policy.touch(self.slots[b])

    def pin(self, blocks) -> None:
        for b in blocks:
            self.policy.hold(self.slots[b])

    def unpin(self, blocks) -> None:
        for b in blocks:
            slot = self.slots.get(b)
            if slot is not None:
                self.policy.release_hold(slot)

    def insert_chain(self, blocks) -> int:
        """Cache a prefix chain (touching blocks already held); returns blocks added."""
        added = 0
        parent = NO_PARENT
        for b in blocks:
            slot = self.slots.get(b)
            if slot is None:
                if not self._make_room():
                    break
                slot = self._free.pop() if self._free else len(self._block_of)
                self.slots[b] = slot
                self._block_of[slot] = b
                self.policy.insert(slot, parent)
                self.directory.add(b, self.node)
                added += 1
            else:
                self.policy.touch(slot)
            parent = slot
        return added

    def _make_room(self) -> bool:
        while len(self.slots) >= self.capacity_blocks:
            victim = self.policy.victim()
            if victim is None:
                return False  # everything left is pinned by queued requests
            self._drop(victim)
        return True

    def _drop(self, slot: int) -> None:
        block = self._block_of.pop(slot)
        del self.slots[block]
        self.policy.remove(slot)
        self.directory.discard(block, self.node)
        self._free.append(slot)
        self.evictions += 1


class BlockDirectory:
    """Block id -> bitmask of the nodes that hold it."""

    def __init__(self) -> None:
        self._where: dict[int, int] = {}

    def add(self, block: int, node: int) -> None:
        self._where[block] = self._where.get(block, 0) | (1 << node)

    def discard(self, block: int, node: int) -> None:
        mask = self._where.get(block, 0) & ~(1 << node)
        if mask:
            self._where[block] = mask
        else:
            self._where.pop(block, None)

    def prefix_matches(self, blocks, n_nodes: int) -> np.ndarray:
        """For each node, how many leading ``blocks`` it holds.

        The masks of the nodes still matching shrink along the prefix; a node's
        match is the number of them it is in, counted over all nodes at once by
        unpacking the masks' bits (a shared first block is on every node, so a
        loop over nodes would cost one step per node per request).
        """
        alive = (1 << n_nodes) - 1
        where = self._where
        still_matching = []
        for b in blocks:
            alive &= where.get(b, 0)
            if not alive:
                break
            still_matching.append(alive)
        if not still_matching:
            return np.zeros(n_nodes, dtype=np.int64)
        width = (n_nodes + 7) // 8
        packed = b"".join(mask.to_bytes(width, "little") for mask in still_matching)
        bits = np.unpackbits(np.frombuffer(packed, dtype=np.uint8), bitorder="little")
        return bits.reshape(len(still_matching), width * 8)[:, :n_nodes].sum(axis=0, dtype=np.int64)
