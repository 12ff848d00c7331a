"""`bench_conductor --generalize` end to end on two tiny generated traces (a smoke test: no
figures are asserted, the benchmark prints them)."""
import pytest

from conductor.tracegen import spec_from
from conductor.costmodel import CostModel
from conductor.simulator import SimConfig, Simulator
from conductor.trace import TraceRequest
from loadtest.admission_drain import drain_table
from loadtest.admission_sweep import (ALL_MODES, FAMILY, GRID, _bias_table, generalize, grid_map,
                                      report, served_while_loaded)


def test_generalize_reports_every_trace_mode_and_horizon():
    names = [next(iter(GRID)), "agent"]
    results = generalize(requests=300, seed=5, names=names, processes=1, min_span_s=0.0)
    assert [r.name for r in results] == names
    for r in results:
        assert set(r.runs) == set(ALL_MODES) and r.speed > 0
        assert all(s.requests == 300 for s in r.runs.values())
    text = report(results, wall_s=1.0)
    assert f"| {names[0]} |" in text and "| agent |" in text
    assert "Best fixed mode" in text and "Audited >= 0.98" in text
    assert "served by the last arrival" in text
    for r in results:
        assert all(0 < r.while_loaded[m] <= r.runs[m].completed_in_slo for m in ALL_MODES)
    assert "| 0-0.5 s |" in _bias_table(results)
    assert "steady (CV 0.3), answers 40 |" in grid_map(results[:1])


def test_the_grid_crosses_every_knob_and_holds_the_steady_long_reused_short_region():
    specs = [spec_from(preset, **overrides) for preset, overrides, _ in GRID.values()]
    assert len(specs) == 24
    assert {s.burst_cv for s in specs} == {0.3, 1.0, 4.0}
    assert {s.reuse for s in specs} == {0.2, 0.85}
    assert any(s.burst_cv < 1 and s.reuse > 0.8 and s.first_tokens.parts[0][1] >= 20000
               and s.output_tokens.parts[0][1] <= 50 for s in specs)


def test_the_family_spans_the_generator():
    assert len(FAMILY) >= 12
    arrivals = {spec_from(preset, **overrides).arrival for preset, overrides, _ in FAMILY.values()}
    assert arrivals == {"poisson", "bursty", "diurnal"}
    assert {preset for preset, _, _ in FAMILY.values()} == {"conversation", "documents"}


def test_served_while_loaded_counts_the_kv_that_joined_decode_by_the_last_arrival():
    # three requests 10 s apart: the first two join decode within their 10 s, the last one
    # a prefill after the trace's last arrival
    trace = [TraceRequest(10.0 * i, 8000, 20, tuple(range(100 * i, 100 * i + 16)))
             for i in range(3)]
    sim = Simulator(trace, SimConfig(prefill=1, decode=1, admission="baseline"),
                    CostModel.from_testbed())
    summary = sim.run()
    assert summary.completed_in_slo == 3 and sim.out.ttft_s[2] > 0
    assert served_while_loaded(sim, trace, speed=1.0) == 2


@pytest.mark.parametrize("decode_wait_s", [0.0, 30.0])
def test_the_drain_table_splits_each_modes_goodput_at_the_last_arrival(decode_wait_s):
    name = next(iter(GRID))
    text = drain_table(name, ["baseline", "predictive"], requests=200, span_s=0.0,
                       decode_wait_s=decode_wait_s)
    assert ("KV waits up to 30 s at decode" in text) == bool(decode_wait_s)
    rows = [line for line in text.splitlines() if line.startswith(("| baseline", "| predictive"))]
    assert len(rows) == 2 and "after the last arrival" in text
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        stretches, whole = cells[1:-4], int(cells[-3].replace(",", ""))
        assert sum(int(c.replace(",", "")) for c in stretches) == whole
