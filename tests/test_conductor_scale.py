"""The conductor's simulator with hundreds of instances: no cap, and the per-instance work
done over arrays (prefix matches, policy choices, decode loads) gives what the per-instance
formulas give."""
import json
import random
from pathlib import Path

import numpy as np
import pytest

from conductor.cache import BlockDirectory
from conductor.cli import replay_main
from conductor.costmodel import CostModel
from conductor.policy import Candidates, local_placement, make_policy
from conductor.simulator import SimConfig, Simulator
from conductor.trace import load_trace

FIXTURE = str(Path(__file__).parent / "fixtures" / "conversation_head200.jsonl")
COST = CostModel.from_testbed()


def test_replay_takes_hundreds_of_prefill_instances(capsys):
    assert replay_main([FIXTURE, "--prefill", "300", "--decode", "300", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["prefill"], doc["decode"], doc["requests"]) == (300, 300, 200)


def brute_matches(holders: dict[int, set[int]], blocks: list[int], n_nodes: int) -> list[int]:
    matches = []
    for node in range(n_nodes):
        k = 0
        while k < len(blocks) and node in holders.get(blocks[k], ()):
            k += 1
        matches.append(k)
    return matches


def test_prefix_matches_count_each_nodes_leading_blocks_past_64_nodes():
    rng = random.Random(3)
    n_nodes = 200
    directory, holders = BlockDirectory(), {}
    for block in range(40):
        for node in rng.sample(range(n_nodes), rng.randrange(0, n_nodes)):
            directory.add(block, node)
            holders.setdefault(block, set()).add(node)
    for _ in range(50):
        blocks = rng.sample(range(45), rng.randrange(0, 12))
        got = directory.prefix_matches(blocks, n_nodes)
        assert got.tolist() == brute_matches(holders, blocks, n_nodes)


def scalar_choice(policy, c: Candidates) -> int:
    """The choice the policies made one instance at a time: least (TTFT, index)."""
    if policy.name == "kvcache-centric":
        local = c.local_blocks.tolist()
        best_node = max(range(len(local)), key=lambda k: (local[k], -k))
        options = [policy._placement(i, best_node, local[best_node], c) for i in range(len(local))]
    else:
        options = [local_placement(i, c, COST) for i in range(len(c.queue_s))]
    return min(options, key=lambda p: (p.ttft_s, p.prefill)).prefill


@pytest.mark.parametrize("name", ["cache-aware", "kvcache-centric"])
def test_array_choices_equal_the_per_instance_minimum(name):
    rng = random.Random(9)
    policy = make_policy(name, COST, balancing_threshold=1.5)
    for _ in range(200):
        n = rng.randrange(1, 300)
        queue = [rng.choice([0.0, 0.5, rng.random() * 4]) for _ in range(n)]
        local = [rng.choice([0, 0, 1, 3, rng.randrange(0, 40)]) for _ in range(n)]
        c = Candidates(rng.randrange(1, 20_000), queue, local, 512)
        assert policy.choose_prefill(c).prefill == scalar_choice(policy, c)


def test_the_decode_board_holds_every_instances_committed_load():
    trace = load_trace(FIXTURE)
    sim = Simulator(trace, SimConfig(prefill=4, decode=6, admission="predictive", speed=20), COST)
    arrivals = iter(trace[:150])
    checked = 0
    for rid, req in enumerate(arrivals):
        now = req.arrival_s / sim.cfg.speed
        sim._drain(now)
        board = sim.board.committed(now)
        for d in sim.decodes:
            d.advance(now)
            expected = d.committed_load()
            assert board.batch[d.index] == expected.batch
            assert board.kv_tokens[d.index] == pytest.approx(expected.kv_tokens, rel=1e-9, abs=1e-6)
            checked += expected.batch > 0
        sim._arrive(rid, req, now)
    assert checked > 100
    assert np.isfinite(sim.board.resident_kv(1e6)).all()
