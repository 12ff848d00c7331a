"""Serving figures: a real LLaMA's prefill and decode through the store, and a live trace replay.

    python -m loadtest.bench_serving [--model smollm2-135m] [--only exact,reuse,overlap,replay,rejection]

In-process (one store daemon, the engines in this process):

- exact: 20 prompts (10 chat prompts sharing a system prompt, 10 random token
  prompts of 32 to 1,024 tokens), 32 new tokens each, greedy; the prefill/decode
  output through the store against a monolithic `generate`, first with whatever
  the store holds (cold), then again with every prompt's prefix cached (warm);
  and the largest logit difference between a prefix-reused and a full prefill.
- reuse: TTFT of a 1,024-token prompt whose first 768 tokens are cached, over
  the cold TTFT (median of repeats, fresh prompts each time).
- overlap: a 1,024-token prefill with layer-wise puts against the same prefill
  storing nothing (until it returns, and until the last put is answered), and
  the gap between the prefill's return and the first decode step. The wall
  clock overhead holds only while a core is free for the puts and the store;
  the CPU seconds the puts add (this process and the store daemon together,
  over the bare prefill's) say what they cost whatever else the host runs.

Live (`kvstore llm up --prefill 2 --decode 1`, see `loadtest/serving_replay.py`):

- replay: a slice of the conversation trace (whole conversations, sent at
  `--rate` requests per second) through the gateway under `random`
  and `kvcache-centric`: mean TTFT ratio, TTFT/TBT p50/p90, prefix hit rate, and
  the simulator calibrated on the workers' own timings against the measurement.
- rejection: the slice at 3x the rate, `--rejection predictive` against
  `baseline`: 429s and requests completed within the SLO.

Every figure is printed with its target; ratios come from one run.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from pathlib import Path

import torch

from client import KVClient
from loadtest.procs import ProcessGroup, start_kvstore
from loadtest.report import Figure, log
from loadtest.serving_replay import live_figures
from workers.catalog import SMOLLM2, TINY
from workers.decode import DecodeEngine
from workers.kvio import make_connector
from workers.model import LoadedModel, load_model, reference_generate
from workers.prefill import PrefillEngine

EXACT_BLOCK_TOKENS = 32      # small enough that every prompt (32 tokens and up) has a cached prefix when warm
NEW_TOKENS = 32
SYSTEM = ("You are a concise assistant for a team that runs a distributed key-value cache for language-model "
          "serving. Answer in plain sentences.")
QUESTIONS = [
    "What is a KV cache?",
    "Why does prefix caching reduce time to first token?",
    "Explain in two sentences what disaggregated prefill and decode means, and why a scheduler needs to know "
    "where cached blocks are.",
    "List three reasons an eviction policy should prefer the leaves of a prefix chain.",
    "How do you pick a block size for hashing prompts?",
    "What happens to a decode worker when a block it needs has been evicted from the store?",
    "Compare DRAM and SSD tiers for a cache of attention keys and values.",
    "Write a short note for operators about watching the hit rate of a prefix cache, including which counters "
    "to look at first and what a falling hit rate usually means in practice.",
    "Why must greedy decoding through the store give exactly the same tokens as a single run?",
    "Summarise the Mooncake paper's scheduling idea in one paragraph.",
]
RANDOM_LENGTHS = [32, 100, 200, 300, 450, 600, 700, 800, 900, 1024]


class Rig:
    """A store, a prefill engine and a decode engine for one model, in this process."""

    def __init__(self, loaded: LoadedModel, socket_path: str, block_tokens: int):
        self.loaded = loaded
        self.prefill = PrefillEngine(loaded, make_connector(KVClient(unix_socket=socket_path), loaded, block_tokens))
        self.decode = DecodeEngine(loaded, make_connector(KVClient(unix_socket=socket_path), loaded, block_tokens))

    def serve(self, request_id: str, prompt: list[int], new_tokens: int) -> list[int]:
        result = self.prefill.prefill(request_id, prompt)
        seq = self.decode.submit(request_id, prompt, result.first_token, result.stored_tokens, new_tokens)
        return [result.first_token] + [t for t, _ in self.decode.stream(seq)]


def prompts(loaded: LoadedModel) -> list[list[int]]:
    rng = random.Random(11)
    vocab = loaded.model.config.vocab_size
    if loaded.name == TINY:
        chat = [list((SYSTEM + " " + q).encode()) for q in QUESTIONS]
    else:
        chat = [loaded.tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM},
                                                      {"role": "user", "content": q}],
                                                     add_generation_prompt=True, tokenize=True) for q in QUESTIONS]
        chat = [list(p["input_ids"] if isinstance(p, dict) or hasattr(p, "keys") else p) for p in chat]
    return chat + [[rng.randrange(vocab) for _ in range(n)] for n in RANDOM_LENGTHS]


def fresh_prompt(loaded: LoadedModel, n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(loaded.model.config.vocab_size) for _ in range(n)]


def bench_exact(rig: Rig) -> list[Figure]:
    batch = prompts(rig.loaded)
    log(f"exact: {len(batch)} prompts of {min(map(len, batch))}-{max(map(len, batch))} tokens, references first")
    refs = [reference_generate(rig.loaded, p, NEW_TOKENS) for p in batch]
    figures = []
    for run in ("cold", "warm"):
        exact = sum(rig.serve(f"{run}-{i}", p, NEW_TOKENS) == ref for i, (p, ref) in enumerate(zip(batch, refs)))
        rig.prefill.connector.wait_for_save()
        log(f"exact ({run}): {exact}/{len(batch)}")
        figures.append(Figure(f"token-exact, P/D through the store vs generate ({run})", f"{exact}/{len(batch)}",
                              f"{len(batch)}/{len(batch)}", exact == len(batch)))
    worst, reused = 0.0, 0
    for i, p in enumerate(batch):
        full = rig.prefill.prefill(f"full-{i}", p, reuse_limit=0, store_kv=False)
        warm = rig.prefill.prefill(f"warm-logits-{i}", p)
        reused += warm.cached_tokens > 0
        worst = max(worst, float((full.last_logits - warm.last_logits).abs().max()))
    figures.append(Figure(f"max |logit diff|, prefix-reused vs full prefill ({reused} reused)", f"{worst:.2e}",
                          "<= 1e-4", worst <= 1e-4))
    return figures


def bench_reuse(rig: Rig, repeats: int) -> list[Figure]:
    rng = random.Random(23)
    cold, warm = [], []
    for r in range(repeats):
        prompt = fresh_prompt(rig.loaded, 1024, rng)
        t = time.perf_counter()
        rig.prefill.prefill(f"cold-{r}", prompt, store_kv=False)
        cold.append(time.perf_counter() - t)
        rig.prefill.prefill(f"prefix-{r}", prompt[:768])
        rig.prefill.connector.wait_for_save()
        t = time.perf_counter()
        result = rig.prefill.prefill(f"reuse-{r}", prompt)
        warm.append(time.perf_counter() - t)
        rig.prefill.connector.wait_for_save()
        assert result.cached_tokens == 768, result.cached_tokens
    c, w = statistics.median(cold), statistics.median(warm)
    log(f"reuse: cold {c:.3f}s, 768 of 1024 cached {w:.3f}s")
    return [Figure("TTFT, 1,024 tokens with 768 cached / cold", f"{w / c:.2f}x ({w:.2f}/{c:.2f}s)", "<= 0.45x",
                   w / c <= 0.45)]


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process has used so far (/proc/PID/stat: utime, stime)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def bench_overlap(rig: Rig, store_pid: int, repeats: int) -> list[Figure]:
    """Per repeat: a bare prefill and a storing prefill (wall clock and CPU, nothing else running; which runs
    first alternates, so a load that drifts during a repeat does not favour one), then a storing prefill
    handed straight to the decode engine: the gap runs from its return, as a serving prefill hands off, with
    its last layers' puts possibly still on their way (the decode waits for them, as a real one would)."""
    rng = random.Random(31)
    bare, returned, saved, gaps, bare_cpu, stored_cpu = [], [], [], [], [], []

    def cpu() -> float:
        return time.process_time() + cpu_seconds(store_pid)

    def run_bare(r: int) -> None:
        c, t = cpu(), time.perf_counter()
        rig.prefill.prefill(f"bare-{r}", fresh_prompt(rig.loaded, 1024, rng), reuse_limit=0, store_kv=False)
        bare.append(time.perf_counter() - t)
        bare_cpu.append(cpu() - c)

    def run_stored(r: int) -> None:
        c, t = cpu(), time.perf_counter()
        rig.prefill.prefill(f"stored-{r}", fresh_prompt(rig.loaded, 1024, rng), reuse_limit=0)
        returned.append(time.perf_counter() - t)
        rig.prefill.connector.wait_for_save()
        saved.append(time.perf_counter() - t)
        stored_cpu.append(cpu() - c)

    for r in range(repeats):
        for run in (run_bare, run_stored) if r % 2 == 0 else (run_stored, run_bare):
            run(r)
        prompt = fresh_prompt(rig.loaded, 1024, rng)
        result = rig.prefill.prefill(f"handoff-{r}", prompt, reuse_limit=0)
        done = time.perf_counter()
        seq = rig.decode.submit(f"handoff-{r}", prompt, result.first_token, result.stored_tokens, 2)
        list(rig.decode.stream(seq))
        gaps.append(seq.first_step_at - done)
        rig.prefill.connector.wait_for_save()
    b, ret, sav, gap, bc, sc = (statistics.median(x) for x in (bare, returned, saved, gaps, bare_cpu, stored_cpu))
    log(f"overlap (load average {os.getloadavg()[0]:.1f}): bare {b:.3f}s, with puts {ret:.3f}s to return and "
        f"{sav:.3f}s to the last put; gap {gap * 1e3:.1f} ms; CPU bare {bc:.3f}s, with puts {sc:.3f}s")
    return [Figure("prefill 1,024 tokens + layer-wise puts, until the last put", f"{(sav / b - 1) * 100:+.1f}%",
                   "<= +10%", sav / b - 1 <= 0.10),
            Figure("  (until the prefill hands off)", f"{(ret / b - 1) * 100:+.1f}%", "", None),
            Figure("  (CPU seconds, this process + the store)", f"{(sc / bc - 1) * 100:+.1f}%", "", None),
            Figure("first decode step after the prefill ends", f"{gap * 1e3:.1f} ms", "<= 50 ms", gap <= 0.050)]


