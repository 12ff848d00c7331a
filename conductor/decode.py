"""A decode instance under continuous batching, simulated without a per-token loop.

Every sequence in the batch gains one token per step, so instead of counting
tokens per sequence we keep one counter `generated` (tokens produced by any
sequence that was there all along) that grows by elapsed / step_s. A sequence
that joins when the counter reads g0 leaves when it reads g0 + output_length,
so a heap keyed by that target gives the next departure; the batch's KV size
is sum(input) + batch * generated - sum(g0). The step time is recomputed from
the cost model at every join and leave (and held between them), so the
simulation costs O(log batch) per event rather than O(tokens).
"""
from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np

from conductor.costmodel import CostModel
from conductor.fit_odds import FitOdds
from conductor.outputs import OutputLengths
from conductor.overtaking import RecentAdmissions
from conductor.policy import DecodeLoad, DecodeLoads

_EPS = 1e-9


@dataclass
class Resident:
    request: int
    join_s: float
    input_length: int
    output_length: int
    start_count: float


class DecodeView(ABC):
    """What admission needs from a decode instance, simulated or live."""

    def __init__(self, cost: CostModel):
        self.cost = cost
        self.capacity_tokens = cost.decode_capacity_tokens
        self.odds: FitOdds | None = None     # set where forecasts can be scored

    @abstractmethod
    def load(self) -> DecodeLoad:
        """The batch and KV size now."""

    @abstractmethod
    def committed_load(self) -> DecodeLoad:
        """Now, plus requests already bound here and still in prefill."""

    @abstractmethod
    def predicted_load(self, at_s: float, least_queue_s: float = 0.0) -> DecodeLoad:
        """The load expected at ``at_s``; ``least_queue_s`` is the shortest prefill queue now."""

    def slack(self, load: DecodeLoad, input_length: int, output_estimate: float,
              tbt_slo_s: float) -> float:
        """Room left under the tightest of memory, batch and TBT limits once a request joins
        ``load``, as a share of that limit; negative when it does not fit."""
        kv = load.kv_tokens + input_length
        return min(1 - (kv + output_estimate) / self.capacity_tokens,
                   1 - (load.batch + 1) / self.cost.decode_max_batch,
                   1 - self.cost.decode_step_s(load.batch + 1, kv) / tbt_slo_s)

    def fits(self, load: DecodeLoad, input_length: int, output_estimate: float,
             tbt_slo_s: float) -> bool:
        """Whether a request still meets the TBT SLO, memory and batch limit with ``load`` present."""
        return self.slack(load, input_length, output_estimate, tbt_slo_s) >= 0

    def fit_chance(self, now_s: float, at_s: float, input_length: int, output_estimate: float,
                   tbt_slo_s: float, least_queue_s: float = 0.0, record: bool = True) -> float:
        """The chance that a request whose KV arrives at ``at_s`` fits then: the forecast's
        verdict, weighed by how such verdicts turned out lately (`fit_odds`). With
        ``record`` the forecast is filed to be scored at ``at_s`` (once per request: for
        the due time it is admitted or turned away for)."""
        forecast = self.predicted_load(at_s, least_queue_s)
        slack = self.slack(forecast, input_length, output_estimate, tbt_slo_s)
        if self.odds is None:
            return 1.0 if slack >= 0 else 0.0
        if record:
            self.odds.file(now_s, at_s, slack, forecast.kv_tokens,
                           (input_length, output_estimate, tbt_slo_s))
        return self.odds.chance(at_s - now_s, slack)


