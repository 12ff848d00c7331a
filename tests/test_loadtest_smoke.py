"""The kvstore-vs-Redis benchmark in a tiny configuration: it runs end to end against a real
`kvstore serve` and a real redis-server, fills every cell, and stops every process it
started, also on Ctrl-C. No figure is asserted: this proves the script works, not how fast.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from loadtest.bench_vs_redis import KIB, KVSTORE, REDIS, Settings, main, parse_size, run
from loadtest.procs import ProcessGroup, start_redis
from loadtest.report import Table, Target

TINY = Settings(repeats=2, memory="64mb", sizes=(64 * KIB,), large_bytes=256 * KIB, large_clients=2,
                redispy_bytes=256 * KIB, small_requests=2000, match_calls=20, mooncake=False)
REDIS_AS_SUBJECT = "redis-server --port {port} --bind 127.0.0.1 --save '' --appendonly no --dir {dir}"


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_every_cell_is_measured_on_both_servers(tmp_path):
    with ProcessGroup(tmp_path) as group:
        table = run(TINY, group)
        pids = [p.pid for p in group.processes]
    assert not any(alive(pid) for pid in pids)
    assert table.failures() == []
    for row in table.rows.values():
        assert len(row.samples[KVSTORE]) == 2 and len(row.samples[REDIS]) == 2, row.name
    per_call = next(row for name, row in table.rows.items() if name.startswith("server commands per KV.MATCH"))
    assert per_call.median(KVSTORE) == pytest.approx(1.0)
    assert per_call.median(REDIS) == pytest.approx(1.0)


def test_a_server_without_kv_commands_leaves_reasons_not_numbers(tmp_path):
    settings = Settings(repeats=1, memory="64mb", groups=("match",), match_calls=5, mooncake=False,
                        kvstore_cmd=REDIS_AS_SUBJECT)
    with ProcessGroup(tmp_path) as group:
        table = run(settings, group)
    [failure] = table.failures()
    assert failure.startswith(f"{KVSTORE} not measured") and "KV.PUT" in failure
    assert all(row.median(REDIS) is not None for row in table.rows.values())
    assert "n/a" in table.render_text()


def test_cli_writes_markdown_and_json(tmp_path, capsys):
    out = tmp_path / "figures.json"
    assert main(["--quick", "--only", "match", "--no-mooncake", "--memory", "64mb",
                 "--json", str(out), "--markdown"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("### kvstore vs Redis") and "| kvstore/redis |" in printed
    assert re.search(r"nproc: \d+", printed)
    figures = json.loads(out.read_text())
    assert {row["name"].split(" (")[0] for row in figures["rows"]} >= {"KV.MATCH 256-key chain p50"}
    assert all(row["median"].keys() == {KVSTORE, REDIS} for row in figures["rows"])


def test_ctrl_c_stops_every_server(tmp_path):
    # As from a terminal: a suite started in the background (`make test &`) passes SIGINT on ignored,
    # and Python then installs no KeyboardInterrupt for it.
    bench = subprocess.Popen([sys.executable, "-m", "loadtest.bench_vs_redis", "--only", "small", "--no-mooncake",
                              "--memory", "64mb"], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    pids = []
    try:
        while len(pids) < 2:
            line = bench.stderr.readline()
            assert line, "benchmark exited before starting both servers"
            if match := re.match(r"\w+: pid (\d+) on ", line):
                pids.append(int(match.group(1)))
        time.sleep(0.5)
        bench.send_signal(signal.SIGINT)
        _, said = bench.communicate(timeout=60)     # read on: a full stderr pipe would block the bench
        assert bench.returncode == 130, said[-2000:]
    finally:
        if bench.poll() is None:
            bench.kill()
    assert not any(alive(pid) for pid in pids)


def test_group_stops_its_servers_when_the_body_raises(tmp_path):
    with pytest.raises(ZeroDivisionError):
        with ProcessGroup(tmp_path) as group:
            server = start_redis(group, "16mb")
            1 / 0
    assert server.process.popen.poll() is not None and not alive(server.process.pid)


def test_table_reports_medians_ratios_and_targets():
    table = Table("t", "a", "b", extras=("c",))
    speed = table.row("speed", "GB/s", Target(1.0))
    latency = table.row("latency", "ms", Target(0.5, "value"))
    for a, b in ((1.0, 2.0), (3.0, 2.0), (2.5, 2.0)):
        speed.add("a", a)
        speed.add("b", b)
    speed.add("c", 5.0)
    latency.add("a", 0.7)
    latency.fail("b", "no such command")
    assert speed.median("a") == 2.5 and speed.ratio("a", "b") == 1.25 and table.met(speed) is True
    assert speed.ratio("a", "c") == 0.5  # unpaired: ratio of the medians
    paired = table.row("paired", "GB/s")
    for a, b in ((1.0, 2.0), (4.0, 2.0), (3.0, 1.0)):
        paired.add("a", a)
        paired.add("b", b)
    assert paired.ratio("a", "b") == 2.0  # median of 0.5, 2, 3; the medians' ratio would be 1.5
    assert table.met(latency) is False
    assert table.cells(latency)[3] == "n/a" and table.failures() == ["b not measured in 1 row(s) from 'latency': "
                                                                     "no such command"]
    assert table.to_json({"date": "today"})["rows"][0]["met"] is True


def test_parse_size_reads_redis_units():
    assert parse_size("2gb") == 2 << 30 and parse_size("64MB") == 64 << 20 and parse_size("4096") == 4096
