"""loadtest/procs.py's server start: a real `kvstore serve` told first to use a port a socket of this test
holds starts again on a fresh port instead of failing the benchmark."""
from __future__ import annotations

import socket

from loadtest import procs


def test_a_server_whose_port_is_taken_starts_again_on_a_fresh_one(monkeypatch):
    with socket.socket() as holder, procs.ProcessGroup() as group:
        holder.bind((procs.HOST, 0))
        holder.listen()
        held = holder.getsockname()[1]
        picks = iter([held])
        monkeypatch.setattr(procs, "free_port", lambda: next(picks, None) or procs.free_ports(1)[0])
        server = procs.start_kvstore(group, "16mb")
        assert server.port != held and server.process.popen.poll() is None
        assert len(group.processes) == 1            # the failed start was stopped and forgotten
