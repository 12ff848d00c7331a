"""Fast-path figures: each one a ratio against a reference measured in the same run.

    python -m loadtest.bench_fastpath [--runs 5]

- get_into of 1 MiB and 4 MiB through the arena vs numpy copyto of the same
  size (target >= 0.7x) and vs redis-py GET from a real redis-server (>= 3x),
  twice: *cold*, a get of a key whose lease the client does not hold (a
  client that keeps no lease: KV.LEASE round trip + copy + validity check,
  the release riding on the next request), and *warm*, a repeated get of a
  key whose lease the client holds (copy + validity check, no round trip);
- put through the arena vs copyto (>= 0.5x): repeated puts of one size, so
  each is a copy into a spare reserved by the previous put plus one round
  trip (KV.PUBLISH and the next KV.RESERVE);
- batch_get_into of 256 x 1 MiB vs 256 back-to-back copytos from 256 distinct
  buffers (time within 1.5x);
- layer-wise: a writer process puts 32 layers while this process reads them
  one by one: time to the first layer vs time to the whole block.

Every figure is the median over ``--runs`` runs of a median over repeats.
The store gets a Unix socket and a 1 GiB arena; both servers run on this host.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from client import KVClient
from loadtest.procs import ProcessGroup, start_kvstore, start_redis

MIB = 1 << 20
REPEATS = 200
LAYERS = 32
ROOT = str(Path(__file__).resolve().parents[1])

WRITER = """
import sys, time, numpy as np
from client import KVClient
kv = KVClient(unix_socket=sys.argv[1])
layer = np.ones({size}, np.uint8)
kv.fast_path.arena()                      # map the arena before the clock starts
print("ready", flush=True)
sys.stdin.readline()
for i in range({layers}):
    kv.put_layer(sys.argv[2], i, layer, n_layers={layers})
"""


def median_seconds(fn, repeats: int = REPEATS) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def one_run(kv: KVClient, cold: KVClient, redis_client, sock: str, run: int) -> dict[str, float]:
    out = {}
    for size in (MIB, 4 * MIB):
        name = f"{size // MIB}MiB"
        src, dst = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8), np.empty(size, np.uint8)
        copy = median_seconds(lambda: np.copyto(dst, src))
        kv.put(f"g{size}", src, overwrite=True)
        redis_client.set(f"g{size}", src.tobytes())
        cold_get = median_seconds(lambda: cold.get_into(f"g{size}", dst))
        warm_get = median_seconds(lambda: kv.get_into(f"g{size}", dst))
        redis_get = median_seconds(lambda: redis_client.get(f"g{size}"), REPEATS // 4)
        fast_put = median_seconds(lambda: kv.put(f"p{size}", src, overwrite=True))
        out[f"get_into {name} cold vs copyto"] = copy / cold_get
        out[f"get_into {name} warm vs copyto"] = copy / warm_get
        out[f"get_into {name} cold vs redis-py GET"] = redis_get / cold_get
        out[f"put {name} vs copyto"] = copy / fast_put
        out[f"copyto {name} us"] = copy * 1e6
        out[f"get_into {name} cold us"] = cold_get * 1e6
        out[f"get_into {name} warm us"] = warm_get * 1e6
        out[f"put {name} us"] = fast_put * 1e6
    out.update(batch(kv))
    out.update(layerwise(kv, sock, run))
    return out


def batch(kv: KVClient) -> dict[str, float]:
    keys = [f"b{i}" for i in range(256)]
    sources = [np.full(MIB, i % 256, np.uint8) for i in range(256)]
    kv.batch_put(zip(keys, sources), overwrite=True)
    into = np.empty((256, MIB), np.uint8)
    rows = list(into)

    def memcpys() -> None:
        for row, src in zip(rows, sources):
            np.copyto(row, src)
    reference = median_seconds(memcpys, 10)
    fast = median_seconds(lambda: kv.batch_get_into(keys, rows), 10)
    return {"batch_get_into 256x1MiB time / 256 memcpys": fast / reference}


def layerwise(kv: KVClient, sock: str, run: int) -> dict[str, float]:
    key = f"layered-{run}"
    writer = subprocess.Popen([sys.executable, "-c", WRITER.format(size=MIB, layers=LAYERS), sock, key],
                              cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    writer.stdout.readline()
    into = np.empty((LAYERS, MIB), np.uint8)
    start = time.perf_counter()
    writer.stdin.write("go\n")
    writer.stdin.flush()
    kv.get_layers(key, 0, 1, into=into[0], wait=4)
    first = time.perf_counter() - start
    for layer in range(1, LAYERS):
        kv.get_layers(key, layer, layer + 1, into=into[layer], wait=4)
    whole = time.perf_counter() - start
    writer.wait(30)
    return {"layer-wise first layer ms": first * 1e3, "layer-wise whole block ms": whole * 1e3,
            "layer-wise first / whole": first / whole}


TARGETS = {"get_into 1MiB cold vs copyto": (">=", 0.7), "get_into 4MiB cold vs copyto": (">=", 0.7),
           "get_into 1MiB warm vs copyto": (">=", 0.7), "get_into 4MiB warm vs copyto": (">=", 0.7),
           "get_into 1MiB cold vs redis-py GET": (">=", 3.0), "get_into 4MiB cold vs redis-py GET": (">=", 3.0),
           "put 1MiB vs copyto": (">=", 0.5), "put 4MiB vs copyto": (">=", 0.5),
           "batch_get_into 256x1MiB time / 256 memcpys": ("<=", 1.5)}


def main(argv: list[str] | None = None) -> int:
    import redis
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args(argv)
    with ProcessGroup() as group:
        sock = str(group.log_dir / "kv.sock")
        start_kvstore(group, "1gb", "{python} -m kvstore serve --port {port} --dram-size {memory} "
                      f"--unixsocket {sock}")
        reference = start_redis(group, "1gb")
        kv = KVClient(unix_socket=sock, fast_path="required", timeout=30)
        cold = KVClient(unix_socket=sock, fast_path="required", timeout=30)
        cold.fast_path.cache_entries = 0                  # keeps no lease: every get is a first get
        redis_client = redis.Redis(reference.host, reference.port)
        runs = [one_run(kv, cold, redis_client, sock, run) for run in range(args.runs)]
        kv.close()
        cold.close()
    print(f"{'figure':48} {'median':>9}  target")
    for name in runs[0]:
        value = statistics.median(r[name] for r in runs)
        op, bound = TARGETS.get(name, ("", None))
        verdict = "" if bound is None else f"{op} {bound}  " + ("met" if (value >= bound if op == ">=" else value <= bound)
                                                             else "MISSED")
        print(f"{name:48} {value:9.2f}  {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
