"""A real cluster for tests and benchmarks: `kvstore cluster up` (a throwaway etcd and N node processes).

`ClusterUp` starts it, reads the JSON line it prints first, and stops it with
SIGTERM (the nodes leave cleanly, then etcd stops); the logs it wrote are
removed then, unless the cluster or the code using it failed.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class ClusterUp:
    nodes: int = 3
    dram_size: str = "64mb"
    extra: tuple[str, ...] = ()

    def __enter__(self) -> "ClusterUp":
        args = [sys.executable, "-m", "kvstore", "cluster", "up", "--nodes", str(self.nodes),
                "--dram-size", self.dram_size, *self.extra]
        self.proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(10)
            raise RuntimeError("cluster up failed: " + self.proc.stderr.read())
        self.info = json.loads(line)
        return self

    @property
    def addrs(self) -> list[tuple[str, int]]:
        return [(host, int(port)) for host, port in (n["addr"].rsplit(":", 1) for n in self.info["nodes"])]

    @property
    def etcd_url(self) -> str:
        return self.info["etcd"]

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        logs = re.search(r"logs in (\S+)\)", self.proc.stderr.read())
        if logs and exc[0] is None and self.proc.returncode == 0:
            shutil.rmtree(logs.group(1), ignore_errors=True)    # kept when something went wrong
