"""Replaying a slice of the Mooncake conversation trace through a live `kvstore llm up` deployment.

The slice keeps whole conversations: the first multi-turn conversations of
the trace with all their turns, in trace order (a request continues the
conversation that first used its second hash id). A plain window of 200
consecutive requests spans about a minute and holds almost no second turns
(at most 10 % of its blocks are prefix hits, against 37 % over the whole
trace), so it could not show what reuse is worth. The slice's own arrival
times are front-loaded (a third of it in the first minute, then hours of
stragglers), so requests are sent in trace order as a Poisson process at a
fixed rate (seeded): a steady load at which a policy's choices show.

The trace's requests are too long for a CPU model, so lengths are scaled:
each 512-token block (`hash_id`) becomes `TOKENS_PER_HASH` token ids drawn
from a generator seeded by the hash id, so two requests that share hash ids
share exactly those tokens. The store and conductor cut prompts into blocks
of `BLOCK_TOKENS` (a few hash ids each, fewer puts per request); the
simulator gets the same blocks, named by the last hash id in each (the ids are
prefix-chained, so that names the whole prefix). Output lengths scale like
inputs. Each request is a streamed `/v1/completions` sent at its arrival time;
TTFT is the first event, TBT the gaps after.

Runs: a calibration run whose workers' timings fit the conductor's cost model
(the live conductor then prices prefill and decode as this machine runs them);
`random` against `kvcache-centric`; and, at 3x the speed, admission
`baseline` against `predictive`. The simulator, calibrated on the
kvcache-centric run's timings, predicts that run's mean TTFT.
"""
from __future__ import annotations

import argparse
import http.client
import json
import math
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import grpc

from conductor.admission import Slo
from conductor.costmodel import fit_cost_model, read_timings
from conductor.simulator import SimConfig, replay
from conductor.trace import TraceRequest, load_trace
from loadtest.report import Figure, log
from proto import grpc_codegen

TRACE = Path(__file__).resolve().parents[2] / "shared" / "data" / "conversation_trace.jsonl"
TOKENS_PER_HASH = 8
BLOCK_TOKENS = 32
MAX_INPUT = 1024
MAX_OUTPUT = 16
TTFT_SLO_S = 5.0
TBT_SLO_S = 1.5
CALIBRATION_REQUESTS = 40


@dataclass
class LiveRequest:
    arrival_s: float
    prompt: list[int]
    max_tokens: int
    hash_ids: tuple[int, ...]


@dataclass
class Outcome:
    status: int = 0
    ttft_s: float = math.nan
    tbts: list[float] = field(default_factory=list)

    def within(self, slo: Slo) -> bool:
        mean_tbt = statistics.mean(self.tbts) if self.tbts else 0.0
        return self.status == 200 and self.ttft_s <= slo.ttft_s and mean_tbt <= slo.tbt_s


def conversation_slice(trace: list[TraceRequest], requests: int) -> list[TraceRequest]:
    """The first ``requests`` requests of multi-turn conversations, in trace order, from time 0."""
    owner: dict[int, int] = {}
    conversation = []
    for i, r in enumerate(trace):
        c = owner.get(r.hash_ids[1], i) if len(r.hash_ids) > 1 else i
        for h in r.hash_ids:
            owner.setdefault(h, c)
        conversation.append(c)
    turns: dict[int, int] = {}
    for c in conversation:
        turns[c] = turns.get(c, 0) + 1
    chosen, total = set(), 0
    for c in sorted(c for c, n in turns.items() if n > 1):      # by first appearance
        if total >= requests:
            break
        chosen.add(c)
        total += turns[c]
    picked = [r for r, c in zip(trace, conversation) if c in chosen][:requests]
    start = picked[0].arrival_s if picked else 0.0
    return [TraceRequest(r.arrival_s - start, r.input_length, r.output_length, r.hash_ids) for r in picked]


