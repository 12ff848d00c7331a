"""loadtest/wire_steps.py in a tiny configuration: it drives a node connection by hand
through SETs and GETs (small and big values) and reports every step, asserting no figure."""
from __future__ import annotations

import pytest

from loadtest.wire_steps import main, measure


@pytest.mark.parametrize("size", [100, 64 * 1024])
def test_every_step_is_reported_for_set_and_get(size):
    results = measure(size, ops=5, rounds=2, steps=True)
    assert set(results) == {"SET", "GET"}
    for samples in results.values():
        assert all(turns >= 1 for turns in samples["turns"])
        assert {"turn", "parse", "run", "reply: flush"} <= set(samples)
    stored_by = "run: commit" if size >= 32 * 1024 else "run: put"    # received into the arena, or copied
    assert stored_by in results["SET"]


def test_the_table_prints(capsys):
    assert main(["--size", "1000", "--ops", "3", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    assert "load average at start" in out and "untimed turn(s)" in out
