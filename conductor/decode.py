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

from conductor.costmodel import CostModel
from conductor.outputs import OutputLengths
from conductor.overtaking import RecentAdmissions
from conductor.policy import DecodeLoad

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

    @abstractmethod
    def load(self) -> DecodeLoad:
        """The batch and KV size now."""

    @abstractmethod
    def committed_load(self) -> DecodeLoad:
        """Now, plus requests already bound here and still in prefill."""

    @abstractmethod
    def predicted_load(self, at_s: float) -> DecodeLoad:
        """The load expected at ``at_s``."""

    def fits(self, load: DecodeLoad, input_length: int, output_estimate: float,
             tbt_slo_s: float) -> bool:
        """Whether a request still meets the TBT SLO, memory and batch limit with ``load`` present."""
        kv = load.kv_tokens + input_length
        return (kv + output_estimate <= self.capacity_tokens
                and load.batch + 1 <= self.cost.decode_max_batch
                and self.cost.decode_step_s(load.batch + 1, kv) <= tbt_slo_s)


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
        self._leaves: list[tuple[float, int]] = []
        self._sum_input = 0
        self._sum_start = 0.0
        self.version = 0

    @property
    def batch(self) -> int:
        return len(self.residents)

    def advance(self, now_s: float) -> None:
        if self.residents and now_s > self.clock_s:
            self.generated += (now_s - self.clock_s) / self.step_s
        self.clock_s = max(self.clock_s, now_s)

    def kv_tokens(self) -> float:
        return self._sum_input + self.batch * self.generated - self._sum_start

    def load(self) -> DecodeLoad:
        return DecodeLoad(self.batch, self.kv_tokens())

    def committed_load(self) -> DecodeLoad:
        """Residents plus requests already bound here and still in prefill.

        The decode choice balances on this, so the requests admitted during
        one prefill's worth of time do not all pick the same idle instance.
        """
        pending = sum(length for length, _ in self.inflight.values())
        return DecodeLoad(self.batch + len(self.inflight), self.kv_tokens() + pending)

    def bind(self, request: int, input_length: int, now_s: float, due_s: float) -> None:
        """A request admitted now whose KV is due here at ``due_s``."""
        self.inflight[request] = (input_length, due_s)
        self.recent.record(now_s, due_s - now_s, input_length)

    def predicted_load(self, at_s: float) -> DecodeLoad:
        """Load expected at ``at_s``, when a request admitted now would reach decode.

        A scheduler does not know output lengths, only those of the requests
        that finished (`OutputLengths`). Each resident, having made m tokens,
        is still there after the k more it has time for (at the current step
        time) with probability P(out > m + k | out > m), and counts that much
        of its batch slot and KV. A request already bound here whose KV is
        due by then counts by its chance of still decoding at ``at_s``.
        Requests not yet admitted that will get here first are estimated
        from recent admissions (`overtaking`).
        """
        ahead = max(0.0, at_s - self.clock_s) / self.step_s
        batch, kv = self.recent.overtaking(self.clock_s, at_s - self.clock_s)
        for r in self.residents.values():
            made = self.generated - r.start_count
            p = self.outputs.still_running(made, made + ahead)
            batch += p
            kv += p * (r.input_length + made + ahead)
        for input_length, due_s in self.inflight.values():
            if due_s <= at_s:
                made = (at_s - due_s) / self.step_s
                p = self.outputs.still_running(0.0, made)
                batch += p
                kv += p * (input_length + made)
        return DecodeLoad(batch, kv)

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
