"""The `kvstore` command line, run as a real process (`python -m kvstore ...`).

What is checked: the help texts document every flag of `kvstore serve`; a bad
flag value ends with exit status 2 and a one-line error, never a traceback;
`--config FILE` (TOML) is honoured and a flag given on the command line wins
over the file; the daemon stops cleanly (exit status 0, Unix socket file
removed) on SIGTERM, SIGINT and `SHUTDOWN` from redis-cli; `--maxclients`
turns the next client away with Redis's error; `--unixsocket` serves
redis-cli -s.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import pytest
import redis

from conftest import Daemon, free_port, wait_ready
from kvstore.admin.config import Config

ISSUE_FLAGS = ("--bind", "--port", "--unixsocket", "--dram-size", "--maxmemory-policy", "--requirepass",
               "--proto-max-bulk-len", "--maxclients", "--config")
SMALL = ("--dram-size", "4mb")


def kvstore(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvstore", *args], capture_output=True, text=True,
                          timeout=timeout)


# ----------------------------------------------------------------- help

def test_serve_help_documents_every_flag():
    done = kvstore("serve", "--help")
    assert done.returncode == 0
    for flag in ISSUE_FLAGS:
        assert f"  {flag} " in done.stdout, flag
    for choice in ("allkeys-lru", "noeviction"):
        assert choice in done.stdout


def test_serve_help_states_each_default_once():
    done = kvstore("serve", "--help")
    assert "(default: None)" not in done.stdout


def test_top_level_help_names_serve():
    done = kvstore("--help")
    assert done.returncode == 0
    assert "serve" in done.stdout and "run a store node" in done.stdout


def test_top_level_help_documents_every_serve_flag():
    done = kvstore("--help")
    assert all(flag in done.stdout for flag in ISSUE_FLAGS)


def test_console_script_is_installed():
    script = os.path.join(os.path.dirname(sys.executable), "kvstore")
    done = subprocess.run([script, "serve", "--help"], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0 and "--dram-size" in done.stdout


# ----------------------------------------------------------------- bad values

@pytest.mark.parametrize("args, names", [
    (("--port", "abc"), "--port"),
    (("--dram-size", "12zb"), "12zb"),
    (("--proto-max-bulk-len", "lots"), "lots"),
    (("--maxmemory-policy", "allkeys-lfu"), "--maxmemory-policy"),
    (("--maxclients", "many"), "--maxclients"),
    (("--maxclients", "0"), "maxclients"),
    (("--dram-size", "1kb"), "dram-size"),
    (("--port", "70000"), "70000"),
    (("--no-such-flag",), "--no-such-flag"),
])
def test_bad_flag_value_exits_2_with_one_error_line(args, names):
    done = kvstore("serve", *args)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and done.stderr.rstrip().splitlines()[-1] == errors[0]
    assert names in errors[0]
    assert done.stdout == ""


def test_unreadable_config_file_exits_2(tmp_path):
    done = kvstore("serve", "--config", str(tmp_path / "absent.toml"))
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip() == f"error: cannot read config file {tmp_path / 'absent.toml'}: " \
                                  "No such file or directory"


def test_bad_key_in_config_file_exits_2(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text('dram = "1gb"\n')
    done = kvstore("serve", "--config", str(path))
    assert done.returncode == 2 and done.stderr.strip() == "error: unknown setting 'dram'"


# One value each setting must refuse (of the wrong kind, or out of bounds) when read from a file.
BAD_TOML = [
    ('bind = ""', "bind must name at least one address"),
    ("bind = 5", "bind must be a string"),
    ("port = true", "port must be an integer"),
    ("unixsocket = 1", "unixsocket must be a string"),
    ('dram-size = "64tb"', "dram-size (70368744177664 bytes) is more than this machine's memory"),
    ('maxmemory-policy = "allkeys-lfu"', "maxmemory-policy must be one of allkeys-lru, noeviction"),
    ("requirepass = 1234", "requirepass must be a string"),
    ('proto-max-bulk-len = "1kb"', "proto-max-bulk-len must be at least 1mb and below 4gb"),
    ("maxclients = 0", "maxclients must be at least 1"),
    ('loglevel = "info"', "loglevel must be one of debug, verbose, notice, warning"),
    ("ssd-dir = true", "ssd-dir must be a string"),
    ("ssd-size = -1", "ssd-size must be at least 1mb"),
    ('ssd-write-policy = "sometimes"', "ssd-write-policy must be one of write-back, write-through"),
    ('ssd-compression = "zstd"', "ssd-compression must be one of auto, off"),
    ("gpu-size = -1", "gpu-size must be 0 (no GPU tier) or more"),
    ("gpu-device = -1", "gpu-device must be 0 or more"),
    ("high-watermark = 1.5", "watermarks must satisfy 0 < low-watermark < high-watermark <= 1"),
    ('low-watermark = "low"', "low-watermark must be a number"),
    ("promote-hits = 0", "promote-hits must be at least 1"),
    ("promote-window-ms = -5", "promote-window-ms must be at least 1"),
    ("metrics-port = 70000", "metrics-port 70000 out of range"),
    ("cluster = 5", "cluster must be a string"),
    ("announce = 1", "announce must be a string"),
    ("cluster-node-timeout = 0.1", "cluster-node-timeout must be between 0.5 and 3600 seconds"),
    ("cluster-move-budget = -1", "cluster-move-budget must be between 0 and 600 seconds"),
    ("cluster-nic-gbps = 0", "cluster-nic-gbps must be between 0.1 and 10000 Gbit/s"),
    ("hot-reads = -5", "hot-reads must be 0 (no copies) or more"),
    ("hot-replicas = 17", "hot-replicas must be between 0 and 16"),
    ("aclfile = 1", "aclfile must be a string"),
    ('protected-mode = "maybe"', "protected-mode must be one of yes, no"),
    ("tls-port = 70000", "tls-port 70000 out of range"),
    ("tls-cert-file = 1", "tls-cert-file must be a string"),
    ("tls-key-file = 1", "tls-key-file must be a string"),
    ("tls-ca-cert-file = 1", "tls-ca-cert-file must be a string"),
    ('tls-auth-clients = "sometimes"', "tls-auth-clients must be one of yes, no, optional"),
    ('tls-cluster = "always"', "tls-cluster must be one of yes, no"),
    ('client-output-buffer-limit = "normal 1mb"', "client-output-buffer-limit: expected groups of class"),
    ('client-query-buffer-limit = "1kb"', "client-query-buffer-limit must be at least 1mb"),
    ("slowlog-log-slower-than = -2", "slowlog-log-slower-than must be -1 (log nothing) or more"),
    ("slowlog-max-len = -1", "slowlog-max-len must be 0 or more"),
    ('evict-companions = "kv_bytes"', "evict-companions takes pairs of key suffixes (an even number of words)"),
]


def test_bad_toml_covers_every_setting():
    assert {line.split(" = ")[0] for line, _ in BAD_TOML} == set(Config.names())


@pytest.mark.parametrize("line, message", BAD_TOML, ids=[line for line, _ in BAD_TOML])
def test_bad_value_in_config_file_exits_2_with_one_error_line(tmp_path, line, message):
    path = tmp_path / "bad.toml"
    path.write_text(line + "\n")
    done = kvstore("serve", "--config", str(path))
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert len(done.stderr.splitlines()) == 1 and done.stderr.startswith(f"error: {message}")


def test_log_level_from_a_config_file(kvstore_factory, tmp_path):
    port = free_port()
    path = tmp_path / "kvstore.toml"
    path.write_text(f'port = {port}\ndram-size = "8mb"\nloglevel = "warning"\n')
    daemon = spawn(kvstore_factory, port, "--config", str(path))
    assert config_get(port, "loglevel") == "warning"
    assert daemon.stop() == 0
    assert "Ready to accept connections" not in daemon.log()


# ----------------------------------------------------------------- --config

def spawn(kvstore_factory, port: int, *args: str) -> Daemon:
    """`kvstore serve` with exactly these flags, ready on ``port``; stopped with the factory's."""
    log_path = str(kvstore_factory.tmp_path / f"kv-{port}.log")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "kvstore", "serve", *args],
                                stdout=log, stderr=subprocess.STDOUT)
    daemon = Daemon(proc, "127.0.0.1", port, log_path=log_path)
    try:
        wait_ready("127.0.0.1", port, proc)
    except Exception:
        daemon.stop(signal.SIGKILL)
        raise RuntimeError("kvstore did not start:\n" + daemon.log())
    return kvstore_factory.adopt(daemon)


