"""Trace replay: a discrete-event simulation of a prefill/decode cluster.

Each prefill instance runs one request at a time in arrival order, so its
queue is fully described by the time it becomes free (`busy_until`): the
queue time a policy sees is `busy_until - now`, and a placement's finish
time is known the moment it is made (a request that predictive admission
holds back, `Admission.hold_s`, starts that much later and its node waits
for it). Only three things happen later and go through the event heap: a
prefill finishing (its blocks enter the node's cache, its KV starts moving
to decode), the KV reaching the decode instance (the decode-stage admission
check, then joining the batch), and a decode instance's next departure.
The decode check refuses a KV that finds no room at once (the paper's decode
stage), or, with `SimConfig.decode_wait_s`, lets it wait in the store for a
slot that long (within the TTFT SLO, its first token counted from the join),
as `workers/decode.py` queues requests that have not joined its batch yet.
Decode batches are simulated per event, never per token (see `decode`).
Caches hold 512-token blocks under the store's eviction policy (see
`cache`). Arrivals are processed in timestamp order; all events due by an
arrival's time are applied first.

Per arrival the work grows with the number of instances only through numpy
operations over them (the prefill queues, `BlockDirectory`'s bitmasks, the
decode loads on a `DecodeBoard`), so hundreds of instances replay a million
requests in minutes (docs/scale.md).
"""
from __future__ import annotations

import copy
import heapq
import sys
import time
from dataclasses import dataclass, field, replace
from typing import Callable

import numpy as np

from conductor.admission import Admission, Slo
from conductor.audit import Audit
from conductor.cache import BlockDirectory, NodeCache
from conductor.costmodel import CostModel
from conductor.decode import DecodeBoard, DecodeInstance
from conductor.metrics import (REJECTED_AT_ARRIVAL, REJECTED_AT_DECODE, Outcomes,
                               RunSummary, summarize)
from conductor.outputs import OutputLengths
from conductor.overtaking import RecentAdmissions
from conductor.policy import Candidates, DecodeLoad, Placement, make_policy
from conductor.trace import BLOCK_TOKENS, TraceRequest

_PREFILL_DONE, _DECODE_JOIN, _DECODE_STEP = 0, 1, 2

# An audited replay's live run, while another mode is in force, still forecasts one arrival
# in this many (`Admission.forecast_every`). A forecast counts every request in flight against
# the ones due before it, and behind the deep prefill queue the baseline builds that is
# thousands at each arrival: forecasting every arrival made a replay of the 4 k / 85 % /
# 40-token grid cells cost the square of that queue (18-20 min of CPU and unfinished). The
# odds need outcomes of forecasts made in this run's state, not many: each cell keeps its
# last 64 (docs/conductor.md compares this with taking the predictive shadow's odds).
FORECAST_EVERY = 8


@dataclass(frozen=True)
class SimConfig:
    prefill: int = 8
    decode: int = 8
    policy: str = "kvcache-centric"
    admission: str = "none"
    speed: float = 1.0
    slo: Slo = field(default_factory=Slo)
    cache_tokens_per_node: int = 3_000_000
    balancing_threshold: float = 1.0
    block_tokens: int = BLOCK_TOKENS
    seed: int = 0
    # How long a KV that finds its decode instance full may wait for a slot (0: refused at once)
    decode_wait_s: float = 0.0


@dataclass
class _Inflight:
    placement: Placement
    decode: int
    pinned: tuple[int, ...]


@dataclass
class _Waiting:
    service_s: float        # its prefill, wasted if no slot frees in time
    since_s: float          # when its KV reached the decode instance
    until_s: float          # the last moment it may join


