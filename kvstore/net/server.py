"""The node: listening sockets, the accept loop, the cron, and shutdown.

One event loop thread owns the engine; connections are callbacks on it (see
connection.py for why raw sockets). A TLS listener's clients are the same
connections once their handshake is done (kvstore/net/tls.py). Before a socket
becomes a client it may be refused, as Redis refuses it: over maxclients, or
by protected mode (a remote client while the default user has no password).
The cron runs Redis's active expiry every 100 ms. Shutdown (SIGTERM, SIGINT
or SHUTDOWN) stops accepting, closes every client and removes the Unix socket
file.
"""
from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import socket
import time
from dataclasses import dataclass, field

from kvstore.admin import acl
from kvstore.admin.config import Config
from kvstore.admin.metrics import serve_metrics
from kvstore.admin.slowlog import SlowLog
from kvstore.cluster.membership import ClusterError
from kvstore.commands.families import build_table
from kvstore.local.layers import BlockTable
from kvstore.local.leases import LeaseTable, claim_arena_identity
from kvstore.local.shared_index import SharedIndex
from kvstore.net import tls
from kvstore.net.connection import Connection
from kvstore.store.companions import Companions
from kvstore.store.engine import Engine
from kvstore.tiers import TierError
from kvstore.tiers.manager import open_tiers

log = logging.getLogger("kvstore")

CRON_SECONDS = 0.1
BACKLOG = 511
# The most one loop turn spends evicting; a write that needs more waits for the next turns
# (Redis's maxmemory-eviction-tenacity at its default spends about 0.5 ms; Python evicts slower).
EVICTION_SLICE_S = 0.002


class CommandStats(dict):
    """INFO commandstats: command name -> [calls, ns, rejected, failed]; a command's first
    call makes its row, so dispatch counts with two index updates and no call."""

    def __missing__(self, name: str) -> list[int]:
        row = self[name] = [0, 0, 0, 0]
        return row


@dataclass
class ServerStats:
    connections: int = 0
    commands: int = 0
    rejected: int = 0
    output_limit_disconnections: int = 0
    query_limit_disconnections: int = 0
    cmdstats: CommandStats = field(default_factory=CommandStats)


