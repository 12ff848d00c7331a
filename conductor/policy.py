"""Scheduling policies: which prefill instance and which decode instance serve a request.

Every policy sees the same `Candidates` (per prefill instance: seconds of
queued work and the number of leading prompt blocks cached on its node) and
returns a `Placement`; the four differ only in what they minimise:

- `random`: a uniformly random prefill and decode instance;
- `load-balance`: the prefill instance with the least queued work;
- `cache-aware` (local): queue time + prefill time of the part not cached on
  that instance's own node;
- `kvcache-centric` (global, Algorithm 1 of the Mooncake paper): for each
  instance, if the best match anywhere beats the local one by more than
  `balancing_threshold` times, the instance fetches the missing prefix from
  the best node (transfer time) and computes only what nobody holds;
  otherwise it computes what its own node lacks. It picks the least
  estimated TTFT; the fetch copies the blocks to the chosen node, so hot
  prefixes gain replicas as a side effect. In live mode the shared store is
  one more place to fetch from (`pool_blocks`, from KV.MATCH).

Whatever the policy, a prefill instance reuses what its own node caches (the
engine does that regardless of why the request landed there). All but
`random` pick the decode instance with the least predicted time between
tokens once the request joins its batch.

Each choice is a few numpy operations over the instances (a cluster of
hundreds is replayed for a million requests); the winner's `Placement` is
then built by the same scalar formulas, so it is exactly what the choice
compared.
"""
from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from conductor.costmodel import CostModel


FROM_POOL = -1


@dataclass(frozen=True)
class Candidates:
    """What a policy may look at for one request (per-instance sequences become arrays)."""

    input_length: int
    queue_s: np.ndarray     # seconds of queued work, per prefill instance
    local_blocks: np.ndarray    # leading prompt blocks cached on each instance's node
    block_tokens: int = 512
    pool_blocks: int = 0    # prefix held by the shared store (live mode), any node may fetch it

    def __post_init__(self) -> None:
        object.__setattr__(self, "queue_s", np.asarray(self.queue_s, dtype=float))
        object.__setattr__(self, "local_blocks", np.asarray(self.local_blocks, dtype=np.int64))


@dataclass(frozen=True)
class Placement:
    """A chosen prefill instance and what its prefill will cost."""

    prefill: int
    reused_blocks: int      # prefix blocks not recomputed (local + fetched)
    fetched_blocks: int     # of those, blocks pulled from another node
    source: int | None      # the node they come from (FROM_POOL: the shared store)
    service_s: float        # transfer + prefill time on the instance
    ttft_s: float           # queue + service: the predicted time to first token


@dataclass(frozen=True)
class DecodeLoad:
    """A decode instance as the decode choice sees it."""

    batch: float            # sequences (a prediction may count a fraction of one)
    kv_tokens: float


@dataclass(frozen=True)
class DecodeLoads:
    """Every decode instance as the decode choice sees it: one entry per instance."""

    batch: np.ndarray
    kv_tokens: np.ndarray

    def __len__(self) -> int:
        return len(self.batch)

    @classmethod
    def of(cls, loads: DecodeLoads | Sequence[DecodeLoad]) -> DecodeLoads:
        if isinstance(loads, DecodeLoads):
            return loads
        return cls(np.array([d.batch for d in loads], dtype=float),
                   np.array([d.kv_tokens for d in loads], dtype=float))


def _reused_tokens(blocks, c: Candidates):
    """Tokens not recomputed when ``blocks`` leading blocks are at hand (an int or an array)."""
    return np.minimum(blocks * c.block_tokens, c.input_length - 1)


def _local_service_s(c: Candidates, cost: CostModel) -> np.ndarray:
    """Per instance: the prefill time when it reuses only what its own node holds."""
    reused = _reused_tokens(c.local_blocks, c)
    return cost.prefill_s(c.input_length - reused, reused)


def local_placement(i: int, c: Candidates, cost: CostModel) -> Placement:
    """Instance ``i`` reusing only what its own node holds."""
    blocks = int(c.local_blocks[i])
    reused = int(_reused_tokens(blocks, c))
    service = cost.prefill_s(c.input_length - reused, reused)
    return Placement(i, blocks, 0, None, service, float(c.queue_s[i]) + service)


