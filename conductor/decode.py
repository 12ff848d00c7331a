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
from collections.abc import Sequence
from dataclasses import dataclass
from math import erf, sqrt

import numpy as np

from conductor.costmodel import CostModel
from conductor.fit_odds import MIN_SAMPLES, FitOdds, band_of
from conductor.outputs import OutputLengths, Survival
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
    def predicted_load(self, at_s: float, queues: Sequence[float] | None = None) -> DecodeLoad:
        """The load expected at ``at_s``; ``queues``: the prefill queues now, where known."""

    def claim(self, now_s: float, at_s: float, input_length: int,
              output_estimate: float) -> float:
        """How many requests due after ``at_s`` a request joining then is expected to
        displace (see `DecodeInstance.claim`); an instance that cannot see the requests on
        their way to it prices nothing."""
        return 0.0

    def _spread(self, horizon_s: float) -> float:
        """The std of the forecast's KV miss at this horizon (tokens), learned from the
        forecasts scored so far; 0 until its band has `MIN_SAMPLES`."""
        if self.odds is None:
            return 0.0
        n, total, squares = self.odds.misses()[band_of(horizon_s)]
        if n < MIN_SAMPLES:
            return 0.0
        mean = total / n
        return float(np.sqrt(max(squares / n - mean * mean, 0.0)))

    def _displaced(self, room: float, claim: float, horizon_s: float, mean_claim: float) -> float:
        """Requests of ``mean_claim`` tokens that a claim of ``claim`` tokens displaces when the
        room the requests behind it find is forecast at ``room``: it binds with chance
        P(room < claim) within the forecast's spread at that horizon."""
        sigma = self._spread(horizon_s)
        binds = (0.5 * (1 + erf((claim - room) / (sigma * sqrt(2)))) if sigma > 0
                 else float(room < claim))
        return binds * claim / mean_claim if mean_claim > 0 else 0.0

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
                   tbt_slo_s: float, queues: Sequence[float] | None = None,
                   record: bool = True) -> float:
        """The chance that a request whose KV arrives at ``at_s`` fits then: the forecast's
        verdict, weighed by how such verdicts turned out lately (`fit_odds`). With
        ``record`` the forecast is filed to be scored at ``at_s`` (once per request: for
        the due time it is admitted or turned away for)."""
        forecast = self.predicted_load(at_s, queues)
        slack = self.slack(forecast, input_length, output_estimate, tbt_slo_s)
        if self.odds is None:
            return 1.0 if slack >= 0 else 0.0
        if record:
            self.odds.file(now_s, at_s, slack, forecast.kv_tokens,
                           (input_length, output_estimate, tbt_slo_s))
        return self.odds.chance(at_s - now_s, slack)


@dataclass
class _State:
    """What a forecast needs of a decode instance, fixed between two of its changes."""
    made: np.ndarray            # tokens each resident has made
    inputs: np.ndarray          # each resident's input length
    survival: Survival
    due_s: np.ndarray           # the requests in flight the decode check would take, in due order
    tokens: np.ndarray          # ... their input lengths
    margin: np.ndarray          # ... and the tokens each fits by


