"""Smoke test for loadtest/bench_transport.py: one short run starts its two kvstore daemons and its raw
socket child, and prints a figure for every path and case (the figures themselves are not tested)."""
from __future__ import annotations

from loadtest import bench_transport


def test_one_short_run_prints_every_path_and_case(capsys):
    assert bench_transport.main(["--repeats", "1", "--mib", "8"]) == 0
    out = capsys.readouterr().out
    for case in ("read 1 MiB", "read 4 MiB", "write 1 MiB", "write 4 MiB"):
        assert f"{case}: both sides" in out
        assert f"{case}: to move 12.5 GB/s" in out        # the note needs RESP, socket and control figures
    assert "n/a" not in out
