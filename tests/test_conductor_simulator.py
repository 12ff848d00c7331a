"""The replay simulator on tiny traces whose outcome is computed by hand.

Cost model: 1 ms per new prefill token, free transfers, a decode step of
10 ms whatever the batch, 2,000 tokens of decode memory; blocks of 512
tokens; the admission prior for output length is 512 tokens.
"""
from pathlib import Path

import pytest

from conductor.admission import Slo
from conductor.costmodel import CostModel
from conductor.simulator import SimConfig, replay
from conductor.trace import TraceRequest, load_trace

COST = CostModel(p_fixed=0, p_token=0.001, p_attention=0, p_load=0, t_fixed=0, t_token=0,
                 d_fixed=0.01, d_seq=0, d_kv=0, decode_capacity_tokens=2000)
FIXTURE = Path(__file__).parent / "fixtures" / "conversation_head200.jsonl"


def req(at_s, blocks, output=10):
    return TraceRequest(at_s, 512 * len(blocks), output, tuple(blocks))


def run(trace, **kw):
    kw.setdefault("prefill", 1)
    kw.setdefault("decode", 1)
    return replay(trace, SimConfig(**kw), COST)


def test_queue_then_prefix_reuse_after_the_first_prefill_finishes():
    # A: 1,024 new tokens, done at 1.024. B arrives at 0.5, queues 0.524, and
    # cannot reuse block 1 yet (A is still computing it); it ends at 2.048.
    # C arrives at 2.0, waits 0.048 and reuses A's block 1: 512 new tokens.
    trace = [req(0.0, [1, 2]), req(0.5, [1, 3]), req(2.0, [1, 4])]
    summary, out = run(trace, policy="cache-aware")
    assert out.ttft_s.tolist() == pytest.approx([1.024, 1.548, 0.56])
    assert summary.prefix_hit_rate == pytest.approx(512 / 3072)
    assert summary.prefill_busy_s == pytest.approx(1.024 * 2 + 0.512)


def test_decode_tbt_is_the_step_time_and_everything_meets_slo():
    summary, out = run([req(0.0, [1], output=50)])
    assert out.tbt_s[0] == pytest.approx(0.01)
    assert (summary.completed_in_slo, summary.slo_attainment) == (1, 1.0)


def test_global_policy_fetches_instead_of_waiting_for_the_cache_holder():
    # Two prefill instances. A fills instance 0 with blocks 1-2 (done 1.024).
    # At 2.0, C (blocks 5-8) arrives just before B (blocks 1-3).
    trace = [req(0.0, [1, 2]), req(2.0, [5, 6, 7, 8]), req(2.0, [1, 2, 3])]
    _, local = run(trace, policy="cache-aware", prefill=2)
    _, glob = run(trace, policy="kvcache-centric", prefill=2)
    # C goes to instance 0 (tie, lowest index) and runs 2.048 s. B, cache-aware:
    # instance 0 waits 2.048 + 0.512 = 2.56 vs instance 1 recomputing 1.536.
    assert local.ttft_s[2] == pytest.approx(1.536)
    # kvcache-centric: instance 1 fetches blocks 1-2 for free and computes 0.512.
    assert glob.ttft_s[2] == pytest.approx(0.512)


def _overlap_trace():
    # A then B, 1,024 tokens each; A decodes for 10 s, so B (joining decode at
    # 2.048) finds 1,024 + ~102 tokens resident: 2,150 + 512 > 2,000.
    return [req(0.0, [1, 2], output=1000), req(0.1, [3, 4], output=10)]


@pytest.mark.parametrize("mode", ["baseline", "early"])
def test_decode_overflow_is_rejected_after_prefill(mode):
    summary, _ = run(_overlap_trace(), admission=mode, slo=Slo(30, 0.1))
    assert (summary.rejected_at_arrival, summary.rejected_at_decode) == (0, 1)
    assert summary.wasted_prefill_s == pytest.approx(1.024)


def test_predictive_rejects_at_arrival_and_wastes_nothing():
    # At 0.1 B's predicted TTFT is 0.924 + 1.024, so it would reach decode at
    # 2.048, after A's KV (due 1.024): 1,024 + 1,024 + 512 > 2,000. A TTFT SLO
    # of 9 s leaves room to hold B 2 or 4 s, and A (expected to make the prior's
    # 512 tokens, 5.12 s) is still there then.
    summary, _ = run(_overlap_trace(), admission="predictive", slo=Slo(9, 0.1))
    assert (summary.rejected_at_arrival, summary.rejected_at_decode) == (1, 0)
    assert summary.wasted_prefill_s == 0


