"""`kvstore replay` and `kvstore conductor` as a user calls them: output and user errors."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from conductor.cli import conductor_main, replay_main

FIXTURE = str(Path(__file__).parent / "fixtures" / "conversation_head200.jsonl")


def test_json_prints_one_object(capsys):
    assert replay_main([FIXTURE, "--prefill", "2", "--decode", "2", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["requests"] == 200 and doc["policy"] == "kvcache-centric"
    for key in ("admitted", "rejected", "completed_in_slo", "slo_attainment", "ttft_mean_s",
                "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "tbt_p90_s", "prefix_hit_rate",
                "prefill_busy_s", "wasted_prefill_s"):
        assert key in doc


def test_compare_prints_one_object_per_policy_and_plots(capsys, tmp_path):
    png = tmp_path / "cdf.png"
    assert replay_main([FIXTURE, "--prefill", "2", "--decode", "2", "--compare", "--json",
                        "--rejection", "early", "--plot", str(png)]) == 0
    docs = json.loads(capsys.readouterr().out)
    assert [d["policy"] for d in docs] == ["random", "load-balance", "cache-aware",
                                          "kvcache-centric"]
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_table_is_the_default(capsys):
    assert replay_main([FIXTURE, "--prefill", "2", "--decode", "1"]) == 0
    assert "ttft_p90_s" in capsys.readouterr().out


def test_calibrate_uses_the_fitted_model(capsys, tmp_path):
    timings = tmp_path / "t.csv"
    timings.write_text("kind,tokens,seconds\ntransfer,1000,0.5\ntransfer,2000,1.0\n")
    assert replay_main([FIXTURE, "--json", "--calibrate", str(timings)]) == 0
    assert json.loads(capsys.readouterr().out)["cost_model"]["t_token"] == pytest.approx(5e-4)


@pytest.mark.parametrize("args, message", [
    (["--prefill", "0"], "--prefill must be positive"),
    (["--decode", "0"], "--decode must be positive"),
    (["--ttft-slo", "0"], "--ttft-slo must be positive"),
    (["--tbt-slo", "0"], "--tbt-slo must be positive"),
    (["--speed", "-2"], "--speed must be positive"),
    (["--decode-wait", "-1"], "--decode-wait must be at least 0"),
    (["--policy", "fastest"], "invalid choice: 'fastest'"),
])
def test_bad_flags(capsys, args, message):
    assert replay_main([FIXTURE, *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


def test_bad_trace_line_is_named(capsys, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [0]}\n'
                   '{"timestamp": 1, "input_length": -3}\n')
    assert replay_main([str(bad)]) == 2
    assert "line 2" in capsys.readouterr().err


def test_empty_trace(capsys, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert replay_main([str(empty)]) == 2
    assert "holds no requests" in capsys.readouterr().err


def test_conductor_with_unreachable_store_is_a_user_error(capsys):
    assert conductor_main(["--port", "0", "--store", "127.0.0.1:1"]) == 2
    assert capsys.readouterr().err.startswith("error: cannot reach the store")


def test_conductor_bad_store_address(capsys):
    assert conductor_main(["--store", "nowhere"]) == 2
    assert "--store must be HOST:PORT" in capsys.readouterr().err


def test_no_traceback_from_a_process():
    proc = subprocess.run([sys.executable, "-m", "conductor.cli", "replay", "/no/such/trace"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("error: cannot read trace")
