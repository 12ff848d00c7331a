"""TLS as Redis offers it: a second listener whose clients speak RESP inside TLS.

Why the handshake is driven here and not by asyncio's SSL transports: a
connection moves bytes with raw non-blocking sockets (see connection.py), so a
TLS client is the same `Connection` holding an `ssl.SSLSocket`. Accepting one
is two steps: the TCP accept, then a non-blocking handshake stepped on the
event loop (`Handshake`) until it completes, fails, or takes too long; only
then does the socket become a client. A peer that connects and never finishes
the handshake costs one socket for at most ``HANDSHAKE_SECONDS``.

Client certificates follow ``--tls-auth-clients``: ``yes`` requires one signed
by ``--tls-ca-cert-file``, ``optional`` verifies one when offered, ``no``
asks for none. Node-to-node traffic uses `client_context`: the node's own
certificate as its client certificate and the same CA for the peer's, without
host-name checks (nodes are addressed by IP, as in Redis Cluster).
"""
from __future__ import annotations

import logging
import ssl
from typing import Callable

log = logging.getLogger("kvstore")

HANDSHAKE_SECONDS = 10.0
CLIENT_CERTS = {"yes": ssl.CERT_REQUIRED, "optional": ssl.CERT_OPTIONAL, "no": ssl.CERT_NONE}


def server_context(cfg) -> ssl.SSLContext:
    """The listener's context from the node's tls-* settings; ssl.SSLError/OSError when
    a file is missing or does not hold what it should."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cfg.tls_cert_file, cfg.tls_key_file)
    if cfg.tls_ca_cert_file:
        ctx.load_verify_locations(cafile=cfg.tls_ca_cert_file)
    ctx.verify_mode = CLIENT_CERTS[cfg.tls_auth_clients]
    return ctx


def client_context(cfg) -> ssl.SSLContext:
    """A context for this node's connections to other nodes of its cluster."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.check_hostname = False
    ctx.load_cert_chain(cfg.tls_cert_file, cfg.tls_key_file)
    if cfg.tls_ca_cert_file:
        ctx.load_verify_locations(cafile=cfg.tls_ca_cert_file)
    return ctx


class Handshake:
    """A server-side handshake in progress: ``admit(tls_socket)`` runs once it completes."""

    def __init__(self, loop, sock, context: ssl.SSLContext, admit: Callable):
        self.loop = loop
        self.sock = context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        self.fd = self.sock.fileno()
        self.admit = admit
        self.timer = loop.call_later(HANDSHAKE_SECONDS, self._give_up, "no handshake in time")
        self.waiting_for: str | None = None        # "read" or "write" while registered with the loop
        self._step()

    def _step(self) -> None:
        try:
            self.sock.do_handshake()
        except ssl.SSLWantReadError:
            self._wait("read")
            return
        except ssl.SSLWantWriteError:
            self._wait("write")
            return
        except OSError as exc:              # ssl.SSLError included: a bad or missing certificate
            self._give_up(exc)
            return
        self._stop_waiting()
        self.timer.cancel()
        self.admit(self.sock)

    def _wait(self, event: str) -> None:
        if self.waiting_for != event:
            self._stop_waiting()
            (self.loop.add_reader if event == "read" else self.loop.add_writer)(self.fd, self._step)
            self.waiting_for = event

    def _stop_waiting(self) -> None:
        """Unregister before the socket closes or becomes a client: a closed fd left registered
        would shadow the next socket that gets its number."""
        if self.waiting_for == "read":
            self.loop.remove_reader(self.fd)
        elif self.waiting_for == "write":
            self.loop.remove_writer(self.fd)
        self.waiting_for = None

    def _give_up(self, why) -> None:
        log.debug("TLS handshake with a client failed: %s", why)
        self._stop_waiting()
        self.timer.cancel()
        self.sock.close()