def config_get(port: int, name: str) -> str:
    with redis.Redis(port=port, decode_responses=True) as client:
        return client.config_get(name)[name]


def test_config_file_is_honoured(kvstore_factory, tmp_path):
    port = free_port()
    sock = tmp_path / "from-file.sock"
    path = tmp_path / "kvstore.toml"
    path.write_text(f'port = {port}\ndram-size = "8mb"\nunixsocket = "{sock}"\nmaxclients = 7\n')
    daemon = spawn(kvstore_factory, port, "--config", str(path))
    with redis.Redis(port=port) as client:
        assert client.info("kvcache")["dram_capacity"] == 8 << 20
        assert client.info("server")["config_file"] == str(path)
    assert config_get(port, "maxclients") == "7"
    with redis.Redis(unix_socket_path=str(sock)) as client:
        assert client.ping()
    assert daemon.stop() == 0


def test_a_flag_overrides_the_config_file(kvstore_factory, tmp_path):
    file_port, flag_port = free_port(), free_port()
    path = tmp_path / "kvstore.toml"
    path.write_text(f'port = {file_port}\ndram-size = "8mb"\nmaxmemory-policy = "noeviction"\n')
    daemon = spawn(kvstore_factory, flag_port, "--config", str(path), "--port", str(flag_port),
                   "--maxmemory-policy", "allkeys-lru")
    assert config_get(flag_port, "maxmemory-policy") == "allkeys-lru"
    with redis.Redis(port=flag_port) as client:
        assert client.info("kvcache")["dram_capacity"] == 8 << 20
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", file_port), timeout=2).close()
    assert daemon.stop() == 0