def scaled_slice(requests: int, vocab: int, rate: float) -> tuple[list[LiveRequest], list[TraceRequest]]:
    """The slice, scaled to this model and sent at ``rate`` requests per second; also as the simulator's
    trace (in BLOCK_TOKENS blocks)."""
    live, sim = [], []
    per_block = BLOCK_TOKENS // TOKENS_PER_HASH
    arrivals = random.Random(5)
    arrival_s = 0.0
    for r in conversation_slice(load_trace(TRACE), requests):
        arrival_s += arrivals.expovariate(rate)
        n = max(1, min(MAX_INPUT, math.ceil(r.input_length * TOKENS_PER_HASH / 512)))
        ids = r.hash_ids[:math.ceil(n / TOKENS_PER_HASH)]
        prompt = [t for h in ids for t in _block(h, vocab)][:n]
        out = max(2, min(MAX_OUTPUT, round(r.output_length * TOKENS_PER_HASH / 512)))
        live.append(LiveRequest(arrival_s, prompt, out, ids))
        blocks = tuple(ids[min(i + per_block, len(ids)) - 1] for i in range(0, len(ids), per_block))
        sim.append(TraceRequest(arrival_s, n, out, blocks))
    return live, sim


def _block(hash_id: int, vocab: int) -> list[int]:
    rng = random.Random(hash_id)
    return [rng.randrange(100, vocab - 100) for _ in range(TOKENS_PER_HASH)]


@contextmanager
def deployment(model: str, policy: str, rejection: str, slo: Slo, calibrate: str | None = None) -> Iterator[dict]:
    """`kvstore llm up --prefill 2 --decode 1`; yields its JSON line, stops it afterwards."""
    flags = ["--prefill", "2", "--decode", "1", "--model", model, "--policy", policy, "--rejection", rejection,
             "--port", "0", "--block-tokens", str(BLOCK_TOKENS), "--ttft-slo", str(slo.ttft_s),
             "--tbt-slo", str(slo.tbt_s), "--dram-size", "1gb"]
    with llm_up(flags + (["--calibrate", calibrate] if calibrate else [])) as info:
        yield info


@contextmanager
def llm_up(flags: list[str]) -> Iterator[dict]:
    """`kvstore llm up FLAGS` in its own session; yields its JSON line, stops it (SIGTERM) afterwards."""
    argv = [sys.executable, "-m", "kvstore", "llm", "up", *flags]
    errors = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=errors, text=True, start_new_session=True)
    try:
        line = proc.stdout.readline()
        if not line:
            proc.wait()
            errors.seek(0)
            raise RuntimeError(f"llm up exited with {proc.returncode}: {errors.read()[-2000:]}")
        yield json.loads(line)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def send(gateway: str, req: LiveRequest) -> Outcome:
    host, port = gateway.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=600)
    body = json.dumps({"prompt": req.prompt, "max_tokens": req.max_tokens, "stream": True})
    started = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    reply = conn.getresponse()
    out = Outcome(reply.status)
    if reply.status != 200:
        reply.read()
        return out
    last = None
    while line := reply.readline():
        if not line.startswith(b"data: {"):
            continue
        now = time.perf_counter()
        if last is None:
            out.ttft_s = now - started
        else:
            out.tbts.append(now - last)
        last = now
    return out


def run_slice(gateway: str, requests: list[LiveRequest], speed: float) -> list[Outcome]:
    """Send each request at its arrival time divided by ``speed``; the outcomes in request order."""
    outcomes = [Outcome() for _ in requests]
    start = time.perf_counter()

    def one(i: int) -> None:
        delay = requests[i].arrival_s / speed - (time.perf_counter() - start)
        if delay > 0:
            time.sleep(delay)
        try:
            outcomes[i] = send(gateway, requests[i])
        except OSError as exc:
            log(f"request {i}: {exc}")
            outcomes[i] = Outcome(599)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outcomes


def worker_timings(info: dict) -> list[dict]:
    pb, pb_grpc = grpc_codegen.load("worker")
    rows = []
    for w in info["workers"]:
        with grpc.insecure_channel(w["address"]) as channel:
            rows += json.loads(pb_grpc.WorkerStub(channel).Timings(pb.TimingsRequest(), timeout=10).rows_json)
    return rows


def gateway_counter(gateway: str, name: str) -> float:
    host, port = gateway.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.request("GET", "/metrics")
    for line in conn.getresponse().read().decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def summary(name: str, outcomes: list[Outcome], hit_rate: float) -> dict:
    ok = [o for o in outcomes if o.status == 200]
    ttfts = sorted(o.ttft_s for o in ok)
    tbts = sorted(t for o in ok for t in o.tbts)

    def pct(values: list[float], q: float) -> float:
        return values[min(len(values) - 1, int(q * len(values)))] if values else math.nan

    s = {"run": name, "completed": len(ok), "rejected_429": sum(o.status == 429 for o in outcomes),
         "failed": sorted(o.status for o in outcomes if o.status not in (200, 429)),
         "ttft_mean_s": statistics.mean(ttfts) if ttfts else math.nan, "ttft_p50_s": pct(ttfts, 0.5),
         "ttft_p90_s": pct(ttfts, 0.9), "tbt_p50_s": pct(tbts, 0.5), "tbt_p90_s": pct(tbts, 0.9),
         "prefix_hit_rate": hit_rate}
    log(f"{name}: " + json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in s.items()}))
    return s


