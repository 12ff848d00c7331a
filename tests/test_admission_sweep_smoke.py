"""`bench_conductor --generalize` end to end on two tiny generated traces (a smoke test: no
figures are asserted, the benchmark prints them)."""
from conductor.tracegen import spec_from
from loadtest.admission_sweep import FAMILY, MODES, generalize, report


def test_generalize_reports_every_trace_mode_and_horizon():
    results = generalize(requests=300, seed=5, names=["documents", "agent"], processes=1)
    assert [r.name for r in results] == ["documents", "agent"]
    for r in results:
        assert set(r.runs) == set(MODES) and r.speed > 0
        assert all(s.requests == 300 for s in r.runs.values())
    text = report(results, wall_s=1.0)
    assert "| documents |" in text and "| agent |" in text
    assert "Best goodput" in text and "| 0-0.5 s |" in text


def test_the_family_spans_the_generator():
    assert len(FAMILY) >= 12
    arrivals = {spec_from(preset, **overrides).arrival for preset, overrides, _ in FAMILY.values()}
    assert arrivals == {"poisson", "bursty", "diurnal"}
    assert {preset for preset, _, _ in FAMILY.values()} == {"conversation", "documents"}