# ----------------------------------------------------------------- shutdown

@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_stops_cleanly(kvstore_factory, sig):
    daemon = kvstore_factory(*SMALL)
    with redis.Redis(port=daemon.port) as client:       # a connected client does not hold it up
        client.set("k", "v")
        assert os.path.exists(daemon.unix_socket)
        assert daemon.stop(sig) == 0
    assert not os.path.exists(daemon.unix_socket)
    assert "Traceback" not in daemon.log()


def test_shutdown_from_redis_cli(kvstore_factory):
    daemon = kvstore_factory(*SMALL)
    subprocess.run(["redis-cli", "-p", str(daemon.port), "SHUTDOWN"], capture_output=True,
                   timeout=10)
    assert daemon.proc.wait(10) == 0
    assert not os.path.exists(daemon.unix_socket)
    assert "Traceback" not in daemon.log()


# ----------------------------------------------------------------- clients

def connected(daemon: Daemon) -> socket.socket:
    sock = socket.create_connection((daemon.host, daemon.port), timeout=5)
    sock.sendall(b"PING\r\n")
    assert sock.recv(64) == b"+PONG\r\n"
    return sock


def test_maxclients_rejects_the_next_client(kvstore_factory):
    daemon = kvstore_factory(*SMALL, "--maxclients", "2")
    first, second = connected(daemon), connected(daemon)
    with socket.create_connection((daemon.host, daemon.port), timeout=5) as third:
        assert third.recv(128) == b"-ERR max number of clients reached\r\n"
        assert third.recv(128) == b"", "the rejected client is disconnected"
    first.close()
    # The server may see the close a moment later; redis-py retries the connect meanwhile.
    with redis.Redis(port=daemon.port) as client:
        assert client.info("clients")["connected_clients"] == 2    # second and this one
        assert client.info("stats")["rejected_connections"] >= 1
    second.close()


def test_unixsocket_serves_redis_cli(kvstore_factory):
    daemon = kvstore_factory(*SMALL)
    def cli(*args: str) -> str:
        done = subprocess.run(["redis-cli", "-s", daemon.unix_socket, *args], capture_output=True,
                              text=True, timeout=10)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    assert cli("PING") == "PONG"
    assert cli("SET", "greeting", "hello world") == "OK"
    assert cli("GET", "greeting") == "hello world"
    with redis.Redis(port=daemon.port) as client:
        assert client.get("greeting") == b"hello world"
