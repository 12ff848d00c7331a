"""A minimal cluster reader for tests, on plain redis-py connections (one per node).

It follows MOVED (remembering the slot's owner) and ASK (ASKING then the
command, once) as a cluster-aware client does, and reads hot-block copies on
READONLY connections, so tests check the store's answers rather than a
client library's handling of them (redis-py's RedisCluster fails on an ASK to
a node it has not discovered yet).
"""
from __future__ import annotations

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvstore.cluster.slots import keyslot

HOPS = 5


def connect(addr: str, readonly: bool = False, timeout: float = 5.0) -> redis.Redis:
    host, port = addr.rsplit(":", 1)
    conn = redis.Redis(host=host, port=int(port), socket_timeout=timeout, socket_connect_timeout=timeout,
                       single_connection_client=True, retry=Retry(NoBackoff(), 0))   # every error shows
    if readonly:
        conn.execute_command("READONLY")
    return conn


class SlotReader:
    """GET across a cluster from its node addresses, following redirections."""

    def __init__(self, addrs: list[str], timeout: float = 5.0):
        self.timeout = timeout
        self.start = addrs[0]
        self.owners: dict[int, str] = {}
        self._conns: dict[tuple[str, bool], redis.Redis] = {}

    def conn(self, addr: str, readonly: bool = False) -> redis.Redis:
        found = self._conns.get((addr, readonly))
        if found is None:
            found = self._conns[addr, readonly] = connect(addr, readonly, self.timeout)
        return found

    def forget(self, addr: str) -> None:
        """Drop the connections to ``addr`` (after an error: the next use reconnects)."""
        for readonly in (False, True):
            conn = self._conns.pop((addr, readonly), None)
            if conn is not None:
                conn.close()

    def get(self, key: bytes, addr: str | None = None, readonly: bool = False) -> bytes | None:
        """The value of ``key``, asked first at ``addr`` (default: the slot's known owner)."""
        slot = keyslot(key)
        addr = addr or self.owners.get(slot, self.start)
        for _ in range(HOPS):
            try:
                return self.conn(addr, readonly).get(key)
            except redis.exceptions.MovedError as e:
                addr = self.owners[slot] = "%s:%s" % e.node_addr
                readonly = False
            except redis.exceptions.AskError as e:
                pipe = self.conn("%s:%s" % e.node_addr).pipeline(transaction=False)
                pipe.execute_command("ASKING")
                pipe.get(key)
                return pipe.execute()[1]
        raise AssertionError(f"more than {HOPS} redirections for {key!r}")
