"""Predictive admission's holds, and live mode's learned chance of fitting.

A fake decode instance answers the chance of fitting as a function of the due
time, so which hold the check picks is computed by hand; live mode is driven
with explicit clock times.
"""
import pytest

from conductor.admission import REJECT_DECODE, Admission, Slo
from conductor.costmodel import CostModel
from conductor.decode import DecodeView
from conductor.fit_odds import MIN_SAMPLES
from conductor.live import ReportedDecode
from conductor.policy import DecodeLoad, Placement

COST = CostModel(p_fixed=0, p_token=0.001, p_attention=0, p_load=0, t_fixed=0, t_token=0,
                 d_fixed=0.01, d_seq=0, d_kv=0, decode_capacity_tokens=2000)


def placement(ttft_s: float = 1.0, service_s: float = 1.0) -> Placement:
    return Placement(prefill=0, reused_blocks=0, fetched_blocks=0, source=None,
                     service_s=service_s, ttft_s=ttft_s)


class RoomFrom(DecodeView):
    """A decode instance with no room before ``free_s`` and all of it from then on."""

    def __init__(self, free_s: float):
        super().__init__(COST)
        self.free_s = free_s
        self.asked: list[float] = []
        self.recorded: list[float] = []

    def load(self) -> DecodeLoad:
        return DecodeLoad(0, 0.0)

    committed_load = load

    def predicted_load(self, at_s: float, queues=None) -> DecodeLoad:
        return DecodeLoad(0, 0.0)

    def fit_chance(self, now_s, at_s, input_length, output_estimate, tbt_slo_s,
                   queues=None, record=True) -> float:
        self.asked.append(at_s)
        if record:
            self.recorded.append(at_s)
        return 1.0 if at_s >= self.free_s else 0.0


def test_a_request_is_held_for_the_first_due_time_that_fits():
    a = Admission("predictive", Slo(30.0, 0.1), holds=True)
    decode = RoomFrom(free_s=5.0)          # due at 1.0 unheld; 3.0 and 5.0 held 2 and 4 s
    assert a.at_arrival(0.0, placement(), decode, 100, 10.0) is None
    assert a.hold_s == 4.0
    assert decode.asked == [1.0, 3.0, 5.0, 5.0]
    assert decode.recorded == [5.0]                     # scored once, for the time it was held to


def test_no_hold_past_the_ttft_slo():
    # TTFT 22 s of a 30 s SLO: the replay's TTFT is exact, so holds up to the 8 s left
    # are tried (2, 4 and 8 s; 16 s would break the SLO)
    a = Admission("predictive", Slo(30.0, 0.1), holds=True)
    decode = RoomFrom(free_s=100.0)
    assert a.at_arrival(0.0, placement(ttft_s=22.0), decode, 100, 10.0) == REJECT_DECODE
    assert decode.asked == [22.0, 24.0, 26.0, 30.0, 22.0]
    assert a.hold_s == 0.0 and decode.recorded == [22.0]


def test_without_holds_only_the_first_due_time_counts():
    a = Admission("predictive", Slo(30.0, 0.1))         # live mode: a start cannot be held
    decode = RoomFrom(free_s=5.0)
    assert a.at_arrival(0.0, placement(), decode, 100, 10.0) == REJECT_DECODE
    assert decode.asked == [1.0, 1.0]


def test_a_later_admission_is_not_held_for_an_earlier_one():
    a = Admission("predictive", Slo(30.0, 0.1), holds=True)
    assert a.at_arrival(0.0, placement(), RoomFrom(free_s=5.0), 100, 10.0) is None
    assert a.at_arrival(0.0, placement(), RoomFrom(free_s=0.0), 100, 10.0) is None
    assert a.hold_s == 0.0