def in_process(args: argparse.Namespace, sections: set[str]) -> list[Figure]:
    loaded = load_model(args.model)
    figures = []
    with ProcessGroup() as group:
        template = "{python} -m kvstore serve --port {port} --dram-size {memory} --unixsocket {dir}/kv.sock"
        store = start_kvstore(group, "2gb", template)
        socket_path = str(group.log_dir / "kv.sock")
        if "exact" in sections:
            rig = Rig(loaded, socket_path, EXACT_BLOCK_TOKENS)
            figures += bench_exact(rig)
            rig.decode.stop()
        rig = Rig(loaded, socket_path, args.block_tokens)
        if "reuse" in sections:
            figures += bench_reuse(rig, args.repeats)
        if "overlap" in sections:
            figures += bench_overlap(rig, store.process.pid, args.repeats)
        rig.decode.stop()
    return figures


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=SMOLLM2, choices=(SMOLLM2, TINY))
    p.add_argument("--only", default="exact,reuse,overlap,replay,rejection",
                   help="comma-separated sections (default: all)")
    p.add_argument("--repeats", type=int, default=3, help="repeats of the timed in-process figures (median)")
    p.add_argument("--threads", type=int, default=1, help="torch threads in this process (default 1: on a "
                   "shared host, OpenMP threads spinning at barriers make multi-thread timings erratic)")
    p.add_argument("--block-tokens", type=int, default=128, help="tokens per KV block of the timed figures")
    p.add_argument("--requests", type=int, default=200, help="trace requests replayed live")
    p.add_argument("--rate", type=float, default=0.6, help="requests per second of the live replay (default 0.6)")
    args = p.parse_args()
    sections = set(args.only.split(","))
    torch.set_num_threads(args.threads)
    figures = in_process(args, sections) if sections & {"exact", "reuse", "overlap"} else []
    if sections & {"replay", "rejection"}:
        figures += live_figures(args, sections)
    print()
    for f in figures:
        print(f.line())


if __name__ == "__main__":
    main()
