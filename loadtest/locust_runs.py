"""The documented locust runs, each against servers it starts: one node, then a 3-node cluster.

    python -m loadtest.locust_runs [--users 200] [--seconds 60] [--user-class KVCacheUser]

Each run is ``locust -f loadtest/locustfile.py --headless`` with the given
users (spawned at 50 a second) for the given time, first against one
``kvstore serve`` (1 GB of DRAM), then against ``kvstore cluster up --nodes 3``
(1 GB each) through ``--cluster etcd://...``. It prints, for each, the
p50/p99 and MB/s per operation that the locustfile prints at the end, and
the failures. The exit code is 1 when any run had a failure.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from loadtest.cluster_up import ClusterUp
from loadtest.procs import ProcessGroup, start_kvstore
from loadtest.report import log, machine_info

ROOT = Path(__file__).resolve().parent.parent
MEMORY = "1gb"


def locust(target: list[str], users: int, seconds: int, user_class: str) -> tuple[int, str]:
    """Run locust headless; its exit code and the summary the locustfile printed."""
    command = [sys.executable, "-m", "locust", "-f", "loadtest/locustfile.py", "--headless", "-u", str(users),
               "-r", "50", "-t", f"{seconds}s", "--exit-code-on-error", "1", "--only-summary", *target, user_class]
    log(" ".join(command[2:]))
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=seconds + 120)
    lines = (done.stdout + done.stderr).splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("kvstore load:")), len(lines))
    summary = [line for line in lines[start:] if line.startswith(("kvstore load", "|"))]
    errors = [line for line in lines if "Error report" in line or "occurrences" in line.lower()]
    return done.returncode, "\n".join(summary + errors) or "\n".join(lines[-30:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.locust_runs", description=__doc__.split("\n\n")[0])
    parser.add_argument("--users", type=int, default=200)
    parser.add_argument("--seconds", type=int, default=60)
    parser.add_argument("--user-class", default="KVCacheUser", choices=("KVCacheUser", "RedisUser"))
    args = parser.parse_args(argv)
    info = machine_info()
    print(f"Measured date: {info['date']}, nproc: {info['nproc']}, cpu: {info['cpu']}, "
          f"load average at start: {info['load average at start']}")
    codes = []
    with ProcessGroup() as group:
        node = start_kvstore(group, MEMORY)
        code, summary = locust(["--host", f"{node.host}:{node.port}"], args.users, args.seconds, args.user_class)
        codes.append(code)
        print(f"\none node, {args.users} users x {args.seconds} s, {args.user_class}: exit code {code}\n{summary}")
    with ClusterUp(nodes=3, dram_size=MEMORY) as up:
        code, summary = locust(["--cluster", up.etcd_url], args.users, args.seconds, args.user_class)
        codes.append(code)
        print(f"\n3-node cluster, {args.users} users x {args.seconds} s, {args.user_class}: exit code {code}\n{summary}")
    return 1 if any(codes) else 0


if __name__ == "__main__":
    sys.exit(main())
