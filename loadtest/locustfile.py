"""locust users for kvstore: inference engines on the conversation trace, and a Redis GET/SET mix.

    locust -f loadtest/locustfile.py --headless -u 200 -r 50 -t 60s --host 127.0.0.1:6380 KVCacheUser
    locust -f loadtest/locustfile.py --headless ... --host H1:P1,H2:P2,H3:P3      (a cluster)
    locust -f loadtest/locustfile.py --headless ... --cluster etcd://HOST:PORT/NAME
    locust -f loadtest/locustfile.py --headless ... --host 127.0.0.1:6379 RedisUser   (the same mix on Redis)

- `KVCacheUser` is an engine on the SDK (`loadtest.kv_workload`): per trace
  request one ``match_prefix`` (KV.MATCH), a ``batch_get`` of the cached
  prefix, a ``batch_put`` of the missing blocks with their parents. Values are
  sealed (`loadtest.sealed`): a read that does not verify is a failure.
- `RedisUser` is redis-py: GET and SET of sealed values of 4 KiB-4 MiB
  (log-uniform) over a fixed key space; a GET that does not verify fails.

Each operation is a locust request of its own name (``bytes`` in its
response_length). At the end the run prints p50/p99 per operation at 1 %
resolution (`loadtest.op_stats`) and MB/s.

gevent: locust monkey-patches the standard library before this file is
imported, so the SDK's blocking transport runs cooperatively: its sockets'
``sendmsg``/``recv_into``/``recvmsg_into`` are gevent's, its pool's locks and
conditions are gevent's, and `KVClusterClient`'s ThreadPoolExecutor starts
greenlets and waits on gevent's queue. The fast path is off by default
(``--kv-fast-path auto`` turns it on): under gevent its check that the node
that granted a held lease is still alive (poll for POLLRDHUP) never fires,
since gevent's poll only knows POLLIN and POLLOUT.
"""
from __future__ import annotations

import math
import random
import time
from typing import Any

import gevent
import redis
from locust import User, constant, events, task
from locust.runners import WorkerRunner

from loadtest.kv_workload import KVCacheEngine, TraceCursor, WrongValue, default_trace, load_trace
from loadtest.op_stats import OpStats
from loadtest.sealed import PayloadPool, verify
from loadtest.targets import Target, kv_client, parse_target, redis_client


class Shared:
    """What every user of this process reads: made once when locust starts."""

    target: Target
    cursor: TraceCursor
    kv_pool: PayloadPool
    redis_pool: PayloadPool
    stats = OpStats()


@events.init_command_line_parser.add_listener
def _options(parser: Any) -> None:
    parser.add_argument("--cluster", metavar="etcd://HOST:PORT/NAME", default="",
                        help="load the cluster registered in this etcd (instead of --host)")
    parser.add_argument("--kv-trace", default=str(default_trace()), help="Mooncake trace (JSONL) to replay")
    parser.add_argument("--kv-block-bytes", type=int, default=64 << 10, help="bytes of one 512-token KV block")
    parser.add_argument("--kv-fast-path", choices=("off", "auto"), default="off",
                        help="the SDK's shared-memory path to a node on this host")
    parser.add_argument("--redis-min-bytes", type=int, default=4 << 10)
    parser.add_argument("--redis-max-bytes", type=int, default=4 << 20)
    parser.add_argument("--redis-keys", type=int, default=256, help="key space of the Redis mix")
    parser.add_argument("--redis-get-share", type=float, default=0.5, help="share of GETs in the Redis mix")
    parser.add_argument("--op-timeout", type=float, default=10.0, help="seconds a client waits for a reply")


@events.init.add_listener
def _setup(environment: Any, **_: Any) -> None:
    options = environment.parsed_options
    if options is None:
        return
    Shared.target = parse_target(environment.host or options.host, options.cluster)
    Shared.cursor = TraceCursor(load_trace(options.kv_trace))
    Shared.kv_pool = PayloadPool(options.kv_block_bytes)
    Shared.redis_pool = PayloadPool(options.redis_max_bytes)
    # locust sets its --run-time timer next, on the hub's clock, which has not moved since the hub
    # was made (imports, this set-up): on a slow start a short run would end before it began.
    gevent.get_hub().loop.update_now()


@events.test_start.add_listener
def _started(**_: Any) -> None:
    Shared.stats = OpStats()


@events.quitting.add_listener
def _summary(environment: Any, **_: Any) -> None:
    if isinstance(environment.runner, WorkerRunner) or not Shared.stats.ops:
        return
    print(f"\nkvstore load: p50/p99 per operation ({time.monotonic() - Shared.stats.started:.0f} s)", flush=True)
    print(Shared.stats.markdown(), flush=True)


def fire(user: User, kind: str, name: str, seconds: float, nbytes: int, error: BaseException | None) -> None:
    """Report one operation to locust and to the run's percentiles."""
    user.environment.events.request.fire(request_type=kind, name=name, response_time=seconds * 1e3,
                                         response_length=nbytes, exception=error, context={})
    Shared.stats.record(f"{kind} {name}", seconds, nbytes, error is not None)


class KVCacheUser(User):
    """An inference engine replaying the conversation trace through the SDK."""

    wait_time = constant(0)

    def on_start(self) -> None:
        options = self.environment.parsed_options
        self.kv = kv_client(Shared.target, fast_path=options.kv_fast_path, timeout=options.op_timeout,
                            pool_size=2)
        self.engine = KVCacheEngine(self.kv, Shared.kv_pool, options.kv_block_bytes)

    @task
    def serve_request(self) -> None:
        self.engine.serve(Shared.cursor.next(), lambda *step: fire(self, "kv", *step))

    def on_stop(self) -> None:
        self.kv.close()


class RedisUser(User):
    """GET and SET of sealed values of log-uniform sizes through redis-py."""

    wait_time = constant(0)

    def on_start(self) -> None:
        options = self.environment.parsed_options
        self.client = redis_client(Shared.target, options.op_timeout)
        self.keys, self.get_share = options.redis_keys, options.redis_get_share
        self.low, self.high = math.log(options.redis_min_bytes), math.log(options.redis_max_bytes)

    @task
    def get_or_set(self) -> None:
        key = b"locust:redis:%d" % random.randrange(self.keys)
        if random.random() < self.get_share:
            self._timed("GET", lambda: self._get(key))
        else:
            self._timed("SET", lambda: self._set(key))

    def _get(self, key: bytes) -> int:
        value = self.client.get(key)
        if not verify(key, value):
            raise WrongValue(1, len(value), [key.decode()])
        return len(value or b"")

    def _set(self, key: bytes) -> int:
        size = int(math.exp(random.uniform(self.low, self.high)))
        value = Shared.redis_pool.sealed(key, size, random.randrange(1 << 30))
        self.client.set(key, value)
        return len(value)

    def _timed(self, name: str, run: Any) -> None:
        start = time.perf_counter()
        try:
            nbytes, error = run(), None
        except (redis.RedisError, WrongValue) as exc:
            nbytes, error = 0, exc
        fire(self, "redis", name, time.perf_counter() - start, nbytes, error)

    def on_stop(self) -> None:
        self.client.close()
