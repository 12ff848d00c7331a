"""Admission control: when to reject a request, and at which stage.

A request is checked twice: at arrival (before any prefill work is spent)
and when its KV reaches the decode instance. The modes differ in what the
arrival check knows:

- `none`: never reject; decode batches grow past their SLO instead.
- `baseline`: each stage looks only at its own current load. Arrival rejects
  when the predicted TTFT exceeds its SLO; decode rejects when the request
  would break the TBT SLO or memory, and the prefill already spent on it is
  wasted.
- `early`: the decode check moves to arrival, against the decode instance's
  load as it is now. No prefill is spent on a request that decode would
  refuse at this moment, but the decode load at arrival is not the load the
  request will meet a prefill later: while decode is full everything is
  refused and prefill idles, then decode drains, a burst is admitted and
  overloads it again (the oscillation of the paper's section 7).
- `predictive`: the arrival check asks how likely the request is to fit
  when its KV reaches decode (now + its predicted TTFT + the transfer), and
  admits it when that chance pays for the prefill it risks.
  - The forecast (`DecodeInstance.predicted_load`) counts residents by their
    chance of still decoding then, from the output lengths seen so far with
    the ones still running as censored lengths (`outputs`), never the
    request's own; the requests in flight due before it, in the order the
    decode check will meet them, each counting those taken before it by their
    chance of still decoding; and the requests admitted later that will get
    there first (`overtaking`), no more than the prefill fleet can finish.
  - The chance (`fit_odds`) is how often requests given as much room by such
    a forecast, as far ahead, really fitted lately, scored online for every
    request checked, admitted or not. A hard threshold on the forecast
    rejected requests that would have fitted: the forecast is too pessimistic
    by up to a fifth of a node when a burst is in flight.
  - The price: admitting costs the prefill (`service_s`) if the request is
    turned away at decode, and gains one served request if it fits. A prefill
    second is worth what prefill has cost per request that reached decode so
    far (learned during the run), so with w = service_s / that cost the
    request is admitted when chance >= w / (1 + w): a request of average
    prefill needs even odds, a long prefill better ones, a short one less.
  - The claim (`DecodeView.claim`): from its due time on the request holds
    decode memory that the requests due behind it compete for. When that
    memory is likely to bind (the forecast's room, or the margin by which
    the backlog behind it fits, is under the claim within the forecast's
    spread at that horizon), admitting displaces about its own size in
    other requests, each worth what an admission has been worth so far, and
    the chance needed rises by that (`claim_price`). With an honest forecast
    and no such price, the check admitted every request likely to fit on its
    own, whatever its claim took from the requests behind it: on short-answer
    traces those claims, made far ahead where the forecast is least sure,
    turned more requests away at decode, and goodput fell below the
    baseline's (0.925-0.994 on a 10 s-tick trace).
  - The hold: a request that would not fit when its KV arrives may fit a
    little later, once the residents expected to leave have left. Under
    bursts the baseline gets that for free: it admits the whole burst into a
    deep prefill queue, which feeds decode through the lull after it (and
    wastes the prefill of the burst's head). Predictive instead tries the
    due times a few seconds later (`HOLD_STEPS_S`, doubling, as far as the
    TTFT SLO allows) and admits the request for the first one whose chance
    pays for its prefill; its prefill then starts that much later (its node
    waits for it, so the queue behind it sees the delay). Only a replay
    holds, and there a held request's TTFT is known exactly (its node's
    queue is first come, first served, and its prefill time is the cost
    model's), so a hold may use all of the SLO's room. The request is
    forecast and scored at the due time it was admitted for (or turned away
    at), once.
  This damps the oscillation and wastes the least prefill.

The decode-stage check stays in every mode but `none`: memory is physical.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from conductor.decode import DecodeView
from conductor.policy import Placement

MODES = ("none", "baseline", "early", "predictive", "audited")

REJECT_TTFT = "ttft"
REJECT_DECODE = "decode"

# Later due times a predictive check may try, seconds after the first: doubling, so a
# few forecasts cover the TTFT SLO's room. A step of 1 s landed held requests in the
# same crowded batch the forecast had just refused and wasted more prefill.
HOLD_STEPS_S = (2.0, 4.0, 8.0, 16.0)


@dataclass(frozen=True)
class Slo:
    ttft_s: float = 30.0
    tbt_s: float = 0.1


@dataclass
class Admission:
    mode: str
    slo: Slo
    holds: bool = False     # whether a prefill's start may be held back (the replay's can)
    prefill_spent_s: float = field(default=0.0, init=False)   # on requests admitted
    joined: int = field(default=0, init=False)                # requests the decode check took
    hold_s: float = field(default=0.0, init=False)  # the wait before the admitted one's prefill
    held: int = field(default=0, init=False)        # requests admitted with a hold
    refused: int = field(default=0, init=False)     # requests the decode check turned away
    # `audited`: the fixed mode whose arrival check is in force (set by the caller's `Audit`)
    follow: str = field(default="predictive", init=False)
    # `audited`: while another mode is in force the predictive check still runs, on one
    # arrival in this many (the live conductor: every one; a replay: `Simulator._fork`)
    forecast_every: int = field(default=1, init=False)
    _following: int = field(default=0, init=False)  # arrivals decided while another mode was

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown admission mode '{self.mode}' "
                             f"(choose from {', '.join(MODES)})")

    def at_arrival(self, now_s: float, placement: Placement, decode: DecodeView,
                   input_length: int, output_estimate: float,
                   queues: Sequence[float] | None = None) -> str | None:
        """The reason to reject at arrival, or None to admit, its prefill to start
        `hold_s` later than the queue allows (``queues``: the prefill queues now, where
        known)."""
        self.hold_s = 0.0
        if self.mode == "none":
            return None
        if placement.ttft_s > self.slo.ttft_s:
            return REJECT_TTFT
        mode = self.follow if self.mode == "audited" else self.mode
        reason = None
        if mode == "early":
            if not decode.fits(decode.load(), input_length, output_estimate, self.slo.tbt_s):
                reason = REJECT_DECODE
        if mode == "predictive" or (self.mode == "audited" and self._forecasts_while_following()):
            verdict, hold = self._predictive(now_s, placement, decode, input_length,
                                             output_estimate, queues)
            if mode == "predictive":
                reason, self.hold_s = verdict, hold
                self.held += hold > 0
        if reason is None:
            self.prefill_spent_s += placement.service_s
        return reason

    def _forecasts_while_following(self) -> bool:
        """audited, another mode in force: whether the predictive check runs on this arrival
        anyway, so the odds it learns from its own forecasts in this run's state are current
        when the audit hands it the decisions again."""
        self._following += 1
        return self._following % self.forecast_every == 0

    def _predictive(self, now_s: float, placement: Placement, decode: DecodeView,
                    input_length: int, output_estimate: float,
                    queues: Sequence[float] | None) -> tuple[str | None, float]:
        """Admit for the first due time (now, or held `HOLD_STEPS_S` later) whose chance of
        fitting pays for the prefill at risk and for the requests its claim displaces: the
        reason to reject (or None) and the hold."""
        due_s = now_s + placement.ttft_s + decode.cost.transfer_s(input_length)
        need = self.chance_needed(placement.service_s)

        def chance(hold_s: float, record: bool = False) -> float:
            return decode.fit_chance(now_s, due_s + hold_s, input_length, output_estimate,
                                     self.slo.tbt_s, queues, record)

        def pays(hold_s: float) -> bool:
            p = chance(hold_s)
            return p >= need and p >= need + self.claim_price(
                placement.service_s, decode.claim(now_s, due_s + hold_s, input_length,
                                                  output_estimate))

        hold = next((h for h in self.hold_choices(placement.ttft_s) if pays(h)), None)
        chance(hold or 0.0, record=True)
        if hold is None:
            return REJECT_DECODE, 0.0
        return None, hold

    def hold_choices(self, ttft_s: float) -> tuple[float, ...]:
        """No hold, then the holds that keep the TTFT (known exactly where a start can be
        held) within its SLO."""
        if not self.holds:
            return (0.0,)
        return (0.0, *(h for h in HOLD_STEPS_S if ttft_s + h <= self.slo.ttft_s))

    def chance_needed(self, service_s: float) -> float:
        """The least chance of fitting that pays for risking ``service_s`` of prefill."""
        if not self.joined or not self.prefill_spent_s:
            return 0.5
        w = service_s * self.joined / self.prefill_spent_s
        return w / (1 + w)

    def claim_price(self, service_s: float, displaced: float) -> float:
        """The chance a request needs on top of `chance_needed` to pay for the ``displaced``
        requests due after it (`DecodeView.claim`).

        Each is worth what an admission has been worth so far: the share of the requests
        reaching decode that the decode check took. Gaining one served request with
        chance p, losing the prefill (w in served requests) otherwise and the displaced
        for sure, admitting pays when p >= (w + displaced * worth) / (1 + w).
        """
        if not self.joined or not self.prefill_spent_s or not displaced:
            return 0.0
        w = service_s * self.joined / self.prefill_spent_s
        return displaced * self.joined / (self.joined + self.refused) / (1 + w)

    def at_decode(self, decode: DecodeView, input_length: int, output_estimate: float) -> bool:
        """Whether the decode instance takes the request now that its KV has arrived (a
        request taken is counted here; one refused, by the caller once its fate is known:
        it may still wait for a slot)."""
        if self.mode == "none":
            return True
        taken = decode.fits(decode.load(), input_length, output_estimate, self.slo.tbt_s)
        self.reached_decode(int(taken))
        return taken

    def reached_decode(self, taken: int, refused: int = 0) -> None:
        """Count requests whose KV reached decode: what the prices learn from. A live
        conductor does not hear the decode check's verdicts and counts every request a
        report shows past its due time as taken."""
        self.joined += taken
        self.refused += refused
