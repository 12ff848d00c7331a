"""The chaos run in a short configuration (`python -m loadtest.chaos` as a subprocess): a real
2-node cluster on loopback under the trace load, a stalled half-sent value and a kill -9 with a
restart. Asserted: no wrong byte served, every node up at the end, every node stopped and
the SSD tier's tmpfs unmounted afterwards. The
recovery times are printed, not asserted (they are figures, not properties).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def chaos_leftovers(work: Path) -> tuple[int, int]:
    """Node processes of chaos clusters made under ``work``, and tmpfs mounted for their SSD tiers.

    Only this run's: a chaos run of another test session on the same host is none of its business.
    """
    pattern = f"kvstore serve .*--ssd-dir {re.escape(str(work))}/kvstore-chaos-"
    nodes = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True)
    mounts = [line for line in Path("/proc/mounts").read_text().splitlines() if f" {work}/kvstore-chaos-" in line]
    return len(nodes.stdout.split()), len(mounts)


def test_a_short_chaos_run_serves_no_wrong_byte_and_keeps_every_node_up(tmp_path):
    out = tmp_path / "chaos.json"
    done = subprocess.run([sys.executable, "-m", "loadtest.chaos", "--nodes", "2", "--no-netns", "--duration", "2",
                           "--recovery", "2", "--threads", "2", "--faults", "stall,kill", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=100,
                          env={**os.environ, "TMPDIR": str(tmp_path)})     # its work folder under tmp_path
    assert done.returncode == 0, done.stdout + done.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [r["fault"] for r in rows] == ["a client sends half a value and stalls", "kill -9 a node, restart it"]
    for row in rows:
        assert row["wrong_bytes"] == 0, row
        assert row["nodes_up"] == 2 and row["owners"] == 2, row
        assert row["ops"] > 0 and row["written"] > 0, row
    assert "| kill -9 a node, restart it |" in done.stdout
    assert chaos_leftovers(tmp_path) == (0, 0)
