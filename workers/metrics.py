"""The gateway's Prometheus metrics: request outcomes, TTFT and TBT histograms, prefix tokens reused.

Written out in the text exposition format by hand: a handful of counters and
two histograms do not need a client library, and the gateway stays free of one.
"""
from __future__ import annotations

import bisect
import threading

TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TBT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class Histogram:
    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...]):
        self.name, self.help, self.buckets = name, help_text, buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        running = 0
        for bound, count in zip((*self.buckets, float("inf")), self.counts):
            running += count
            le = "+Inf" if bound == float("inf") else repr(bound)
            lines.append(f'{self.name}_bucket{{le="{le}"}} {running}')
        lines += [f"{self.name}_sum {self.sum}", f"{self.name}_count {running}"]
        return lines


class GatewayMetrics:
    def __init__(self):
        self.lock = threading.Lock()
        self.requests: dict[str, int] = {}
        self.ttft = Histogram("kvstore_gateway_ttft_seconds", "Time to first token.", TTFT_BUCKETS)
        self.tbt = Histogram("kvstore_gateway_tbt_seconds", "Time between tokens.", TBT_BUCKETS)
        self.counters = {"prompt_tokens": 0, "completion_tokens": 0, "prefix_tokens_reused": 0}

    def count_request(self, status: int) -> None:
        with self.lock:
            self.requests[str(status)] = self.requests.get(str(status), 0) + 1

    def add(self, name: str, value: int) -> None:
        with self.lock:
            self.counters[name] += value

    def observe_ttft(self, seconds: float) -> None:
        with self.lock:
            self.ttft.observe(seconds)

    def observe_tbt(self, seconds: float) -> None:
        with self.lock:
            self.tbt.observe(seconds)

    def render(self) -> str:
        with self.lock:
            lines = ["# HELP kvstore_gateway_requests_total Completion requests by HTTP status.",
                     "# TYPE kvstore_gateway_requests_total counter"]
            lines += [f'kvstore_gateway_requests_total{{status="{s}"}} {n}' for s, n in sorted(self.requests.items())]
            for name, value in self.counters.items():
                lines += [f"# TYPE kvstore_gateway_{name}_total counter", f"kvstore_gateway_{name}_total {value}"]
            lines += self.ttft.render() + self.tbt.render()
        return "\n".join(lines) + "\n"