class Claiming(RoomFrom):
    """Room from the start, with a chance of 0.8, and a claim displacing ``displaced``."""

    def __init__(self, displaced: float):
        super().__init__(free_s=0.0)
        self.displaced = displaced

    def fit_chance(self, *args, **kwargs) -> float:
        super().fit_chance(*args, **kwargs)
        return 0.8

    def claim(self, now_s, at_s, input_length, output_estimate) -> float:
        return self.displaced


def test_a_claim_that_displaces_others_needs_better_odds():
    # One second of prefill has cost one request taken so far (w = 1: even odds), and
    # one of the two requests that reached decode was taken: an admission is worth 1/2.
    # Displacing d requests costs d / 2, so the chance needed is (1 + d / 2) / 2, and
    # a chance of 0.8 pays for d < 1.2.
    def admission() -> Admission:
        a = Admission("predictive", Slo(30.0, 0.1))
        a.joined, a.refused, a.prefill_spent_s = 1, 1, 1.0
        return a
    assert admission().claim_price(1.0, 1.0) == pytest.approx(0.25)
    for displaced, verdict in ((0.0, None), (1.0, None), (1.5, REJECT_DECODE)):
        assert admission().at_arrival(0.0, placement(), Claiming(displaced), 100,
                                      10.0) == verdict


def live_decode(kv_tokens: float) -> ReportedDecode:
    d = ReportedDecode(COST)
    d.observe(0.0, DecodeLoad(1, kv_tokens))
    return d


def test_live_predictive_learns_that_reported_loads_fall():
    # 1,800 of 2,000 tokens reported: a 200-token request with a 10-token answer is
    # 0.5 % over. Each time, the next report shows the instance drained to 1,000.
    a, d = Admission("predictive", Slo(30.0, 0.1)), live_decode(1800.0)
    for i in range(MIN_SAMPLES):
        now = 10.0 * i
        assert a.at_arrival(now, placement(), d, 200, 10.0) == REJECT_DECODE
        d.observe(now + 5.0, DecodeLoad(1, 1000.0))         # scored: it would have fitted
        d.observe(now + 5.0, DecodeLoad(1, 1800.0))
    assert a.at_arrival(10.0 * MIN_SAMPLES, placement(), d, 200, 10.0) is None


def test_live_predictive_keeps_rejecting_when_reports_stay_full():
    a, d = Admission("predictive", Slo(30.0, 0.1)), live_decode(1800.0)
    for i in range(MIN_SAMPLES + 1):
        assert a.at_arrival(10.0 * i, placement(), d, 200, 10.0) == REJECT_DECODE
        d.observe(10.0 * i + 5.0, DecodeLoad(1, 1800.0))
    assert d.odds.chance(1.0, -0.005) == pytest.approx(0.0)


def test_live_predictive_prices_the_claim_on_what_is_on_its_way():
    # 1,500 of 2,000 tokens reported; two 100-token requests are due at 5 s. A 300-token
    # request (10-token answer) due at 1 s fits the forecast (490 tokens of room) but
    # leaves the two behind it 290, less than its 310: it displaces 310 / 110 of their
    # size. With w = 1 and every request so far taken, that costs 1.4 of a chance.
    def admission() -> Admission:
        a = Admission("predictive", Slo(30.0, 0.1))
        a.prefill_spent_s = 1.0
        a.reached_decode(1)
        return a
    d = live_decode(1500.0)
    assert admission().at_arrival(0.0, placement(), d, 300, 10.0) is None
    d.bind(0.0, 100, 5.0)
    d.bind(0.0, 100, 5.0)
    assert d.claim(0.0, 1.0, 300, 10.0) == pytest.approx(310 / 110)
    assert admission().at_arrival(0.0, placement(), d, 300, 10.0) == REJECT_DECODE
    # a report past their due time has them in its load: they are no longer on their way
    assert d.observe(6.0, DecodeLoad(3, 1200.0)) == 2
    assert d.inflight == [] and d.claim(6.0, 7.0, 300, 10.0) == 0.0
