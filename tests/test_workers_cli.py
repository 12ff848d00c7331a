"""`kvstore worker`, `kvstore gateway` and `kvstore llm`: user errors are one `error:` line and exit 2
(run as real `python -m kvstore` processes)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import free_port


def kvstore(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvstore", *args], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("args, says", [
    (["worker", "prefill"], "--conductor"),
    (["worker", "sideways", "--conductor", "127.0.0.1:1"], "role"),
    (["worker", "decode", "--conductor", "nowhere", "--model", "tiny"], "--conductor must be HOST:PORT"),
    (["worker", "decode", "--conductor", "127.0.0.1:1", "--model", "gpt-9"], "--model"),
    (["worker", "prefill", "--conductor", "127.0.0.1:1", "--cluster", "etcd://x"], "bad cluster URL"),
    (["worker", "prefill", "--conductor", "127.0.0.1:1", "--cluster", "etcd://127.0.0.1:1/x", "--store", "h:1"],
     "not allowed with"),
    (["worker", "prefill", "--conductor", "127.0.0.1:1", "--cluster", "etcd://127.0.0.1:1/x"], "cannot read cluster"),
    (["conductor", "--port", "0", "--cluster", "etcd://127.0.0.1:1/x"], "cannot read cluster"),
    (["gateway"], "--conductor"),
    (["llm", "up", "--prefill", "0", "--model", "tiny"], "at least 1"),
    (["llm", "up", "--report-timeout", "0", "--model", "tiny"], "--report-timeout must be positive"),
    (["llm", "up", "--report-timeout", "-1", "--model", "tiny"], "--report-timeout must be positive"),
    (["llm", "down"], "action"),
])
def test_bad_flags_are_one_error_line(args, says):
    done = kvstore(*args)
    assert done.returncode == 2
    assert done.stderr.startswith("error: ") and says in done.stderr
    assert "Traceback" not in done.stderr


def test_a_worker_without_a_store_says_so():
    done = kvstore("worker", "prefill", "--conductor", "127.0.0.1:1", "--model", "tiny",
                   "--store", f"127.0.0.1:{free_port()}")
    assert done.returncode == 2
    assert "cannot reach the store" in done.stderr


def test_the_top_level_help_lists_the_serving_commands():
    out = kvstore("--help").stdout
    assert "worker" in out and "gateway" in out and "llm" in out


@pytest.mark.parametrize("args", [["worker", "--help"], ["worker", "decode", "--conductor", "nowhere"],
                                  ["llm", "up", "--prefill", "0", "--model", "tiny"]])
def test_help_and_flag_errors_do_not_import_torch(args):
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "kvstore", *args], capture_output=True,
                          text=True, timeout=60)
    imported = {line.rsplit("|", 1)[1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    assert imported and "torch" not in imported and "transformers" not in imported
