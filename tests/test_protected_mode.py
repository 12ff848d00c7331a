"""Protected mode, as Redis has it: a node whose default user needs no password
serves only clients on its own host.

The decision is tested directly (every kind of address), then on real
processes: a loopback client is served; and, in a private network namespace
of its own (``unshare -n``, nothing leaves it), a `kvstore serve` bound to a
non-loopback address refuses a client coming from that address with Redis's
-DENIED text, until a password is set or protected mode is turned off.
"""
from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time

import pytest

from kvstore.admin import acl
from kvstore.commands.families import build_table
from conftest import free_port
from test_redis_compat import RespConnection

CATALOG = acl.Catalog.of(build_table().all_commands())

NETNS_ADDRESS = "10.77.0.1"     # exists only inside the test's own network namespace


@pytest.mark.parametrize("peer, refused", [
    ("192.0.2.7", True), ("10.1.2.3", True), ("2001:db8::1", True), ("fe80::1%eth0", True),
    ("127.0.0.1", False), ("127.9.9.9", False), ("::1", False), ("::ffff:127.0.0.1", False), (None, False),
])
def test_only_remote_clients_of_a_passwordless_default_user_are_refused(peer, refused):
    assert acl.protected_mode_refuses(acl.Users(CATALOG).default, peer) == refused
    assert not acl.protected_mode_refuses(acl.Users(CATALOG, "pw").default, peer)
    users = acl.Users(CATALOG)
    users.setuser("alice", ["on", ">pw", "~*", "+@all"])        # another user does not lift it
    assert acl.protected_mode_refuses(users.default, peer) == refused


def test_denied_text_is_redis_text():
    assert acl.DENIED.startswith(b"-DENIED Redis is running in protected mode because protected mode is enabled")
    assert acl.DENIED.endswith(b"to start accepting connections from the outside.\r\n")
    assert acl.DENIED.count(b"\r\n") == 1


def test_loopback_clients_are_served(server):
    with RespConnection(server) as conn:
        assert conn.call("CONFIG", "GET", "protected-mode") == b"*2\r\n$14\r\nprotected-mode\r\n$3\r\nyes\r\n"
        assert conn.call("PING") == b"+PONG\r\n"


def _netns_usable() -> bool:
    if not (shutil.which("unshare") and shutil.which("ip")):
        return False
    probe = subprocess.run(["unshare", "-n", "ip", "link", "set", "lo", "up"], capture_output=True)
    return probe.returncode == 0


@pytest.mark.skipif(not _netns_usable(), reason="needs unshare -n and ip (a private network namespace)")
def test_remote_client_is_denied_inside_a_private_network_namespace(tmp_path):
    done = subprocess.run(["unshare", "-n", sys.executable, __file__, str(tmp_path)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.splitlines()[-1])
    assert seen["default"] == acl.DENIED.decode() + "<closed>"
    assert seen["loopback"] == "+PONG\r\n"
    assert seen["config-set-no"] == "+PONG\r\n"
    assert seen["requirepass"].startswith("-NOAUTH")
    assert seen["protected-mode-no"] == "+PONG\r\n"
    assert seen["rejected"] == 1


# ------------------------------------------------------------------ inside the namespace

def _start(tmp: str, *flags: str) -> tuple[subprocess.Popen, int]:
    port = free_port()
    log = open(f"{tmp}/kv-{port}.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "kvstore", "serve", "--bind", f"{NETNS_ADDRESS} 127.0.0.1",
                             "--port", str(port), "--dram-size", "8mb", *flags], stdout=log, stderr=log)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, port
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(open(f"{tmp}/kv-{port}.log").read())


def _first_reply(host: str, port: int, request: bytes) -> str:
    """What the node answers ``request`` with, and whether it then closed the connection."""
    with socket.create_connection((host, port), timeout=5) as sock:
        sock.sendall(request)
        data = b""
        while not data.endswith(b"\r\n"):
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                chunk = b""
            if not chunk:
                return data.decode() + "<closed>"
            data += chunk
        sock.settimeout(0.5)
        try:
            closed = sock.recv(1) == b""
        except ConnectionResetError:        # closed with our request unread
            closed = True
        except socket.timeout:
            closed = False
        return data.decode() + ("<closed>" if closed else "")


def _in_namespace(tmp: str) -> None:
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    subprocess.run(["ip", "addr", "add", f"{NETNS_ADDRESS}/32", "dev", "lo"], check=True)
    seen = {}
    proc, port = _start(tmp)
    try:
        seen["default"] = _first_reply(NETNS_ADDRESS, port, b"PING\r\n")
        seen["loopback"] = _first_reply("127.0.0.1", port, b"PING\r\n")
        with socket.create_connection(("127.0.0.1", port)) as admin:
            admin.sendall(b"INFO stats\r\n")
            time.sleep(0.2)
            stats = admin.recv(65536).decode()
            seen["rejected"] = int(stats.split("rejected_connections:")[1].split("\r\n")[0])
            admin.sendall(b"CONFIG SET protected-mode no\r\n")
            admin.recv(100)
        seen["config-set-no"] = _first_reply(NETNS_ADDRESS, port, b"PING\r\n")
    finally:
        proc.terminate()
        proc.wait()
    for name, flags in (("requirepass", ("--requirepass", "pw")), ("protected-mode-no", ("--protected-mode", "no"))):
        proc, port = _start(tmp, *flags)
        try:
            seen[name] = _first_reply(NETNS_ADDRESS, port, b"PING\r\n")
        finally:
            proc.terminate()
            proc.wait()
    print(json.dumps(seen))


if __name__ == "__main__":
    _in_namespace(sys.argv[1])
