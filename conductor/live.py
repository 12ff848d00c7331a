"""The conductor's state in live mode: registered instances, their reported load, the store.

The same `Policy` and `Admission` objects as the simulator decide; this
module only supplies what they look at. Prefill queue time and decode batch
come from the instances' own `ReportLoad` pushes; between two pushes the
conductor adds the work it has just placed, so a burst of requests does not
all land on the instance that reported last. Which prefix blocks each prefill
node holds is the conductor's record of what it sent there (kept with the
same `NodeCache` as the simulator); the longest prefix held by the shared
store comes from `KV.MATCH`, and where those blocks sit from `KV.LOCATE`
(the store is one node or a cluster: `conductor.stores`).

Liveness is the same reports' absence: an instance that has not reported for
`report_timeout_s` (registration counts as a report) is dead. The policy
then sees only the live instances, so no policy (not even `random`, which
ignores load) sends it work, and `status` names it; its next report makes it
live again. A front end that fails to reach an instance says so
(`mark_unreachable`), which makes it dead at once rather than a timeout later;
only a report sent after the mark (reports say how old they are) takes it
back, so one already on its way when the mark came does not make it flap.

Workers restarted with fresh ids (role-pid) register as new instances, so
the dead ones would pile up: an instance silent for `FORGET_AFTER_TIMEOUTS`
report timeouts gives its place (its index, with an empty cache record) to
the next instance of its role that registers, and is forgotten.
"""
from __future__ import annotations

import bisect
import dataclasses
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from client import BlockHasher, KVError
from conductor.admission import REJECT_TTFT, Admission, Slo
from conductor.audit import Audit
from conductor.cache import BlockDirectory, NodeCache
from conductor.costmodel import CostModel
from conductor.decode import DecodeView
from conductor.fit_odds import FitOdds
from conductor.outputs import OUTPUT_PRIOR_TOKENS
from conductor.overtaking import RecentAdmissions
from conductor.policy import FROM_POOL, Candidates, DecodeLoad, Placement, Policy
from conductor.simulator import SimConfig, Simulator
from conductor.stores import Store
from conductor.trace import TraceRequest

PREFILL, DECODE = "prefill", "decode"
LIVE, DEAD = "live", "dead"
DEFAULT_REPORT_TIMEOUT_S = 2.0
MAX_PREFILL_INSTANCES = 60
# An instance silent this many report timeouts is taken for gone for good (its place goes to a newcomer).
# Far above one timeout, so a worker that is merely slow, paused or cut off for a while keeps its place and
# the record of what its cache holds, and comes back with its next report; low enough that workers
# restarted under new ids do not fill the prefill places or grow the decode list without end.
FORGET_AFTER_TIMEOUTS = 10

log = logging.getLogger(__name__)