class Simulator:
    """``on_outcome(rid, served)``: told when a request is turned away (False) or joins a
    decode batch (True when within the TTFT SLO). With admission `audited` the simulator
    also replays every fixed mode of the `Audit` as a shadow fed the same arrivals
    (`shadows`, their summaries in `shadow_summaries` after `run`), and the arrival check
    follows the mode the audit picks: the live run is the starting mode's shadow until
    the audit first leaves it, then a copy of it that follows the audit."""

    def __init__(self, trace: list[TraceRequest], config: SimConfig, cost: CostModel,
                 on_outcome: Callable[[int, bool], None] | None = None,
                 audit: Audit | None = None):
        if config.prefill < 1 or config.decode < 1:
            raise ValueError("a cluster needs at least one prefill and one decode instance")
        self.trace = trace
        self.cfg = config
        self.cost = cost
        self.policy = make_policy(config.policy, cost, config.seed, config.balancing_threshold)
        self.admission = Admission(config.admission, config.slo, holds=True)
        self.directory = BlockDirectory()
        capacity = max(1, config.cache_tokens_per_node // config.block_tokens)
        self.caches = [NodeCache(i, capacity, self.directory, config.seed)
                       for i in range(config.prefill)]
        self.busy_until = np.zeros(config.prefill)
        self.outputs = OutputLengths()
        fleet = RecentAdmissions()      # every decode instance's admissions share the prefill fleet
        self.decodes = [DecodeInstance(j, cost, self.outputs, fleet)
                        for j in range(config.decode)]
        self.board = DecodeBoard(config.decode)
        self.out = Outcomes(len(trace))
        self._events: list[tuple] = []
        self._seq = 0
        self._inflight: dict[int, _Inflight] = {}
        # per decode instance: requests whose KV waits for a slot (`decode_wait_s`), in arrival order
        self._waiting: list[dict[int, _Waiting]] = [{} for _ in self.decodes]
        self._wait_ends: list[list[tuple[float, int]]] = [[] for _ in self.decodes]  # (until, rid)
        self.on_outcome = on_outcome
        self.audit: Audit | None = None
        self.shadows: dict[str, Simulator] = {}
        self.shadow_summaries: dict[str, RunSummary] = {}
        if config.admission == "audited":
            self.audit = audit or Audit()
            self.shadows = {m: Simulator(trace, replace(config, admission=m), cost,
                                         on_outcome=self._resolver(m))
                            for m in self.audit.modes}

    def _resolver(self, mode: str) -> Callable[[int, bool], None]:
        audit = self.audit
        return lambda rid, served: audit.resolve(mode, rid, served)

    def run(self, progress: Callable[[int, int], None] | None = None) -> RunSummary:
        started = time.perf_counter()
        n = len(self.trace)
        audit = self.audit
        shadows = list(self.shadows.values())
        live = self if audit is None else self.shadows[audit.start]
        for rid, req in enumerate(self.trace):
            now = req.arrival_s / self.cfg.speed
            if audit is not None:
                for shadow in shadows:
                    shadow._drain(now)
                mode = audit.decided(now)
                if live is self.shadows[audit.start] and mode != audit.start:
                    live = self._fork(live)
                audit.arrived(rid)
                for shadow in shadows:
                    shadow._arrive(rid, req, now)
                if live is self.shadows[audit.start]:
                    continue        # the live run is that shadow until the audit first leaves it
                live.admission.follow = mode
            live._drain(now)
            live._arrive(rid, req, now)
            if progress and rid % 256 == 0:
                progress(rid, n)
        for shadow in shadows:
            shadow._drain(float("inf"))
            self.shadow_summaries[shadow.cfg.admission] = shadow._summary()
        live._drain(float("inf"))
        if live is not self:    # the live run's record is this simulator's
            self.out, self.admission, self.decodes = live.out, live.admission, live.decodes
        if progress:
            progress(n, n)
        summary = self._summary()
        summary.wall_s = time.perf_counter() - started
        return summary

    def _fork(self, shadow: Simulator) -> Simulator:
        """The live run from here on: a copy of ``shadow`` (whose decisions the live ones
        were until now), its arrival check audited."""
        keep = shadow.on_outcome
        shadow.on_outcome = None
        try:
            live = copy.deepcopy(shadow, {id(self.trace): self.trace, id(self.cost): self.cost})
        finally:
            shadow.on_outcome = keep
        live.cfg = self.cfg
        live.admission.mode = "audited"
        live.admission.follow = shadow.cfg.admission        # what its decisions were until now
        live.admission.forecast_every = FORECAST_EVERY
        return live

    def _summary(self) -> RunSummary:
        return summarize(self.out, policy=self.cfg.policy, admission=self.cfg.admission,
                         prefill=self.cfg.prefill, decode=self.cfg.decode,
                         speed=self.cfg.speed, ttft_slo_s=self.cfg.slo.ttft_s,
                         tbt_slo_s=self.cfg.slo.tbt_s)

    def _push(self, at_s: float, kind: int, a: int, b: int = 0) -> None:
        self._seq += 1
        heapq.heappush(self._events, (at_s, self._seq, kind, a, b))

    def _drain(self, until_s: float) -> None:
        events = self._events
        while events and events[0][0] <= until_s:
            at_s, _, kind, a, b = heapq.heappop(events)
            if kind == _PREFILL_DONE:
                self._prefill_done(a, at_s)
            elif kind == _DECODE_JOIN:
                self._decode_join(a, at_s)
            elif b == self.decodes[a].version:
                self._decode_step(a, at_s)

    def _arrive(self, rid: int, req: TraceRequest, now: float) -> None:
        matches = self.directory.prefix_matches(req.hash_ids, self.cfg.prefill)
        queue = np.maximum(self.busy_until - now, 0.0)
        cand = Candidates(req.input_length, queue, matches, self.cfg.block_tokens)
        placement = self.policy.choose_prefill(cand)
        j = self.policy.choose_decode(self.board.committed(now), req.input_length)
        self._sample_load(now, queue)
        decode = self.decodes[j]
        decode.advance(now)             # the admission check reads its load as of now
        self.board.publish(decode)
        self.out.input_tokens[rid] = req.input_length
        reason = self.admission.at_arrival(now, placement, decode, req.input_length,
                                           self.outputs.mean, queue)
        if reason is not None:
            self.out.status[rid] = REJECTED_AT_ARRIVAL
            if self.on_outcome is not None:
                self.on_outcome(rid, False)
            return
        self._start_prefill(rid, req, now, placement, j)

    def _start_prefill(self, rid: int, req: TraceRequest, now: float, p: Placement,
                       j: int) -> None:
        cache = self.caches[p.prefill]
        reused = req.hash_ids[:p.reused_blocks]
        if p.source is not None:
            self.caches[p.source].touch(reused)
            cache.insert_chain(reused)   # the fetch replicates the prefix here
        held = tuple(b for b in reused if b in cache)
        cache.touch(held)
        cache.pin(held)
        start = max(now, float(self.busy_until[p.prefill])) + self.admission.hold_s
        finish = start + p.service_s
        self.busy_until[p.prefill] = finish
        self.out.prefill_busy_s += p.service_s
        self.out.reused_tokens[rid] = min(p.reused_blocks * self.cfg.block_tokens,
                                          req.input_length - 1)
        self._inflight[rid] = _Inflight(p, j, held)
        self.decodes[j].bind(rid, req.input_length, now, start,
                             finish + self.cost.transfer_s(req.input_length))
        self.board.publish(self.decodes[j])
        self._push(finish, _PREFILL_DONE, rid)

    def _prefill_done(self, rid: int, now: float) -> None:
        req, fl = self.trace[rid], self._inflight[rid]
        cache = self.caches[fl.placement.prefill]
        cache.unpin(fl.pinned)
        cache.insert_chain(req.hash_ids)
        self.out.ttft_s[rid] = now - req.arrival_s / self.cfg.speed
        self._push(now + self.cost.transfer_s(req.input_length), _DECODE_JOIN, rid)

    def _decode_join(self, rid: int, now: float) -> None:
        req, fl = self.trace[rid], self._inflight.pop(rid)
        decode = self.decodes[fl.decode]
        decode.unbind(rid)
        decode.advance(now)
        if self.admission.at_decode(decode, req.input_length, self.outputs.mean):
            self._join(decode, rid, now)
        elif self.cfg.decode_wait_s > 0 and self._may_wait(decode, rid):
            until_s = now + min(self.cfg.decode_wait_s, self.cfg.slo.ttft_s - self.out.ttft_s[rid])
            self._waiting[fl.decode][rid] = _Waiting(fl.placement.service_s, now, until_s)
            heapq.heappush(self._wait_ends[fl.decode], (until_s, rid))
        else:
            self._refuse(rid, fl.placement.service_s)
        self.board.publish(decode)

    def _may_wait(self, decode: DecodeInstance, rid: int) -> bool:
        """Whether a KV the decode check refused may wait for a slot: the TTFT SLO leaves
        it time, and it would fit the instance once the batch empties."""
        req = self.trace[rid]
        return (self.out.ttft_s[rid] < self.cfg.slo.ttft_s
                and decode.fits(DecodeLoad(0, 0.0), req.input_length, self.outputs.mean,
                                self.cfg.slo.tbt_s))

    def _join(self, decode: DecodeInstance, rid: int, now: float) -> None:
        req = self.trace[rid]
        decode.join(rid, req.input_length, req.output_length, now)
        self._schedule_departure(decode)
        if self.on_outcome is not None:
            self.on_outcome(rid, self.out.ttft_s[rid] <= self.cfg.slo.ttft_s)

    def _refuse(self, rid: int, service_s: float) -> None:
        self.admission.reached_decode(0, 1)
        self.out.status[rid] = REJECTED_AT_DECODE
        self.out.wasted_prefill_s += service_s
        if self.on_outcome is not None:
            self.on_outcome(rid, False)

    def _seat_waiting(self, j: int, now: float) -> None:
        """After departures: a waiting KV whose wait ran out is refused, then every other
        one that fits now joins, first come first (a large one that does not fit yet lets
        smaller ones behind it in), its first token that much later."""
        decode, waiting, ends = self.decodes[j], self._waiting[j], self._wait_ends[j]
        while ends and ends[0][0] < now:
            _, rid = heapq.heappop(ends)
            w = waiting.pop(rid, None)
            if w is not None:
                self._refuse(rid, w.service_s)
        for rid, w in list(waiting.items()):
            if decode.batch >= self.cost.decode_max_batch:
                break
            if decode.fits(decode.load(), self.trace[rid].input_length, self.outputs.mean,
                           self.cfg.slo.tbt_s):
                del waiting[rid]
                self.admission.reached_decode(1)
                self.out.ttft_s[rid] += now - w.since_s
                self._join(decode, rid, now)

    def _decode_step(self, j: int, now: float) -> None:
        decode = self.decodes[j]
        for r in decode.pop_finished(now):
            self.out.tbt_s[r.request] = (now - r.join_s) / r.output_length
            self.outputs.observe(r.output_length)
        if self._waiting[j]:
            self._seat_waiting(j, now)
        self._schedule_departure(decode)
        self.board.publish(decode)

    def _schedule_departure(self, decode: DecodeInstance) -> None:
        at_s = decode.next_departure_s()
        if at_s is not None:
            self._push(at_s, _DECODE_STEP, decode.index, decode.version)

    def _sample_load(self, now: float, queue: np.ndarray) -> None:
        out = self.out
        out.load_time_s.append(now)
        out.prefill_load.append(float(queue.mean()))
        out.decode_load.append(float(self.board.resident_kv(now).sum())
                               / (self.cost.decode_capacity_tokens * len(self.decodes)))


def stderr_progress(label: str) -> Callable[[int, int], None]:
    """A one-line progress bar on stderr (only when stderr is a terminal)."""
    if not sys.stderr.isatty():
        return lambda done, total: None

    def show(done: int, total: int) -> None:
        filled = 30 * done // max(total, 1)
        end = "\n" if done >= total else ""
        sys.stderr.write(f"\r{label:>16} [{'#' * filled}{'.' * (30 - filled)}] "
                         f"{done}/{total}{end}")
        sys.stderr.flush()
    return show


def replay(trace: list[TraceRequest], config: SimConfig, cost: CostModel,
           progress: Callable[[int, int], None] | None = None) -> tuple[RunSummary, Outcomes]:
    """Run one policy/admission pair over ``trace``; returns the summary and raw outcomes."""
    sim = Simulator(trace, config, cost)
    return sim.run(progress), sim.out