def least_tbt_decode(loads: DecodeLoads | Sequence[DecodeLoad], input_length: int,
                     cost: CostModel) -> int:
    """The decode instance whose step time would be smallest with this request added
    (the lowest index among equals)."""
    loads = DecodeLoads.of(loads)
    return int(np.argmin(cost.decode_step_s(loads.batch + 1, loads.kv_tokens + input_length)))


class Policy(ABC):
    """Chooses a prefill placement and a decode instance for a request."""

    name = ""

    def __init__(self, cost: CostModel, seed: int = 0):
        self.cost = cost
        self.rng = random.Random(seed)

    @abstractmethod
    def choose_prefill(self, c: Candidates) -> Placement:
        """The prefill instance for the request described by ``c``."""

    def choose_decode(self, loads: DecodeLoads | Sequence[DecodeLoad], input_length: int) -> int:
        return least_tbt_decode(loads, input_length, self.cost)


class RandomPolicy(Policy):
    name = "random"

    def choose_prefill(self, c: Candidates) -> Placement:
        return local_placement(self.rng.randrange(len(c.queue_s)), c, self.cost)

    def choose_decode(self, loads: DecodeLoads | Sequence[DecodeLoad], input_length: int) -> int:
        return self.rng.randrange(len(loads))


class LoadBalancePolicy(Policy):
    name = "load-balance"

    def choose_prefill(self, c: Candidates) -> Placement:
        return local_placement(int(np.argmin(c.queue_s)), c, self.cost)


class CacheAwarePolicy(Policy):
    name = "cache-aware"

    def choose_prefill(self, c: Candidates) -> Placement:
        ttft = c.queue_s + _local_service_s(c, self.cost)
        return local_placement(int(np.argmin(ttft)), c, self.cost)


class KVCacheCentricPolicy(Policy):
    name = "kvcache-centric"

    def __init__(self, cost: CostModel, seed: int = 0, balancing_threshold: float = 1.0):
        super().__init__(cost, seed)
        self.balancing_threshold = balancing_threshold

    def choose_prefill(self, c: Candidates) -> Placement:
        best_node = int(np.argmax(c.local_blocks))
        best = int(c.local_blocks[best_node])
        if c.pool_blocks > best:
            best_node, best = FROM_POOL, c.pool_blocks
        local = c.local_blocks
        stays = (best <= local * self.balancing_threshold) | (best == local)
        reused = int(_reused_tokens(best, c))
        fetched = reused - _reused_tokens(local, c)
        fetch_s = self.cost.transfer_s(fetched) + self.cost.prefill_s(c.input_length - reused, reused)
        ttft = c.queue_s + np.where(stays, _local_service_s(c, self.cost), fetch_s)
        return self._placement(int(np.argmin(ttft)), best_node, best, c)

    def _placement(self, i: int, best_node: int, best: int, c: Candidates) -> Placement:
        local = int(c.local_blocks[i])
        if best <= local * self.balancing_threshold or best == local:
            return local_placement(i, c, self.cost)
        reused = int(_reused_tokens(best, c))
        fetched = reused - int(_reused_tokens(local, c))
        service = self.cost.transfer_s(fetched) + self.cost.prefill_s(
            c.input_length - reused, reused)
        return Placement(i, best, best - local, best_node, service, float(c.queue_s[i]) + service)


POLICIES = {p.name: p for p in (RandomPolicy, LoadBalancePolicy, CacheAwarePolicy,
                                KVCacheCentricPolicy)}


def make_policy(name: str, cost: CostModel, seed: int = 0,
                balancing_threshold: float = 1.0) -> Policy:
    if name not in POLICIES:
        raise ValueError(f"unknown policy '{name}' (choose from {', '.join(POLICIES)})")
    if name == KVCacheCentricPolicy.name:
        return KVCacheCentricPolicy(cost, seed, balancing_threshold)
    return POLICIES[name](cost, seed)