def test_predictive_holds_a_request_until_decode_has_room():
    # A decodes 400 tokens from 1.024 to 5.024. B would meet it at 2.048, or at
    # 4.048 and 6.048 held 2 or 4 s (A expected until 6.144); held 8 s its KV
    # arrives at 10.048, when A is expected gone, and it is.
    trace = [req(0.0, [1, 2], output=400), req(0.1, [3, 4], output=10)]
    summary, out = run(trace, admission="predictive", slo=Slo(30, 0.1))
    assert (summary.rejected, summary.completed_in_slo) == (0, 2)
    assert out.ttft_s[1] == pytest.approx(0.924 + 1.024 + 8.0)
    # the replay of the other modes holds nothing: B meets A and is turned away
    summary, _ = run(trace, admission="baseline", slo=Slo(30, 0.1))
    assert summary.rejected_at_decode == 1


def test_a_kv_that_finds_decode_full_waits_for_a_slot_when_waiting_is_on():
    # B's KV reaches decode at 2.048 (TTFT 1.948) and finds no room beside A, which
    # leaves at 1.024 + 1,000 steps = 11.024; waiting up to 30 s it joins then, its
    # first token counted from the join: TTFT 1.948 + 8.976.
    summary, out = run(_overlap_trace(), admission="baseline", slo=Slo(30, 0.1),
                       decode_wait_s=30.0)
    assert (summary.rejected, summary.completed_in_slo) == (0, 2)
    assert out.ttft_s[1] == pytest.approx(10.924)
    assert summary.wasted_prefill_s == 0


def test_a_waiting_kv_too_large_for_the_room_a_departure_leaves_lets_a_smaller_one_by():
    # A (512 tokens) decodes until 10.512, D (512) until 4.024. B's KV (1,024) arrives
    # at 2.048 and C's (512) at 2.56; neither fits beside A and D. When D leaves, A
    # holds 863 tokens: C fits (863 + 512 + the 512-token output prior), B does not,
    # so C joins at 4.024 and B once A has left.
    trace = [req(0.0, [1], output=1000), req(0.0, [2], output=300), req(0.1, [3, 4]),
             req(0.2, [5])]
    summary, out = run(trace, admission="baseline", decode_wait_s=30.0)
    assert summary.completed_in_slo == 4
    assert out.ttft_s[3] == pytest.approx(4.024 - 0.2)
    assert out.ttft_s[2] == pytest.approx(10.512 - 0.1)


@pytest.mark.parametrize("wait_s, ttft_slo_s", [(5.0, 30.0), (30.0, 8.0)])
def test_a_waiting_kv_is_refused_when_its_wait_or_the_ttft_slo_runs_out(wait_s, ttft_slo_s):
    # the slot frees at 11.024: after 5 s of waiting, and after the 8-s TTFT SLO
    summary, _ = run(_overlap_trace(), admission="baseline", slo=Slo(ttft_slo_s, 0.1),
                     decode_wait_s=wait_s)
    assert (summary.rejected_at_decode, summary.completed_in_slo) == (1, 1)
    assert summary.wasted_prefill_s == pytest.approx(1.024)


def test_no_admission_serves_everything():
    summary, _ = run(_overlap_trace(), admission="none")
    assert summary.rejected == 0 and summary.admitted == 2


def test_ttft_slo_rejects_at_arrival():
    summary, out = run([req(0.0, [1, 2]), req(0.0, [3, 4])], admission="baseline",
                       slo=Slo(1.5, 0.1))
    assert out.status.tolist() == [0, 1] and summary.rejected == 1


def test_small_cache_evicts_with_the_store_policy():
    # One-block cache: C cannot reuse block 1 because B's blocks evicted it.
    trace = [req(0.0, [1]), req(1.0, [2]), req(2.0, [1, 3])]
    _, out = run(trace, cache_tokens_per_node=512)
    assert out.reused_tokens.tolist() == [0, 0, 0]
    _, out = run(trace, cache_tokens_per_node=4096)
    assert out.reused_tokens.tolist() == [0, 0, 512]


def test_policies_keep_their_order_on_a_slice_of_the_real_trace():
    trace = load_trace(FIXTURE)
    cost = CostModel.from_testbed()
    means = {p: replay(trace, SimConfig(prefill=2, decode=2, policy=p, speed=4), cost)[0]
             .ttft_mean_s for p in ("random", "load-balance", "kvcache-centric")}
    assert means["random"] > means["load-balance"] > means["kvcache-centric"]
