"""Free TCP ports for the processes a launcher starts on this machine (nodes, etcd, benchmark servers).

A port is found by binding port 0 and reading what the kernel chose. Asking
for one port at a time and closing the probe each time lets the kernel hand
the same port out twice, so two nodes of one start (or etcd's client and peer
ports) could be told to listen on one port. `free_ports` keeps every probe
open until it has them all, so the ports it returns are distinct.

They are free only when returned: another process may bind one (or use it
as the local end of an outgoing connection) before ours listens on it. A
launcher therefore treats "address already in use" as a reason to start that
process again on a fresh port (`port_was_taken` reads it from the process's
log), a bounded number of times.
"""
from __future__ import annotations

import socket
from contextlib import ExitStack

HOST = "127.0.0.1"
MAX_PORTS = 1024        # one start never needs more; a bigger request is a bug, not a cluster


def free_ports(count: int, host: str = HOST) -> list[int]:
    """``count`` distinct TCP ports on ``host`` that nothing listens on right now."""
    if not 0 < count <= MAX_PORTS:
        raise ValueError(f"ask for 1 to {MAX_PORTS} ports, not {count}")
    with ExitStack() as probes:
        ports = []
        for _ in range(count):
            probe = probes.enter_context(socket.socket())
            probe.bind((host, 0))
            ports.append(probe.getsockname()[1])
        return ports


def free_port(host: str = HOST) -> int:
    """One TCP port on ``host`` that nothing listens on right now."""
    return free_ports(1, host)[0]


def port_was_taken(log_text: str) -> bool:
    """Whether a process's log says it could not listen because its port was in use (EADDRINUSE)."""
    return "address already in use" in log_text.lower()