class DecodeInstance(DecodeView):
    def __init__(self, index: int, cost: CostModel, outputs: OutputLengths,
                 fleet: RecentAdmissions | None = None):
        """``fleet``: the admissions to every decode instance sharing its prefill fleet."""
        super().__init__(cost)
        self.index = index
        self.outputs = outputs
        self.generated = 0.0
        self.clock_s = 0.0
        self.step_s = cost.decode_step_s(1, 0)
        self.residents: dict[int, Resident] = {}
        # request -> (input length, when its KV is due): bound here, still in prefill
        self.inflight: dict[int, tuple[int, float]] = {}
        self.inflight_tokens = 0        # their input lengths' sum (`bind`, `unbind`)
        self.recent = RecentAdmissions()
        self.fleet = fleet
        self.odds = FitOdds()
        self._leaves: list[tuple[float, int]] = []
        self._sum_input = 0
        self._sum_start = 0.0
        self.version = 0
        self._binds = 0
        self._state_key: tuple | None = None
        self._state: _State | None = None

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
        return DecodeLoad(self.batch + len(self.inflight), self.kv_tokens() + self.inflight_tokens)

    def bind(self, request: int, input_length: int, now_s: float, start_s: float,
             due_s: float) -> None:
        """A request admitted now whose prefill starts at ``start_s`` and whose KV is due
        here at ``due_s``."""
        self.inflight[request] = (input_length, due_s)
        self.inflight_tokens += input_length
        self._binds += 1
        self.recent.record(now_s, due_s - start_s, input_length)
        if self.fleet is not None:
            self.fleet.record(now_s, due_s - start_s, input_length)

    def unbind(self, request: int) -> None:
        """A request bound here whose KV has arrived (or that will not come)."""
        length, _ = self.inflight.pop(request)
        self.inflight_tokens -= length

    def predicted_load(self, at_s: float, queues: Sequence[float] | None = None) -> DecodeLoad:
        """Load expected at ``at_s``, when a request admitted now would reach decode: what
        is known to be coming (`known_load`) and the requests admitted after now that will
        get here first (`overtaking`, given the prefill ``queues``), at most the memory
        left: they too pass the decode check."""
        known = self.known_load(at_s)
        over_batch, over_kv = self.recent.overtaking(self.clock_s, at_s - self.clock_s, queues,
                                                     self.fleet)
        room = max(0.0, self.capacity_tokens - known.kv_tokens)
        if over_kv > room:
            over_batch, over_kv = over_batch * room / over_kv, room
        return DecodeLoad(known.batch + over_batch, known.kv_tokens + over_kv)

    def known_load(self, at_s: float) -> DecodeLoad:
        """Residents and requests in flight expected here at ``at_s``.

        A scheduler does not know output lengths, only their distribution
        (`OutputLengths`, with the residents as censored lengths). Each
        resident, having made m tokens, is still there after the k more it has
        time for (at the current step time) with probability
        P(out > m + k | out > m), and counts that much of its batch slot and
        KV. Requests in flight due by then count if the decode check would take
        them (`_decode_check_order`), by their chance of still decoding at
        ``at_s``.
        """
        state = self._current_state()
        later = state.made + max(at_s - self.clock_s, 0.0) / self.step_s
        alive = state.survival.still_running(state.made, later)
        k = int(np.searchsorted(state.due_s, at_s, side="right"))
        made_then = (at_s - state.due_s[:k]) / self.step_s
        taken_alive = state.survival.still_running(0, made_then)
        return DecodeLoad(alive.sum() + taken_alive.sum(),
                          (alive * (state.inputs + later)).sum()
                          + (taken_alive * (state.tokens[:k] + made_then)).sum())

    def claim(self, now_s: float, at_s: float, input_length: int,
              output_estimate: float) -> float:
        """How many requests due after ``at_s`` a request joining then is expected to displace.

        From ``at_s`` on the request holds m = input + mean output tokens. The
        requests that compete for them are the ones due behind it: those in
        flight, and those admitted before ``at_s`` that get here after it. The
        room they find is x, the least of the memory the residents and the
        requests in flight leave at ``at_s`` and the margin by which each
        request in flight due later fits. The forecast of x misses with the
        spread learned online for that horizon (`FitOdds.misses`: std 0.013 of a
        node up to 0.5 s ahead, about 0.1 from 10 s), so the claim binds with
        chance P(x < m) and then displaces m tokens' worth of requests of the
        recent mean size. Far ahead, a room that looks ample may bind; a deep
        backlog due behind the request leaves small margins.
        """
        state = self._current_state()
        x = self.capacity_tokens - self.known_load(at_s).kv_tokens - output_estimate
        behind = state.due_s > at_s
        if behind.any():
            x = min(x, float(state.margin[behind].min()))
        return self._displaced(x, input_length + output_estimate, at_s - now_s,
                               self.recent.mean_tokens() + output_estimate)

    def _current_state(self) -> _State:
        """The residents' ages and survival and the decode check's order over the requests
        in flight, computed once per state of this instance (its clock, a join or a
        departure, a binding): every due time a check asks in that state (the hold
        ladder's up to five) reads the same order."""
        key = (self.clock_s, self.version, self._binds, len(self.inflight))
        if key != self._state_key:
            residents = list(self.residents.values())
            made = np.array([self.generated - r.start_count for r in residents])
            inputs = np.array([r.input_length for r in residents], dtype=float)
            survival = self.outputs.survival(made)
            self._state = _State(made, inputs, survival,
                                 *self._decode_check_order(made, inputs, survival))
            self._state_key = key
        return self._state

    def _decode_check_order(self, made: np.ndarray, inputs: np.ndarray,
                            survival: Survival) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(due times, input lengths, margins in tokens) of the requests in flight that the
        decode check would take, in due order.

        Each passes the check (memory and batch limit) beside the residents
        expected at its due time and the ones taken before it, each of those by
        its chance of still decoding then, P(out > (due_k - due_j) / step), with
        its KV grown by the tokens made. Counting those taken in full, as if none
        had left, refused a place to late requests that really found one once a
        backlog of short answers built up. Whether the k-th is taken depends only
        on the residents and the ones due before it, so one pass in due order
        serves every due time.
        """
        due = sorted((d, n) for n, d in self.inflight.values())
        due_s = np.array([d for d, _ in due], dtype=float)
        tokens = np.array([n for _, n in due], dtype=float)
        later = made[None, :] + (np.maximum(due_s - self.clock_s, 0.0) / self.step_s)[:, None]
        alive = survival.still_running(made[None, :], later)
        resident_batch = alive.sum(axis=1)
        resident_kv = (alive * (inputs[None, :] + later)).sum(axis=1)
        # One row per request taken, over the requests due after it only: the k-th's
        # check reads what the ones taken before it add to its own column, and nothing
        # reads a column once its check is made, so the rows of requests turned away
        # and the columns before each row are never needed. (Building the whole
        # [in flight x in flight] matrix of survivals made every arrival cost the square
        # of the requests in flight: thousands behind a full prefill queue.) Each column
        # sums the same terms in the same order as the matrix did.
        batch = np.zeros(due_s.size)
        kv = np.zeros(due_s.size)
        margin = np.zeros(due_s.size)
        taken = np.zeros(due_s.size, dtype=bool)
        out = self.outputs.mean
        room = self.capacity_tokens
        most = self.cost.decode_max_batch
        step_s = self.step_s
        # still decoding after n tokens: survival.still_running(0, n), its steps unrolled
        # (due_s is sorted, so the gaps need no clamp at 0)
        curve, last = survival.curve, survival.curve.size - 1
        first = curve[0] if curve[0] > 0 else None
        for k in range(due_s.size):
            margin[k] = m = room - (resident_kv[k] + kv[k] + tokens[k] + out)
            if m >= 0 and resident_batch[k] + batch[k] + 1 <= most:
                taken[k] = True
                if k + 1 < due_s.size and first is not None:
                    gap = (due_s[k + 1:] - due_s[k]) / step_s
                    still = curve[np.minimum(gap.astype(np.int64), last)] / first
                    batch[k + 1:] += still
                    kv[k + 1:] += still * (tokens[k] + gap)
        return due_s[taken], tokens[taken], margin[taken]

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
        self.bound_kv[i] = d.inflight_tokens
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
