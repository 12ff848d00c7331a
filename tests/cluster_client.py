"""A minimal cluster reader for tests, on plain redis-py connections (one per node).

It follows MOVED (remembering the slot's owner) and ASK (ASKING then the
command, once; a MOVED answer to that is followed too) as a cluster-aware
client does, up to redis-py's 16 redirections, and reads hot-block copies on
READONLY connections, so tests check the store's answers rather than a
client library's handling of them (redis-py's RedisCluster fails on an ASK to
a node it has not discovered yet).
"""
from __future__ import annotations

import time

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvstore.cluster.slots import keyslot

HOPS = 16               # redirections one request follows: redis-py's RedisCluster.RedisClusterRequestTTL
PATIENT_AFTER = HOPS // 2   # ... after which it waits HOP_WAIT_S between hops: two nodes a map apart
HOP_WAIT_S = 0.05           # (one still on the step map, one on the final) send a key back and forth
                            # until the late one's watch delivers the map, as redis-py waits on TRYAGAIN


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
        for hop in range(HOPS):
            if hop >= PATIENT_AFTER:
                time.sleep(HOP_WAIT_S)
            try:
                return self.conn(addr, readonly).get(key)
            except redis.exceptions.MovedError as e:
                addr = self.owners[slot] = "%s:%s" % e.node_addr
                readonly = False
            except redis.exceptions.AskError as e:
                pipe = self.conn("%s:%s" % e.node_addr).pipeline(transaction=False)
                pipe.execute_command("ASKING")
                pipe.get(key)
                try:
                    return pipe.execute()[1]
                except redis.exceptions.MovedError as moved:    # the target has a newer map: follow it
                    addr = self.owners[slot] = "%s:%s" % moved.node_addr
                    readonly = False
        raise AssertionError(f"more than {HOPS} redirections for {key!r}")