class Rejected(Exception):
    """The request cannot meet its SLO; ``reason`` is REJECT_TTFT or REJECT_DECODE."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


class LiveAudit:
    """The audited admission in live mode: the fixed modes of `audit` replayed, on the
    conductor's cost model, with the arrivals it schedules (`conductor.audit`).

    Each arrival becomes a trace request: its time on the conductor's clock, its input
    length and block keys (numbered as they first appear), and its output length as
    the request gives it (else the prior). The shadows are simulated clusters of as
    many prefill and decode instances as were live at the first arrival; when that
    changes, or after `RESTART_AFTER` arrivals (the replay keeps every request), they
    start again from empty: the audit forgets the arrivals they had not resolved, and
    what they served stays in its windows until it ages out of them.
    """

    RESTART_AFTER = 100_000

    def __init__(self, audit: Audit, cost: CostModel, slo: Slo, policy: str,
                 cache_tokens_per_node: int, block_tokens: int):
        self.audit, self.cost, self.slo, self.policy = audit, cost, slo, policy
        self.cache_tokens_per_node, self.block_tokens = cache_tokens_per_node, block_tokens
        self.shape: tuple[int, int] | None = None
        self.trace: list[TraceRequest] = []
        self.shadows: dict[str, Simulator] = {}
        self._ids: dict[str, int] = {}
        self._start_s = 0.0
        self.restarts = 0

    def _start(self, now_s: float, shape: tuple[int, int]) -> None:
        if self.shadows:
            self.restarts += 1
            self.audit.forget_open()
        self.shape, self.trace, self._ids, self._start_s = shape, [], {}, now_s
        config = SimConfig(prefill=shape[0], decode=shape[1], policy=self.policy, slo=self.slo,
                           cache_tokens_per_node=self.cache_tokens_per_node,
                           block_tokens=self.block_tokens)
        self.shadows = {m: Simulator(self.trace, dataclasses.replace(config, admission=m),
                                     self.cost, on_outcome=self._resolver(m))
                        for m in self.audit.modes}

    def _resolver(self, mode: str) -> Callable[[int, bool], None]:
        offset = self.restarts
        audit = self.audit
        return lambda rid, served: audit.resolve(mode, (offset, rid), served)

    def arrive(self, now_s: float, shape: tuple[int, int], keys: list[str], input_length: int,
               output_length: int) -> str:
        """Feed one arrival to the shadows; returns the mode in force for it."""
        if shape != self.shape or len(self.trace) >= self.RESTART_AFTER:
            self._start(now_s, shape)
        at_s = now_s - self._start_s
        rid = len(self.trace)
        ids = tuple(self._ids.setdefault(k, len(self._ids)) for k in keys)
        request = TraceRequest(at_s, input_length, output_length or OUTPUT_PRIOR_TOKENS, ids)
        self.trace.append(request)
        for shadow in self.shadows.values():
            shadow.out.ensure(rid + 1)
            shadow._drain(at_s)
        mode = self.audit.decided(now_s)
        self.audit.arrived((self.restarts, rid))
        for shadow in self.shadows.values():
            shadow._arrive(rid, request, at_s)
        return mode


class ReportedDecode(DecodeView):
    """A live decode instance, known by its last report plus what was sent since.

    A report carries no per-sequence ages, so the forecast for any time ahead
    is what is there now plus what is on its way. How far to trust it is
    learned as in the replay (`fit_odds`): every forecast the predictive check
    makes is scored by the first report after its due time, so the chance of
    fitting is how often requests given that much room, that far ahead, found
    it in the load the instance later reported. A report after the due time
    counts an admitted request that has joined, so the score errs on the safe
    side by one request.

    The requests on their way are the conductor's own record: each admission
    here is bound with the time its KV is due (`bind`), and a report at or
    after that time has it in its load (or it was turned away), so the record
    drops it then. That is what the claim's price needs (`claim`): the
    requests due behind a new one and the margins by which they fit.
    """

    def __init__(self, cost: CostModel):
        super().__init__(cost)
        self.reported = DecodeLoad(0, 0.0)
        self.pending_tokens = 0
        self.pending = 0
        self.odds = FitOdds()
        self.inflight: list[tuple[float, int]] = []     # (due, input tokens), due order
        self.recent = RecentAdmissions()

    def bind(self, now_s: float, input_length: int, due_s: float) -> None:
        """A request admitted here at ``now_s`` whose KV is due at ``due_s``."""
        bisect.insort(self.inflight, (due_s, input_length))
        self.recent.record(now_s, due_s - now_s, input_length)

    def observe(self, now_s: float, reported: DecodeLoad) -> int:
        """A load report at ``now_s``: it replaces what was sent since the last one, and
        scores the forecasts due by now; returns how many requests on their way it shows
        past their due time."""
        self.reported = reported
        self.pending = self.pending_tokens = 0
        arrived = bisect.bisect_right(self.inflight, (now_s, float("inf")))
        del self.inflight[:arrived]
        self.odds.score_due(now_s, self._judge)
        return arrived

    def claim(self, now_s: float, at_s: float, input_length: int,
              output_estimate: float) -> float:
        """How many requests due after ``at_s`` a request joining then is expected to
        displace, as `DecodeInstance.claim` prices it, from what a report shows: the room
        is the capacity less the forecast at ``at_s`` (the load reported plus what was
        sent since) and less the output to come; each request on its way and due later
        fits by the room the report and the requests due before it leave (with no ages
        the residents are counted as staying, as the forecast counts them)."""
        x = self.capacity_tokens - self.predicted_load(at_s).kv_tokens - output_estimate
        used = self.reported.kv_tokens
        for due_s, tokens in self.inflight:
            used += tokens
            if due_s > at_s:
                x = min(x, self.capacity_tokens - used - output_estimate)
        return self._displaced(x, input_length + output_estimate, at_s - now_s,
                               self.recent.mean_tokens() + output_estimate)

    def _judge(self, due_s: float, request: tuple[int, float, float]) -> tuple[bool, float]:
        return self.fits(self.reported, *request), self.reported.kv_tokens

    def load(self) -> DecodeLoad:
        return self.reported

    def committed_load(self) -> DecodeLoad:
        return DecodeLoad(self.reported.batch + self.pending,
                          self.reported.kv_tokens + self.pending_tokens)

    def predicted_load(self, at_s: float, least_queue_s: float = 0.0) -> DecodeLoad:
        return self.committed_load()


@dataclass
class Decision:
    request_id: str
    prefill: str
    decode: str
    placement: Placement
    local_blocks: int
    store_blocks: int
    fetch_from: str
    fetch_bytes: int
    fetch_tiers: list[str]
    predicted_tbt_s: float


@dataclass
class Counters:
    scheduled: int = 0
    rejected_ttft: int = 0
    rejected_decode: int = 0
    reused_tokens: int = 0
    input_tokens: int = 0


@dataclass
class LiveConductor:
    policy: Policy
    admission: Admission
    cost: CostModel
    store: Store
    hasher: BlockHasher
    cache_tokens_per_node: int = 3_000_000
    report_timeout_s: float = DEFAULT_REPORT_TIMEOUT_S
    counters: Counters = field(default_factory=Counters)
    clock: Callable[[], float] = time.monotonic

    def __post_init__(self) -> None:
        self.prefill_ids: list[str] = []
        self.queued_s: list[float] = []
        self.decode_ids: list[str] = []
        self.decodes: list[ReportedDecode] = []
        self.directory = BlockDirectory()
        self.caches: list[NodeCache] = []
        self.addresses: dict[str, str] = {}
        self.last_report: dict[str, float] = {}     # instance -> clock() of its last report
        self.unreachable_at: dict[str, float] = {}  # instance -> clock() when a front end marked it
        self.dead: set[str] = set()                 # as last logged, so each change is logged once
        self.lock = threading.Lock()
        self.audit: LiveAudit | None = None
        if self.admission.mode == "audited":
            self.audit = LiveAudit(Audit(), self.cost, self.admission.slo, self.policy.name,
                                   self.cache_tokens_per_node, self.hasher.block_tokens)

    def register(self, instance_id: str, role: str, address: str) -> None:
        """Add an instance (or take back one that registers again, e.g. after a restart)."""
        with self.lock:
            if instance_id not in self.last_report:
                gone = self._longest_silent(role)
                if gone is None:
                    self._add(instance_id, role)
                else:
                    self._replace(gone, instance_id, role)
            self.addresses[instance_id] = address
            self.unreachable_at.pop(instance_id, None)
            self._heard_from(instance_id)

    def _longest_silent(self, role: str) -> str | None:
        """The instance of ``role`` silent longest, if for FORGET_AFTER_TIMEOUTS report timeouts or more."""
        ids = self.prefill_ids if role == PREFILL else self.decode_ids
        if not ids:
            return None
        quietest = min(ids, key=self.last_report.__getitem__)
        silent_s = self.clock() - self.last_report[quietest]
        return quietest if silent_s >= FORGET_AFTER_TIMEOUTS * self.report_timeout_s else None

    def _add(self, instance_id: str, role: str) -> None:
        if role == PREFILL:
            if len(self.prefill_ids) >= MAX_PREFILL_INSTANCES:
                raise ValueError(f"at most {MAX_PREFILL_INSTANCES} prefill instances can be registered")
            self.prefill_ids.append(instance_id)
            self.queued_s.append(0.0)
            self.caches.append(self._empty_cache(len(self.caches)))
        else:
            self.decode_ids.append(instance_id)
            self.decodes.append(ReportedDecode(self.cost))

    def _replace(self, gone: str, instance_id: str, role: str) -> None:
        """``instance_id`` takes the place of ``gone``, which is forgotten: nothing of its load or cache stays."""
        if role == PREFILL:
            i = self.prefill_ids.index(gone)
            for block in self.caches[i].slots:
                self.directory.discard(block, i)
            self.prefill_ids[i], self.queued_s[i], self.caches[i] = instance_id, 0.0, self._empty_cache(i)
        else:
            j = self.decode_ids.index(gone)
            self.decode_ids[j], self.decodes[j] = instance_id, ReportedDecode(self.cost)
        for record in (self.last_report, self.addresses, self.unreachable_at):
            record.pop(gone, None)
        self.dead.discard(gone)
        log.warning("instance %s was silent for %d report timeouts: %s takes its place", gone,
                    FORGET_AFTER_TIMEOUTS, instance_id)

    def _empty_cache(self, node: int) -> NodeCache:
        blocks = max(1, self.cache_tokens_per_node // self.hasher.block_tokens)
        return NodeCache(node, blocks, self.directory)

    def report(self, instance_id: str, queued_s: float, batch: int, kv_tokens: int, age_s: float = 0.0) -> None:
        """A load report sent ``age_s`` ago. One sent before a front end marked the instance
        unreachable is old news: it is dropped, and the instance stays out."""
        with self.lock:
            if instance_id not in self.last_report:
                raise KeyError(instance_id)
            marked_at = self.unreachable_at.get(instance_id)
            if marked_at is not None and self.clock() - age_s < marked_at:
                return
            self.unreachable_at.pop(instance_id, None)
            self._heard_from(instance_id)
            if instance_id in self.prefill_ids:
                self.queued_s[self.prefill_ids.index(instance_id)] = queued_s
            elif instance_id in self.decode_ids:
                d = self.decodes[self.decode_ids.index(instance_id)]
                self.admission.reached_decode(d.observe(self.clock(), DecodeLoad(batch, float(kv_tokens))))

    def mark_unreachable(self, instance_id: str) -> None:
        """A front end could not reach this instance: no more requests until a report sent after now."""
        with self.lock:
            if instance_id not in self.last_report:
                raise KeyError(instance_id)
            self.unreachable_at[instance_id] = self.clock()
            self._alive(instance_id)

    def status(self) -> dict[str, str]:
        """LIVE or DEAD for every registered instance."""
        with self.lock:
            return {i: LIVE if self._alive(i) else DEAD for i in self.last_report}

    def _heard_from(self, instance_id: str) -> None:
        self.last_report[instance_id] = self.clock()
        self._alive(instance_id)

    def _alive(self, instance_id: str) -> bool:
        """Whether the instance reported within report_timeout_s and was not marked unreachable since;
        logs when that changes."""
        silent_s = self.clock() - self.last_report[instance_id]
        alive = silent_s <= self.report_timeout_s and instance_id not in self.unreachable_at
        if alive and instance_id in self.dead:
            self.dead.discard(instance_id)
            log.warning("instance %s reports again: scheduling onto it", instance_id)
        elif not alive and instance_id not in self.dead:
            self.dead.add(instance_id)
            log.warning("instance %s is dead (unreachable, or no load report within %g s): no more requests "
                        "to it", instance_id, self.report_timeout_s)
        return alive

    def block_keys(self, token_ids: list[int]) -> list[str]:
        return self.hasher.keys(token_ids)

    def schedule(self, request_id: str, keys: list[str], input_length: int,
                 output_length: int) -> Decision:
        """Place one request, or raise Rejected; raises LookupError with no live instance of a role."""
        if not self.prefill_ids or not self.decode_ids:
            raise LookupError("no prefill or no decode instance is registered")
        store_blocks = self.store.match_prefix(keys) if keys else 0
        with self.lock:
            decision = self._place(request_id, keys, input_length, output_length, store_blocks)
        return self._located(decision, keys)        # the store's round trip holds up no report

    def _place(self, request_id: str, keys: list[str], input_length: int,
               output_length: int, store_blocks: int) -> Decision:
        live_p = [i for i, name in enumerate(self.prefill_ids) if self._alive(name)]
        live_d = [j for j, name in enumerate(self.decode_ids) if self._alive(name)]
        if not live_p or not live_d:
            role = PREFILL if not live_p else DECODE
            raise LookupError(f"no {role} instance has reported its load within {self.report_timeout_s:g} s")
        matches = self.directory.prefix_matches(keys, len(self.prefill_ids))
        cand = Candidates(input_length, [self.queued_s[i] for i in live_p], [matches[i] for i in live_p],
                          self.hasher.block_tokens, store_blocks)
        p = _renumbered(self.policy.choose_prefill(cand), live_p)
        j = live_d[self.policy.choose_decode([self.decodes[j].committed_load() for j in live_d], input_length)]
        estimate = output_length or OUTPUT_PRIOR_TOKENS
        if self.audit is not None:
            self.admission.follow = self.audit.arrive(self.clock(), (len(live_p), len(live_d)),
                                                      keys, input_length, output_length)
        reason = self.admission.at_arrival(self.clock(), p, self.decodes[j], input_length, estimate)
        if reason is not None:
            self._count_rejection(reason)
            raise Rejected(reason, self._rejection_text(reason, p))
        fetch_from = "" if p.source is None else "store" if p.source == FROM_POOL else self.prefill_ids[p.source]
        self.caches[p.prefill].insert_chain(keys)
        self.queued_s[p.prefill] += p.service_s
        d = self.decodes[j]
        d.pending += 1
        d.pending_tokens += input_length
        now = self.clock()
        d.bind(now, input_length, now + p.ttft_s + self.cost.transfer_s(input_length))
        c = self.counters
        c.scheduled += 1
        c.input_tokens += input_length
        c.reused_tokens += min(p.reused_blocks * self.hasher.block_tokens, input_length)
        tbt = self.cost.decode_step_s(d.committed_load().batch, d.committed_load().kv_tokens)
        return Decision(request_id, self.prefill_ids[p.prefill], self.decode_ids[j], p,
                        matches[p.prefill], store_blocks, fetch_from, 0, [], tbt)

    def _located(self, d: Decision, keys: list[str]) -> Decision:
        """``d`` with the size and tiers of the prefix it fetches, per KV.LOCATE (outside the lock).

        The request is placed by now (counted, its work added to its
        instances), so a store that fails here leaves these hints out rather
        than fail a request the conductor already counts as sent.
        """
        if not d.fetch_from:
            return d
        try:
            located = self.store.locate(keys[d.local_blocks:d.placement.reused_blocks])
        except (KVError, OSError) as exc:
            log.warning("KV.LOCATE for request %s failed: %s", d.request_id, exc)
            return d
        found = [loc for loc in located if loc is not None]
        return dataclasses.replace(d, fetch_bytes=sum(loc.size for loc in found),
                                   fetch_tiers=sorted({loc.tier for loc in found}))

    def _count_rejection(self, reason: str) -> None:
        if reason == REJECT_TTFT:
            self.counters.rejected_ttft += 1
        else:
            self.counters.rejected_decode += 1

    def _rejection_text(self, reason: str, p: Placement) -> str:
        if reason == REJECT_TTFT:
            return (f"predicted TTFT {p.ttft_s:.2f}s exceeds the SLO of "
                    f"{self.admission.slo.ttft_s:g}s")
        return f"no decode instance can meet the TBT SLO of {self.admission.slo.tbt_s:g}s"


def _renumbered(p: Placement, instances: list[int]) -> Placement:
    """A placement chosen among ``instances`` (the live ones), in the numbering of all instances."""
    source = p.source if p.source is None or p.source == FROM_POOL else instances[p.source]
    return dataclasses.replace(p, prefill=instances[p.prefill], source=source)