class DecodeInstance(DecodeView):
    def __init__(self, index: int, cost: CostModel, outputs: OutputLengths):
        super().__init__(cost)
        self.index = index
        self.outputs = outputs
        self.generated = 0.0
        self.clock_s = 0.0
        self.step_s = cost.decode_step_s(1, 0)
        self.residents: dict[int, Resident] = {}
        # request -> (input length, when its KV is due): bound here, still in prefill
        self.inflight: dict[int, tuple[int, float]] = {}
        self.recent = RecentAdmissions()
        self.odds = FitOdds()
        self._leaves: list[tuple[float, int]] = []
        self._sum_input = 0
        self._sum_start = 0.0
        self.version = 0

    @property
    def batch(self) -> int:
        return len(self.residents)

    def advance(self, now_s: float) -> None:
        self.odds.score_due(now_s, self._judge)
        if self.residents and now_s > self.clock_s:
            self.generated += (now_s - self.clock_s) / self.step_s
        self.clock_s = max(self.clock_s, now_s)

    def kv_tokens(self) -> float:
        return self._sum_input + self.batch * self.generated - self._sum_start

    def load(self) -> DecodeLoad:
        return DecodeLoad(self.batch, self.kv_tokens())

    def _judge(self, at_s: float, request: tuple[int, float, float]) -> tuple[bool, float]:
        """Whether ``request`` would fit at ``at_s``, no later than the next join or leave
        (the batch is fixed in between, so the KV grows linearly), and the KV then."""
        ahead = max(0.0, at_s - self.clock_s) / self.step_s if self.residents else 0.0
        load = DecodeLoad(self.batch, self.kv_tokens() + self.batch * ahead)
        return self.fits(load, *request), load.kv_tokens

    def committed_load(self) -> DecodeLoad:
        """Residents plus requests already bound here and still in prefill.

        The decode choice balances on this, so the requests admitted during
        one prefill's worth of time do not all pick the same idle instance.
        """
        pending = sum(length for length, _ in self.inflight.values())
        return DecodeLoad(self.batch + len(self.inflight), self.kv_tokens() + pending)

    def bind(self, request: int, input_length: int, now_s: float, start_s: float,
             due_s: float) -> None:
        """A request admitted now whose prefill starts at ``start_s`` and whose KV is due
        here at ``due_s``."""
        self.inflight[request] = (input_length, due_s)
        self.recent.record(now_s, due_s - start_s, input_length)

    def predicted_load(self, at_s: float, least_queue_s: float = 0.0) -> DecodeLoad:
        """Load expected at ``at_s``, when a request admitted now would reach decode.

        A scheduler does not know output lengths, only their distribution
        (`OutputLengths`, with the residents as censored lengths). Each
        resident, having made m tokens, is still there after the k more it has
        time for (at the current step time) with probability
        P(out > m + k | out > m), and counts that much of its batch slot and
        KV. Requests already bound here and due by then pass the decode check
        in the order they arrive, as the real check would take them: one that
        would not fit beside the residents expected then and those taken before
        it is left out, so a backlog in prefill cannot count for more memory
        than there is. Those taken count by their chance of still decoding at
        ``at_s``. Requests admitted after now that will get here first
        (`overtaking`) fill at most the memory left: they too pass the check.
        """
        residents = list(self.residents.values())
        made = np.array([self.generated - r.start_count for r in residents])
        inputs = np.array([r.input_length for r in residents], dtype=float)
        survival = self.outputs.survival(made)
        due = sorted((d, n) for n, d in self.inflight.values() if d <= at_s)
        times = np.array([d for d, _ in due] + [at_s])
        later = made[None, :] + (np.maximum(times - self.clock_s, 0.0) / self.step_s)[:, None]
        alive = survival.still_running(made[None, :], later)
        batch = alive.sum(axis=1)
        kv = (alive * (inputs[None, :] + later)).sum(axis=1)
        taken = self._decode_check_order(due, batch[:-1], kv[:-1])
        made_then = (at_s - taken[:, 0]) / self.step_s
        alive = survival.still_running(0, made_then)
        batch_then = batch[-1] + alive.sum()
        kv_then = kv[-1] + (alive * (taken[:, 1] + made_then)).sum()
        over_batch, over_kv = self.recent.overtaking(self.clock_s, at_s - self.clock_s,
                                                     least_queue_s)
        room = max(0.0, self.capacity_tokens - kv_then)
        if over_kv > room:
            over_batch, over_kv = over_batch * room / over_kv, room
        return DecodeLoad(batch_then + over_batch, kv_then + over_kv)

    def _decode_check_order(self, due: list[tuple[float, int]], resident_batch: np.ndarray,
                            resident_kv: np.ndarray) -> np.ndarray:
        """(due time, input length) of the requests in flight that the decode check would
        take, given the residents' expected load at each one's arrival (memory and batch
        limit; those taken count in full, having just joined)."""
        out = self.outputs.mean
        taken = []
        batch = kv = 0.0
        for (due_s, tokens), r_batch, r_kv in zip(due, resident_batch, resident_kv):
            if (r_kv + kv + tokens + out <= self.capacity_tokens
                    and r_batch + batch + 1 <= self.cost.decode_max_batch):
                taken.append((due_s, tokens))
                batch += 1
                kv += tokens
        return np.array(taken, dtype=float).reshape(-1, 2)

    def join(self, request: int, input_length: int, output_length: int, now_s: float) -> None:
        self.advance(now_s)
        r = Resident(request, now_s, input_length, output_length, self.generated)
        self.residents[request] = r
        heapq.heappush(self._leaves, (self.generated + output_length, request))
        self._sum_input += input_length
        self._sum_start += self.generated
        self._restep()

    def pop_finished(self, now_s: float) -> list[Resident]:
        self.advance(now_s)
        done = []
        while self._leaves and self._leaves[0][0] <= self.generated + _EPS:
            _, request = heapq.heappop(self._leaves)
            r = self.residents.pop(request)
            self._sum_input -= r.input_length
            self._sum_start -= r.start_count
            done.append(r)
        if not self.residents:
            self.generated = self._sum_start = 0.0
            self._leaves.clear()
        self._restep()
        return done

    def next_departure_s(self) -> float | None:
        if not self._leaves:
            return None
        return self.clock_s + max(0.0, self._leaves[0][0] - self.generated) * self.step_s

    def _restep(self) -> None:
        self.step_s = self.cost.decode_step_s(max(1, self.batch), self.kv_tokens())
        self.version += 1


