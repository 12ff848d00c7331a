"""The four scheduling policies on hand-computed candidates.

Cost model: 1 s per new token, 0.1 s per fetched token, nothing else, and
1-token blocks, so every expected TTFT below is arithmetic on the inputs.
"""
from conductor.costmodel import CostModel
from conductor.policy import (FROM_POOL, Candidates, DecodeLoad, make_policy)

COST = CostModel(p_fixed=0, p_token=1.0, p_attention=0, p_load=0, t_fixed=0, t_token=0.1,
                 d_fixed=0.01, d_seq=0.001, d_kv=0.0001, decode_capacity_tokens=10_000)


def cands(queue, local, pool=0):
    return Candidates(input_length=10, queue_s=queue, local_blocks=local, block_tokens=1,
                      pool_blocks=pool)


def test_load_balance_picks_least_queue_and_reuses_local_cache():
    p = make_policy("load-balance", COST).choose_prefill(cands([3, 1, 2], [0, 4, 9]))
    assert (p.prefill, p.reused_blocks, p.source) == (1, 4, None)
    assert p.ttft_s == 1 + 6


def test_cache_aware_minimises_queue_plus_uncached_prefill():
    # instance 0: 0 + 10, instance 1: 5 + 2, instance 2: 1 + 8
    p = make_policy("cache-aware", COST).choose_prefill(cands([0, 5, 1], [0, 8, 2]))
    assert (p.prefill, p.reused_blocks, p.ttft_s) == (1, 8, 7)


def test_kvcache_centric_fetches_the_best_prefix_to_an_idle_instance():
    # instance 0 fetches 8 tokens from node 1: 0 + 0.8 + 2
    p = make_policy("kvcache-centric", COST).choose_prefill(cands([0, 5, 1], [0, 8, 2]))
    assert (p.prefill, p.source, p.reused_blocks, p.fetched_blocks) == (0, 1, 8, 8)
    assert abs(p.ttft_s - 2.8) < 1e-9


def test_balancing_threshold_decides_between_fetch_and_local_reuse():
    # threshold 3: 8 > 3 * 2, so instance 2 fetches 6 tokens: 1 + 0.6 + 2 = 3.6
    p = make_policy("kvcache-centric", COST, balancing_threshold=3).choose_prefill(
        cands([9, 5, 1], [0, 8, 2]))
    assert (p.prefill, p.source) == (2, 1) and abs(p.ttft_s - 3.6) < 1e-9
    # threshold 5: 8 <= 5 * 2, instance 2 recomputes (1 + 8); instance 1 wins with 5 + 2
    p = make_policy("kvcache-centric", COST, balancing_threshold=5).choose_prefill(
        cands([9, 5, 1], [0, 8, 2]))
    assert (p.prefill, p.source, p.ttft_s) == (1, None, 7)


def test_kvcache_centric_fetches_from_the_shared_store():
    p = make_policy("kvcache-centric", COST).choose_prefill(cands([0, 0], [1, 0], pool=9))
    assert (p.prefill, p.source, p.reused_blocks) == (0, FROM_POOL, 9)
    # 9 tokens reused at most (one must be computed); 8 fetched, 1 computed
    assert abs(p.ttft_s - (0.8 + 1)) < 1e-9


def test_whole_prompt_cached_still_computes_one_token():
    p = make_policy("cache-aware", COST).choose_prefill(cands([0], [10]))
    assert p.ttft_s == 1


def test_random_is_seeded_and_covers_instances():
    a = make_policy("random", COST, seed=7)
    b = make_policy("random", COST, seed=7)
    picks = [a.choose_prefill(cands([0] * 4, [0] * 4)).prefill for _ in range(64)]
    assert picks == [b.choose_prefill(cands([0] * 4, [0] * 4)).prefill for _ in range(64)]
    assert set(picks) == {0, 1, 2, 3}


def test_decode_choice_by_predicted_tbt():
    loads = [DecodeLoad(4, 1000), DecodeLoad(1, 9000), DecodeLoad(2, 100)]
    # steps with the request (10 tokens) added: 0.125+, 0.912+, 0.024+: instance 2
    assert make_policy("kvcache-centric", COST).choose_decode(loads, 10) == 2
