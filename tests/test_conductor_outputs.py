"""Output-length knowledge and the decode-load prediction built on it, computed by hand.

Cost model: a decode step of 10 ms whatever the batch, 10,000 tokens of
decode memory and at most 2 sequences per batch.
"""
import dataclasses

import numpy as np
import pytest

from conductor.costmodel import CostModel
from conductor.decode import DecodeInstance
from conductor.outputs import OutputLengths
from conductor.policy import DecodeLoad

COST = CostModel(p_fixed=0, p_token=0.001, p_attention=0, p_load=0, t_fixed=0, t_token=0,
                 d_fixed=0.01, d_seq=0, d_kv=0, decode_capacity_tokens=10_000,
                 decode_max_batch=2)


def test_prior_alone_is_a_uniform_decode_length():
    o = OutputLengths(prior_tokens=100)
    assert o.mean == 100
    assert o.survival().still_running(0, 99) == 1.0
    assert o.survival().still_running(0, 100) == 0.0


def test_survival_comes_from_finished_lengths():
    o = OutputLengths(prior_tokens=512)
    for length in (10, 100, 1000):
        o.observe(length)
    assert o.mean == pytest.approx((512 + 10 + 100 + 1000) / 4)
    s = o.survival()
    assert s.still_running(0, 50) == pytest.approx(3 / 4)      # 100, 512, 1000 of 4
    assert s.still_running(200, 600) == pytest.approx(1 / 2)   # 1000 of {512, 1000}
    assert s.still_running(2000, 3000) == 0.0                  # past anything seen


def test_sequences_still_running_count_as_lengths_at_least_what_they_made():
    # Finished: 10 and the prior 100. One sequence has made 50 and runs on.
    # From finished lengths alone P(out > 60) = 1/2; Kaplan-Meier keeps the
    # runner at risk until 50: S(10) = 1 - 1/3, and nothing ends in 11..99.
    o = OutputLengths(prior_tokens=100)
    o.observe(10)
    assert o.survival().still_running(0, 60) == pytest.approx(1 / 2)
    assert o.survival(np.array([50.0])).still_running(0, 60) == pytest.approx(2 / 3)


def test_prediction_weights_residents_and_inflight_by_survival():
    outputs = OutputLengths(prior_tokens=512)
    outputs.observe(10)
    outputs.observe(100)
    d = DecodeInstance(0, COST, outputs)
    d.join(1, 1000, 400, now_s=0.0)
    d.inflight[2] = (2000, 0.3)      # KV due at 0.3 s
    d.inflight[3] = (4000, 9.0)      # due after the horizon: not there yet
    load = d.predicted_load(0.5)
    # resident: 50 tokens ahead, P(out > 50) = 2/3; in-flight: 20 tokens made
    # by 0.5 s, P(out > 20) = 2/3.
    assert load.batch == pytest.approx(4 / 3)
    assert load.kv_tokens == pytest.approx(2 / 3 * 1050 + 2 / 3 * 2020)


def test_a_backlog_in_flight_counts_only_what_the_decode_check_would_take():
    # Five requests of 3,000 tokens due at 0.1-0.5 s, answers of ~100 tokens:
    # the decode check takes three (9,000 + 3,000 + 100 > 10,000), not 15,000.
    cost = CostModel(p_fixed=0, p_token=0.001, p_attention=0, p_load=0, t_fixed=0,
                     t_token=0, d_fixed=0.01, d_seq=0, d_kv=0,
                     decode_capacity_tokens=10_000, decode_max_batch=256)
    d = DecodeInstance(0, cost, OutputLengths(prior_tokens=100))
    for i in range(5):
        d.inflight[i] = (3000, 0.1 * (i + 1))
    load = d.predicted_load(0.5)
    assert load.batch == pytest.approx(3)
    assert load.kv_tokens == pytest.approx(9000 + 40 + 30 + 20)    # tokens made by 0.5 s


def test_batch_limit_refuses_a_third_sequence():
    d = DecodeInstance(0, COST, OutputLengths())
    assert d.fits(DecodeLoad(1, 0), 100, 10, tbt_slo_s=0.1)
    assert not d.fits(DecodeLoad(2, 0), 100, 10, tbt_slo_s=0.1)


def test_testbed_decode_limits_follow_vllm_defaults():
    cost = CostModel.from_testbed()
    # (0.9 x 8 x 80 GB - 140 GB of fp16 weights) / 320 KiB per token
    assert cost.decode_capacity_tokens == int((0.9 * 640e9 - 140e9) / 327_680)
    assert cost.decode_max_batch == 256
    # a full node still steps within the 0.1 s TBT SLO: memory binds first
    assert cost.decode_step_s(256, cost.decode_capacity_tokens) < 0.1


def test_requests_taken_earlier_that_will_have_finished_leave_room_for_a_later_one():
    # Three requests of 4,000 tokens in flight, due at 0.1, 0.2 and 2.0 s; every answer
    # is 100 tokens (10 ms a step, so 1 s). Counted in full, the first two leave no room
    # for the third (12,000 + 100 > 10,000); by 2.0 s both have finished, so the decode
    # check takes it, and 0.05 s later it is the only one there.
    cost = CostModel(p_fixed=0, p_token=0.001, p_attention=0, p_load=0, t_fixed=0,
                     t_token=0, d_fixed=0.01, d_seq=0, d_kv=0,
                     decode_capacity_tokens=10_000, decode_max_batch=256)
    d = DecodeInstance(0, cost, OutputLengths(prior_tokens=100))
    for i, due_s in enumerate((0.1, 0.2, 2.0)):
        d.bind(i, 4000, 0.0, 0.0, due_s)
    load = d.predicted_load(2.05)
    assert load.batch == pytest.approx(1)
    assert load.kv_tokens == pytest.approx(4005)