def measured_run(model: str, policy: str, rejection: str, slo: Slo, calibrate: str | None,
                 requests: list[LiveRequest], speed: float) -> tuple[dict, list[Outcome], list[dict]]:
    with deployment(model, policy, rejection, slo, calibrate) as info:
        outcomes = run_slice(info["gateway"], requests, speed)
        prompt = gateway_counter(info["gateway"], "kvstore_gateway_prompt_tokens_total")
        reused = gateway_counter(info["gateway"], "kvstore_gateway_prefix_tokens_reused_total")
        timings = worker_timings(info)
    return summary(f"{policy}/{rejection} x{speed:g}", outcomes, reused / prompt if prompt else 0.0), outcomes, timings


def live_figures(args: argparse.Namespace, sections: set[str]) -> list:
    from workers.catalog import load_tokenizer

    tokenizer, _ = load_tokenizer(args.model)
    vocab = len(tokenizer) if hasattr(tokenizer, "__len__") else tokenizer.vocab_size
    requests, sim_trace = scaled_slice(args.requests, vocab, args.rate)
    slo = Slo(TTFT_SLO_S, TBT_SLO_S)
    folder = Path(tempfile.mkdtemp(prefix="bench-serving-"))
    calibration = folder / "calibration.json"
    log(f"calibrating on {CALIBRATION_REQUESTS} requests at {args.rate / 2:g} req/s")
    _, _, rows = measured_run(args.model, "kvcache-centric", "none", slo, None,
                              requests[:CALIBRATION_REQUESTS], 0.5)
    calibration.write_text(json.dumps(rows))
    figures = []
    if "replay" in sections:
        runs = {p: measured_run(args.model, p, "none", slo, str(calibration), requests, 1.0)
                for p in ("random", "kvcache-centric")}
        rnd, kvc = runs["random"][0], runs["kvcache-centric"][0]
        ratio = rnd["ttft_mean_s"] / kvc["ttft_mean_s"]
        figures.append(Figure(f"live mean TTFT random / kvcache-centric ({args.requests} req)", f"{ratio:.2f}x",
                              ">= 1.3x", ratio >= 1.3))
        for s in (rnd, kvc):
            figures.append(Figure(f"  {s['run']}: TTFT p50/p90, TBT p50/p90 (s)",
                                  f"{s['ttft_p50_s']:.2f}/{s['ttft_p90_s']:.2f} {s['tbt_p50_s']:.3f}/"
                                  f"{s['tbt_p90_s']:.3f}", f"hit rate {s['prefix_hit_rate']:.1%}", None))
        fitted = folder / "kvcache-centric.json"
        fitted.write_text(json.dumps(runs["kvcache-centric"][2]))
        cost = fit_cost_model(read_timings(fitted))
        predicted, _ = replay(sim_trace, SimConfig(prefill=2, decode=1, policy="kvcache-centric", speed=1.0,
                                                   slo=slo, block_tokens=BLOCK_TOKENS), cost)
        err = predicted.ttft_mean_s / kvc["ttft_mean_s"]
        figures.append(Figure("simulator (--calibrate) / measured mean TTFT", f"{err:.2f}x "
                              f"({predicted.ttft_mean_s:.2f}/{kvc['ttft_mean_s']:.2f}s)", "0.5-2x", 0.5 <= err <= 2))
    if "rejection" in sections:
        fast = 3.0
        base = measured_run(args.model, "kvcache-centric", "baseline", slo, str(calibration), requests, fast)
        pred = measured_run(args.model, "kvcache-centric", "predictive", slo, str(calibration), requests, fast)
        good = [sum(o.within(slo) for o in run[1]) for run in (base, pred)]
        figures.append(Figure(f"at {fast * args.rate:g} req/s: 429s predictive (baseline)",
                              f"{pred[0]['rejected_429']} ({base[0]['rejected_429']})", "> 0", pred[0]["rejected_429"] > 0))
        figures.append(Figure("  completed within SLO, predictive vs baseline", f"{good[1]} vs {good[0]}",
                              "predictive >= baseline", good[1] >= good[0]))
    return figures
