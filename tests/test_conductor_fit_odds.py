"""Learning how often the decode forecast's verdicts hold, and the admission price built on it."""
import pytest

from conductor.admission import Admission, Slo
from conductor.fit_odds import MIN_SAMPLES, FitOdds, band_label, band_of


def scored(outcomes: list[bool], slack: float = -0.03, horizon_s: float = 1.5) -> FitOdds:
    """Odds that have scored one forecast per outcome, all alike."""
    odds = FitOdds()
    for i, fitted in enumerate(outcomes):
        odds.file(float(i), float(i) + horizon_s, slack, 1000.0, (fitted,))
    odds.score_due(1e9, lambda due_s, request: (request[0], 1200.0))
    return odds


def test_before_enough_outcomes_the_forecast_is_trusted():
    odds = scored([True] * (MIN_SAMPLES - 1))
    assert odds.chance(1.5, -0.03) == 0.0
    assert odds.chance(1.5, 0.03) == 1.0


def test_a_pessimistic_forecast_learns_that_such_requests_fit():
    # Requests told "3 % over" fitted three times in four: the chance is 3/4.
    odds = scored([True, True, True, False] * 8)
    assert odds.chance(1.5, -0.03) == pytest.approx(0.75)
    # other horizons and other slack keep their own record
    assert odds.chance(0.2, -0.03) == 0.0
    assert odds.chance(1.5, -0.3) == 0.0


def test_forecasts_are_scored_only_when_due():
    odds = FitOdds()
    odds.file(0.0, 2.0, -0.03, 1000.0, ())
    odds.score_due(1.9, lambda due_s, request: pytest.fail("scored early"))
    seen = []
    odds.score_due(2.0, lambda due_s, request: seen.append(due_s) or (True, 0.0))
    assert seen == [2.0]


def test_misses_are_summed_per_horizon_band():
    odds = scored([True] * 4)
    n, total, squares = odds.misses()[band_of(1.5)]
    assert (n, total, squares) == (4, 800.0, 4 * 200.0 ** 2)
    assert band_label(band_of(1.5)) == "1-2 s" and band_label(band_of(60)) == ">= 10 s"


def test_the_chance_needed_pays_for_the_prefill_at_risk():
    a = Admission("predictive", Slo())
    assert a.chance_needed(6.0) == 0.5            # nothing learned yet: even odds
    a.prefill_spent_s, a.joined = 10.0, 5         # 2 s of prefill per request that joined
    assert a.chance_needed(2.0) == pytest.approx(0.5)
    assert a.chance_needed(6.0) == pytest.approx(0.75)
    assert a.chance_needed(0.5) == pytest.approx(0.2)
