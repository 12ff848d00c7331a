"""The estimate of KV that later admissions bring to decode first, computed by hand."""
import pytest

from conductor.decode import DecodeInstance
from conductor.outputs import OutputLengths
from conductor.overtaking import MIN_HISTORY, RecentAdmissions
from tests.test_conductor_outputs import COST


def steady(services: list[float], tokens: int = 1000, every_s: float = 1.0) -> RecentAdmissions:
    """One admission per ``every_s`` seconds from t=0, cycling through ``services`` (seconds
    from the start of its prefill to its KV at decode)."""
    r = RecentAdmissions()
    for i in range(16):
        r.record(i * every_s, services[i % len(services)], tokens)
    return r


def test_nothing_is_estimated_before_enough_history():
    r = RecentAdmissions()
    for i in range(MIN_HISTORY - 1):
        r.record(float(i), 0.0, 1000)
    assert r.overtaking(100.0, 50.0) == (0.0, 0.0)


def test_rate_times_expected_lead():
    # 16 admissions of 1000 tokens over 16 s (t=0..15, asked at t=16): rate
    # 1 request/s, 1000 tokens/s. Services alternate 2 s and 6 s; asked for a
    # horizon of 5 s with a prefill node idle, leads are (5-2)+ = 3 and (5-6)+ = 0:
    # mean 1.5 s.
    batch, kv = steady([2.0, 6.0]).overtaking(16.0, 5.0)
    assert batch == pytest.approx(1.5)
    assert kv == pytest.approx(1500.0)


def test_the_shortest_horizon_is_not_overtaken():
    assert steady([2.0, 6.0]).overtaking(16.0, 2.0) == (0.0, 0.0)


def test_the_ring_forgets_old_admissions():
    r = RecentAdmissions(window=MIN_HISTORY)
    for i in range(MIN_HISTORY):
        r.record(float(i), 0.0, 10_000)          # an old burst of big requests
    for i in range(MIN_HISTORY):
        r.record(100.0 + i, 0.0, 100)            # then one small request per second
    _, kv = r.overtaking(108.0, 1.0)
    assert kv == pytest.approx(100.0)            # 100 tokens/s x 1 s lead


def test_no_overtaking_from_behind_queues_deeper_than_the_wait():
    # Services alternate 1 s and 6 s; every prefill queue is 3 s deep and there are
    # enough nodes for the fleet to keep up. For a request due in 5 s, a later one
    # overtakes when it starts before t = 5 - s' (4 s for the 1 s ones, never for the
    # 6 s ones): lead E[t] = 2 s at one request of 1,000 tokens per second.
    batch, kv = steady([1.0, 6.0]).overtaking(16.0, 5.0, queues=[3.0] * 100)
    assert batch == pytest.approx(2.0)
    assert kv == pytest.approx(2000.0)
    assert steady([2.0, 6.0]).overtaking(16.0, 5.0, queues=[3.0] * 100) == (0.0, 0.0)


def test_overtakers_cannot_outrun_the_prefill_fleet():
    # As above, but with two prefill nodes: the admissions bring 3.5 s of prefill per
    # second (services 1 and 6 s, one a second), and the fleet has 2 x (4 - 3) = 2 s
    # free before t = 4 s, so later ones start before t only while u < 2 / 3.5.
    batch, kv = steady([1.0, 6.0]).overtaking(16.0, 5.0, queues=[3.0, 3.0])
    assert batch == pytest.approx(0.5 * 2 / 3.5)
    assert kv == pytest.approx(1000 * 0.5 * 2 / 3.5)
    # ten such nodes free 10 s: u < 10 / 3.5, still short of t
    batch, _ = steady([1.0, 6.0]).overtaking(16.0, 5.0, queues=[3.0] * 10)
    assert batch == pytest.approx(0.5 * 10 / 3.5)


def test_the_fleet_shares_its_free_time_with_every_decode_instance():
    # A second decode instance admits as much as this one: the two prefill nodes take
    # 7 s of work a second, so this instance's later requests start before t = 4 s only
    # while u < 2 / 7.
    fleet = RecentAdmissions()
    for i in range(16):
        for _ in range(2):
            fleet.record(float(i), (1.0, 6.0)[i % 2], 1000)
    batch, _ = steady([1.0, 6.0]).overtaking(16.0, 5.0, queues=[3.0, 3.0], fleet=fleet)
    assert batch == pytest.approx(0.5 * 2 / 7)


def test_prediction_adds_overtakers_to_residents():
    d = DecodeInstance(0, COST, OutputLengths(prior_tokens=10_000))
    for i in range(16):                          # admitted at 0..15 s, due 1 s later
        d.bind(100 + i, 500, float(i), float(i), float(i) + 1.0)
        d.inflight.pop(100 + i)                  # ... and since joined and left
    d.advance(16.0)
    # nothing resident or in flight; 500 tokens/s with horizon 1 s, so a
    # request due 3 s ahead expects (3 - 1) x 500 tokens to get there first
    load = d.predicted_load(19.0)
    assert load.kv_tokens == pytest.approx(1000.0)
    assert load.batch == pytest.approx(2.0)