def test_a_claim_displaces_the_backlog_behind_it_only_when_it_binds():
    # One request of 4,000 tokens in flight due at 1.0 s, answers of 100: it fits with
    # 10,000 - 4,100 = 5,900 tokens to spare. A claim due before it at 0.5 s of m tokens
    # (input + answer) takes its place when m > 5,900 (no spread learned yet: a sure
    # verdict), and displaces m / (4,000 + 100) requests of the recent mean size. Due
    # at 1.5 s, after it, the claim meets the room left then: 10,000 - 4,050 - 100.
    cost = CostModel(p_fixed=0, p_token=0.001, p_attention=0, p_load=0, t_fixed=0,
                     t_token=0, d_fixed=0.01, d_seq=0, d_kv=0,
                     decode_capacity_tokens=10_000, decode_max_batch=256)
    d = DecodeInstance(0, cost, OutputLengths(prior_tokens=100))
    d.bind(1, 4000, 0.0, 0.0, 1.0)
    assert d.claim(0.0, 0.5, 5000, 100.0) == 0.0
    assert d.claim(0.0, 0.5, 6000, 100.0) == pytest.approx(6100 / 4100)
    assert d.claim(0.0, 1.5, 5700, 100.0) == 0.0
    assert d.claim(0.0, 1.5, 5800, 100.0) == pytest.approx(5900 / 4100)


def _check_order_by_matrix(d, made, inputs, survival):
    """The decode check's order as first written: every pair of requests in flight at once."""
    due = sorted((t, n) for n, t in d.inflight.values())
    due_s = np.array([t for t, _ in due], dtype=float)
    tokens = np.array([n for _, n in due], dtype=float)
    later = made[None, :] + (np.maximum(due_s - d.clock_s, 0.0) / d.step_s)[:, None]
    alive = survival.still_running(made[None, :], later)
    resident_batch = alive.sum(axis=1)
    resident_kv = (alive * (inputs[None, :] + later)).sum(axis=1)
    gap = np.maximum(due_s[None, :] - due_s[:, None], 0.0) / d.step_s
    still = survival.still_running(0, gap)
    grown = still * (tokens[:, None] + gap)
    batch, kv = np.zeros(due_s.size), np.zeros(due_s.size)
    margin, taken = np.zeros(due_s.size), np.zeros(due_s.size, dtype=bool)
    for k in range(due_s.size):
        margin[k] = d.capacity_tokens - (resident_kv[k] + kv[k] + tokens[k] + d.outputs.mean)
        if margin[k] >= 0 and resident_batch[k] + batch[k] + 1 <= d.cost.decode_max_batch:
            taken[k] = True
            batch += still[k]
            kv += grown[k]
    return due_s[taken], tokens[taken], margin[taken]


@pytest.mark.parametrize("seed", range(4))
def test_decode_check_order_is_the_pairwise_one_bit_for_bit(seed):
    # Rows only for the requests taken, over the ones due after each: the same sums in the
    # same order as the whole matrix, so replays make the same decisions.
    rng = np.random.default_rng(seed)
    cost = dataclasses.replace(CostModel.from_testbed(), decode_capacity_tokens=400_000)
    outputs = OutputLengths()
    for x in np.minimum(rng.lognormal(np.log(40), 0.7, 2000).astype(int) + 1, 2000):
        outputs.observe(int(x))
    d = DecodeInstance(0, cost, outputs)
    for i in range(int(rng.integers(0, 256))):
        d.join(10**6 + i, int(rng.integers(2000, 9000)), int(rng.integers(20, 400)), i * 0.01)
    d.advance(3.0)
    due = 3.0 + rng.uniform(0, 30, int(rng.integers(300, 900)))
    due[::7] = due[0]                   # ties in due time
    for i, t in enumerate(due):
        d.bind(i, int(rng.integers(1000, 9000)), 3.0, 3.0, float(t))
    made = np.array([d.generated - r.start_count for r in d.residents.values()])
    inputs = np.array([r.input_length for r in d.residents.values()], dtype=float)
    survival = outputs.survival(made)
    got = d._decode_check_order(made, inputs, survival)
    want = _check_order_by_matrix(d, made, inputs, survival)
    assert 0 < got[0].size < due.size       # the backlog does not all fit
    for a, b in zip(got, want):
        assert np.array_equal(a, b)


def test_committed_load_follows_bind_and_unbind():
    d = DecodeInstance(0, COST, OutputLengths())
    d.bind(1, 300, 0.0, 0.0, 1.0)
    d.bind(2, 500, 0.0, 0.0, 2.0)
    assert d.committed_load() == DecodeLoad(2, 800)
    d.unbind(1)
    assert d.committed_load() == DecodeLoad(1, 500)
    assert d.inflight == {2: (500, 2.0)}
