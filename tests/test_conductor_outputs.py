"""Output-length knowledge and the decode-load prediction built on it, computed by hand.

Cost model: a decode step of 10 ms whatever the batch, 10,000 tokens of
decode memory and at most 2 sequences per batch.
"""
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
