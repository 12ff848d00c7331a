"""Smoke run of loadtest/bench_tiers.py and loadtest/hit_ratio.py at tiny sizes.

The policy replays run on hand-made sequences (where the right answer is
known) and on the 200-request trace fixture; the daemon helpers start real
`kvstore serve` processes and move a few MiB. No timing is asserted: the
figures only have to be there and be numbers.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from kvstore.store.eviction import NO_PARENT
from loadtest import bench_tiers, hit_ratio
from loadtest.bench_tiers import KIB, MIB, RawClient, Settings
from loadtest.procs import ProcessGroup

FIXTURE = Path(__file__).parent / "fixtures" / "conversation_head200.jsonl"
TINY = replace(Settings().quick(), sizes=(256 * KIB,), bytes_per_run=2 * MIB, latency_values=2,
               dram_hit_bytes=4 * MIB, small_gets=200, restart_values=2000, trace_requests=200)


def sequence(blocks: list[int]) -> list[hit_ratio.Access]:
    return [hit_ratio.Access(b, NO_PARENT, i) for i, b in enumerate(blocks)]


def test_belady_beats_lru_on_a_loop_larger_than_the_cache():
    loop = sequence([0, 1, 2] * 4)
    assert hit_ratio.lru_hits(loop, 2) == 0
    assert hit_ratio.belady_hits(loop, 2) == 6       # keeps two blocks of the loop, bypasses the third
    assert hit_ratio.belady_hits(loop, 3) == hit_ratio.lru_hits(loop, 3) == 9


def test_policies_on_the_trace_fixture_stay_under_the_optimum():
    accesses = hit_ratio.load_accesses(FIXTURE)
    blocks = hit_ratio.working_set(accesses)
    assert len(accesses) > blocks > 100
    capacity = blocks // 4
    best = hit_ratio.belady_hits(accesses, capacity)
    assert 0 < best <= len(accesses) - blocks
    assert hit_ratio.lru_hits(accesses, capacity) <= best
    for promote_hits in (1, 2):
        assert 0 < hit_ratio.kvstore_hits(accesses, capacity, promote_hits) <= best


def test_hit_ratio_table_names_every_policy():
    table = bench_tiers.hit_ratio_table(FIXTURE, TINY)
    row = next(iter(table.rows.values()))
    assert set(row.samples) | set(row.errors) == {"kvstore", "Belady (optimal)", "LRU", "kvstore, promote-hits 2"}
    assert "LRU/Belady" in table.render_text()


@pytest.fixture
def group(tmp_path):
    with ProcessGroup(tmp_path) as processes:
        yield processes


def test_raw_client_round_trip_through_a_node(group):
    node = bench_tiers.start_node(group, "kvstore", "--dram-size", "16mb")
    client = RawClient(node.port)
    values = [bytes([n]) * (64 * KIB) for n in range(3)]
    client.set_many([b"a", b"b", b"c", b"d"], values, 2)
    assert bytes(client.get_many([b"d", b"b"], 64 * KIB, 2)) == values[1]
    assert client.command(b"PING") == b"+PONG\r\n"
    client.close()


def test_daemon_rounds_through_each_client_and_the_raw_round_report_throughput(group, tmp_path):
    rounds = [bench_tiers.daemon_ssd_round(group, str(tmp_path), 256 * KIB, kind, TINY)
              for kind in bench_tiers.CLIENTS]
    for figures in (*rounds, bench_tiers.raw_ssd_round(str(tmp_path), 256 * KIB, TINY)):
        assert set(figures) == {"put", "get", "put cpu", "get cpu"} and all(v > 0 for v in figures.values())


def test_restart_table_reports_recovery_and_pings(group, tmp_path):
    table = bench_tiers.restart_table(group, str(tmp_path), TINY)
    rate = table.rows["values recovered per second (daemon log)"]
    assert rate.median("kvstore") > 0 and rate.median("SSDTier.open + scan_index") > 0
    assert "PINGs answered while" in table.render_text()