class DecodeBoard:
    """Every simulated decode instance's load in arrays, for the choice that compares them all.

    The decode choice looks at every instance's committed load at every arrival; asking each
    `DecodeInstance` in turn costs microseconds an instance, too much for a million requests on
    hundreds of instances. The simulator publishes an instance here after each change it makes
    (a binding, a join, a departure, an advance), and `committed` brings every row to ``now`` in a
    few numpy operations: between two changes a batch is fixed, so its KV grows by the batch
    size every step, as `DecodeInstance.advance` counts it.
    """

    def __init__(self, instances: int):
        self.batch = np.zeros(instances)            # residents
        self.bound = np.zeros(instances)            # requests bound here, still in prefill
        self.bound_kv = np.zeros(instances)
        self.sum_input = np.zeros(instances)
        self.sum_start = np.zeros(instances)
        self.generated = np.zeros(instances)
        self.clock_s = np.zeros(instances)
        self.step_s = np.ones(instances)

    def publish(self, d: DecodeInstance) -> None:
        i = d.index
        self.batch[i] = d.batch
        self.bound[i] = len(d.inflight)
        self.bound_kv[i] = sum(length for length, _ in d.inflight.values())
        self.sum_input[i] = d._sum_input
        self.sum_start[i] = d._sum_start
        self.generated[i] = d.generated
        self.clock_s[i] = d.clock_s
        self.step_s[i] = d.step_s

    def resident_kv(self, now_s: float) -> np.ndarray:
        """Each instance's KV at ``now_s`` (as `kv_tokens` after `advance`)."""
        running = (self.batch > 0) & (now_s > self.clock_s)
        generated = np.where(running, self.generated + (now_s - self.clock_s) / self.step_s,
                             self.generated)
        return self.sum_input + self.batch * generated - self.sum_start

    def committed(self, now_s: float) -> DecodeLoads:
        """Each instance's `committed_load` at ``now_s``."""
        return DecodeLoads(self.batch + self.bound, self.resident_kv(now_s) + self.bound_kv)
