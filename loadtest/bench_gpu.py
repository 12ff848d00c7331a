"""The GPU fast path's figure: get_tensor_into from the node's GPU tier against a
device-to-device cudaMemcpy of the same size, measured in the same run.

    python -m loadtest.bench_gpu [--sizes 16mb,64mb,256mb,1gb] [--runs 5] [--repeats 20]

Needs a CUDA GPU, cupy and a CUDA torch (``pip install -e '.[gpu]'``); without
them it says why and exits 2. It starts one node (``--gpu-size`` four times
the largest value, ``--promote-hits 1``), puts one value of each size (its
128-byte tensor header included, so it fills a power-of-two extent), reads
it once so the node moves it to its GPU tier, and then times, for each size:

- get_tensor_into(key, a torch CUDA tensor): KV.LEASEGPU, the 128-byte header
  read from the device, one device-to-device copy out of the node's arena
  mapped over CUDA IPC on the caller's stream, an event wait, KV.RELEASE;
  the call returns with the copy done;
- the reference: ``cudaMemcpy`` device to device of the same data bytes
  between two buffers of this process, then a device synchronize (cudaMemcpy does not wait for a
  device-to-device copy).

A figure is the median over ``--runs`` of the median over ``--repeats`` of one
call's wall time; the ratio is reference time / get_tensor_into time (the
throughput ratio), and the goal is >= 0.8x (each size says whether it meets
it; a read costs one round trip to the node, so small values fall short of a
copy that costs none, and the last line gives the largest size). Every read is
checked to have gone device to device (the client's ``gpu_ipc_reads``), and
the bytes of the last one are compared with what was put.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

from client import KVClient
from loadtest.procs import ProcessGroup, start_kvstore
from proto import fastpath as fp

MIB = 1 << 20
GOAL = 0.8


def median_seconds(call, repeats: int) -> float:
    for _ in range(3):
        call()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def parse_size(text: str) -> int:
    text = text.strip().lower()
    for suffix, unit in (("gb", 1 << 30), ("mb", MIB), ("kb", 1 << 10)):
        if text.endswith(suffix):
            return int(text[:-len(suffix)]) * unit
    return int(text)


def put_on_gpu(kv: KVClient, key: str, value) -> None:
    """Put ``value`` and read it until the node has moved it to its GPU tier (promote-hits 1)."""
    kv.put_tensor(key, value)
    deadline = time.monotonic() + 60
    while kv.locate([key])[0].tier != "gpu":
        if time.monotonic() > deadline:
            raise RuntimeError(f"{key} never moved to the GPU tier (is --gpu-size large enough?)")
        kv.get(key)
        time.sleep(0.05)


def one_size(kv: KVClient, size: int, runs: int, repeats: int) -> dict[str, float]:
    import cupy
    import torch
    key, nbytes = f"bench-{size}", size - fp.HEADER_SIZE      # the stored value (header + data) is `size`
    host = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    put_on_gpu(kv, key, host)
    into = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    source, target = torch.empty_like(into), torch.empty_like(into)
    runtime = cupy.cuda.runtime

    def reference() -> None:
        runtime.memcpy(target.data_ptr(), source.data_ptr(), nbytes, runtime.memcpyDeviceToDevice)
        runtime.deviceSynchronize()

    before = kv.fast_path.stats.gpu_ipc_reads
    gets = [median_seconds(lambda: kv.get_tensor_into(key, into), repeats) for _ in range(runs)]
    copies = [median_seconds(reference, repeats) for _ in range(runs)]
    ipc_reads = kv.fast_path.stats.gpu_ipc_reads - before
    if ipc_reads != runs * (repeats + 3):
        raise RuntimeError(f"only {ipc_reads} of {runs * (repeats + 3)} reads went device to device "
                           f"(fallbacks: {kv.fast_path.stats.gpu_fallbacks})")
    if not torch.equal(into.cpu(), host):
        raise RuntimeError(f"get_tensor_into of {size} bytes returned other bytes than were put")
    kv.delete(key)
    get_s, copy_s = statistics.median(gets), statistics.median(copies)
    return {"size": size, "bytes": nbytes, "get_s": get_s, "copy_s": copy_s, "ratio": copy_s / get_s}


def report(rows: list[dict[str, float]]) -> None:
    print(f"{'size':>9} {'get_tensor_into':>16} {'cudaMemcpy D2D':>15} {'ratio':>7}  goal >= {GOAL}x")
    for row in rows:
        print(f"{row['size'] // MIB:>6} MiB {row['bytes'] / row['get_s'] / 1e9:>11.1f} GB/s "
              f"{row['bytes'] / row['copy_s'] / 1e9:>10.1f} GB/s {row['ratio']:>7.2f}  "
              f"{'met' if row['ratio'] >= GOAL else 'MISSED'}")
    largest = rows[-1]
    verdict = "met" if largest["ratio"] >= GOAL else "MISSED"
    print(f"goal at {largest['size'] // MIB} MiB: {largest['ratio']:.2f}x vs >= {GOAL}x: {verdict}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="16mb,64mb,256mb,1gb")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    from kvstore.tiers.gpu import gpu_available
    usable, reason = gpu_available()
    if not usable:
        print(f"bench_gpu needs a CUDA GPU: {reason}")
        return 2
    sizes = sorted(parse_size(s) for s in args.sizes.split(","))
    gpu_mb, dram_mb = 4 * sizes[-1] // MIB, 3 * sizes[-1] // MIB + 256
    with ProcessGroup() as group:
        sock = str(group.log_dir / "kv.sock")
        start_kvstore(group, f"{dram_mb}mb", "{python} -m kvstore serve --port {port} --dram-size {memory} "
                      f"--unixsocket {sock} --gpu-size {gpu_mb}mb --promote-hits 1")
        with KVClient(unix_socket=sock, fast_path="required", timeout=60) as kv:
            rows = [one_size(kv, size, args.runs, args.repeats) for size in sizes]
    report(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