class Server:
    def __init__(self, config: Config, config_file: str | None = None):
        self.config = config
        self.config_file = config_file
        self.commands = build_table()
        self.tls_context = tls.server_context(config) if config.tls_port else None
        self.output_limit = config.output_buffer_limit()
        self.slowlog = SlowLog(config.slowlog_log_slower_than, config.slowlog_max_len)
        self.pause = None       # CLIENT PAUSE in force (kvstore/net/client_pause.py)
        self.engine = Engine(config.dram_size, config.maxmemory_policy)
        self.engine.room.budget = EVICTION_SLICE_S     # eviction per loop turn (kvstore/store/room.py)
        self.engine.companions = Companions(config.evict_companions)
        self.tiers = open_tiers(self.engine, config)     # None without SSD and GPU tiers
        # After the tiers: users' quota rules are checked against the sizes of DRAM and SSD.
        self.users = acl.Users(acl.Catalog.of(self.commands.all_commands()), config.requirepass, self.engine.quotas)
        if config.aclfile:
            self.users.load(config.aclfile)
        self.clients: dict[int, Connection] = {}
        self.stats = ServerStats()
        self.listeners: list[socket.socket] = []
        self.loop: asyncio.AbstractEventLoop | None = None
        self.loop_name = "asyncio"
        self.started_at = 0.0
        self.replid = os.urandom(20).hex()      # INFO replication's master_replid
        self._next_id = 1
        self._stopped: asyncio.Future | None = None
        self._cron_jobs: list = []          # (callable) run every CRON_SECONDS
        # What local clients hold: leases, reservations, blocks written layer by layer.
        self.leases = LeaseTable(self.engine)
        self.blocks = BlockTable(self.engine)
        self.shared_index = SharedIndex(self.engine)     # published at the first KV.ARENA
        self._arena_identity: tuple[int, bytes] | None = None
        self.cluster = None            # kvstore.cluster.node.ClusterState in cluster mode
        self.cluster_services = None   # kvstore.cluster.services.ClusterServices: hot copies, slot moves
        self.engine.drop_listeners.append(self.leases.on_drop)
        self.add_cron(self.leases.expire)
        self.add_cron(self.blocks.reclaim)

    @property
    def arena_identity(self) -> tuple[int, bytes]:
        """(offset, token) proving a client's mapping is of this arena; claimed when the
        first local client asks, so a node nobody maps spends nothing on it."""
        if self._arena_identity is None:
            self._arena_identity = claim_arena_identity(self.engine)
        return self._arena_identity

    # ------------------------------------------------------------ lifecycle

    async def serve(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.loop_name = "uvloop" if type(self.loop).__module__.startswith("uvloop") else "epoll"
        self.started_at = time.time()
        self._stopped = self.loop.create_future()
        self._listen()
        if self.config.cluster:
            await self._join_cluster()
        for sig in (signal.SIGTERM, signal.SIGINT):
            self.loop.add_signal_handler(sig, self.request_shutdown, f"Received {signal.Signals(sig).name}")
        self.loop.call_later(CRON_SECONDS, self._cron)
        if self.tiers is not None:
            self.add_cron(self.tiers.cron)
            self.loop.create_task(self.tiers.load_index())
        if self.config.metrics_port:
            await serve_metrics(self, self.config.bind.split()[0], self.config.metrics_port)
        # What exists now lives as long as the node: the index, the entry columns, the command
        # table, the modules. Left to the collector, each full collection walks them (75 ms with
        # 200,000 keys on a 2-core host), inside some loop turn; frozen, it walks only what came later.
        gc.freeze()
        log.info("Ready to accept connections (dram %d bytes, prefault %.2fs, %s)",
                 self.config.dram_size, self.engine.arena.prefault_seconds, self.loop_name)
        await self._stopped
        if self.cluster is not None:
            await self.cluster_services.drain()     # our slots and their hottest values go to the others
            await self.cluster.stop()       # a clean leave: the leader moves our slots at once
            self.cluster_services.close()
        self._close()

    def cluster_tls_context(self):
        """The context this node reaches other nodes with, when the cluster speaks TLS."""
        return tls.client_context(self.config) if self.config.tls_cluster == "yes" else None

    async def _join_cluster(self) -> None:
        """Register in etcd and take this node's share of the slots (kvstore/cluster/)."""
        from kvstore.cluster.runner import announce_address, start_cluster
        port = self.tls_port_bound if self.config.tls_cluster == "yes" else self.listeners[0].getsockname()[1]
        announce = announce_address(self.config.bind, port, self.config.announce)
        self.cluster = await start_cluster(self.config.cluster, announce, self.config.cluster_node_timeout)
        from kvstore.cluster.services import ClusterServices
        self.cluster_services = ClusterServices(self, self.cluster)

    def _listen(self) -> None:
        cfg = self.config
        self._listen_tcp(cfg.port, tls=False)
        if cfg.unixsocket:
            if os.path.exists(cfg.unixsocket):
                os.unlink(cfg.unixsocket)
            lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            lsock.bind(cfg.unixsocket)
            self._add_listener(lsock, tcp=False, tls=False)
            log.info("Listening on unix socket %s", cfg.unixsocket)
        if cfg.tls_port:
            self._listen_tcp(cfg.tls_port, tls=True)

    def _listen_tcp(self, port: int, tls: bool) -> None:
        for addr in self.config.bind.split():
            family = socket.AF_INET6 if ":" in addr else socket.AF_INET
            lsock = socket.socket(family, socket.SOCK_STREAM)
            lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            lsock.bind((addr, port))
            self._add_listener(lsock, tcp=True, tls=tls)
            if tls:
                self.tls_port_bound = lsock.getsockname()[1]
            log.info("Listening on %s:%d%s", addr, lsock.getsockname()[1], " (TLS)" if tls else "")

    def _add_listener(self, lsock: socket.socket, tcp: bool, tls: bool) -> None:
        lsock.listen(BACKLOG)
        lsock.setblocking(False)
        self.listeners.append(lsock)
        self.loop.add_reader(lsock.fileno(), self._accept, lsock, tcp, tls)

    def _accept(self, lsock: socket.socket, tcp: bool, tls_on: bool) -> None:
        for _ in range(64):
            try:
                sock, _ = lsock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                log.warning("accept failed: %s", exc)
                return
            self.stats.connections += 1
            sock.setblocking(False)
            if tcp:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if tls_on:
                tls.Handshake(self.loop, sock, self.tls_context, self._admit)
            else:
                self._admit(sock)

    def _admit(self, sock: socket.socket) -> None:
        """Make ``sock`` a client, unless maxclients or protected mode refuses it (Redis's errors)."""
        try:
            peer = _peer_host(sock)
        except OSError:             # gone already
            sock.close()
            return
        if len(self.clients) >= self.config.maxclients:
            refusal = b"-ERR max number of clients reached\r\n"
        elif self.config.protected_mode == "yes" and acl.protected_mode_refuses(self.users.default, peer):
            refusal = acl.DENIED
        else:
            conn = Connection(self, sock, self._next_id)
            self._next_id += 1
            self.clients[conn.id] = conn
            self.loop.add_reader(conn.fd, conn.on_readable)
            return
        self.stats.rejected += 1
        try:
            sock.send(refusal)
        except OSError:
            pass                # the refusal is a courtesy; the close is what matters
        finally:
            sock.close()

    def forget(self, conn: Connection) -> None:
        self.clients.pop(conn.id, None)

    def add_cron(self, job) -> None:
        """Run ``job()`` on the loop every CRON_SECONDS (lease expiry, watermarks...)."""
        self._cron_jobs.append(job)

    def _cron(self) -> None:
        try:
            self.engine.pins.expire()
            while self.engine.expiry.cycle() >= 5:    # many expired: keep going, as Redis does
                pass
            for job in self._cron_jobs:
                try:
                    job()
                except Exception:
                    log.exception("cron job %r failed", job)
        finally:
            if not self._stopped.done():
                self.loop.call_later(CRON_SECONDS, self._cron)

    def request_shutdown(self, reason: str) -> None:
        log.info("%s, shutting down", reason)
        if self._stopped is not None and not self._stopped.done():
            self._stopped.set_result(None)

    def _close(self) -> None:
        for lsock in self.listeners:
            self.loop.remove_reader(lsock.fileno())
            lsock.close()
        for conn in list(self.clients.values()):
            conn.flush()
            conn.close()
        if self.config.unixsocket and os.path.exists(self.config.unixsocket):
            os.unlink(self.config.unixsocket)
        log.info("Bye")

    # ------------------------------------------------------------ config

    def reset_stats(self) -> None:
        self.stats = ServerStats()
        self.engine.stats.__init__()

    def close(self) -> None:
        if self.tiers is not None:
            self.tiers.close()
        self.engine.close()


def _peer_host(sock: socket.socket) -> str | None:
    """The client's address (None over the Unix socket)."""
    return None if sock.family == socket.AF_UNIX else sock.getpeername()[0]


def run(config: Config, config_file: str | None = None) -> int:
    """Run a node until it is asked to stop; returns the process exit code."""
    try:
        import uvloop
        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    try:
        server = Server(config, config_file)
    except (TierError, OSError, acl.AclFileError) as exc:   # no tier, no arena, a bad certificate or ACL file
        log.error("Could not start: %s", exc)
        return 1
    try:
        runner(server.serve())
    except (OSError, ClusterError) as exc:
        log.error("Could not start: %s", exc)
        return 1
    finally:
        server.close()
    return 0
