"""The decode engine: rebuild each request's cache from the store, then decode in a continuous batch.

A request arrives with its prompt, the first token (the prefill's) and how many
prompt tokens the prefill stored. A loader thread reads those blocks through
the connector, waiting for layers the prefill is still putting, and rebuilds a
`DynamicCache`. The rest of the prompt (the partial last block, which has no
key) and the first token are fed at the request's first step, so the model
always has at least one token that is not in the cache (transformers silently
produces wrong tokens otherwise). A block that is gone when read (evicted, node
lost) makes the request recompute its whole prompt rather than run on a hole.

The step loop is iteration-level (continuous) batching: requests join the
running batch between steps as their loads finish and leave it the step they
finish, so a long request never holds a short one back. Within a step each
sequence runs its own forward: a padded batched forward changes fp32 sums by a
few ulps, and the workers promise greedy output equal to a monolithic run.
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Iterator

import torch
from transformers import DynamicCache

from client.connectors.vllm_v1 import StoreKVConnector
from workers.kvio import EngineRequest, loaded_cache, plan_load
from workers.model import LoadedModel
from workers.timings import Timings

FINISH_LENGTH, FINISH_STOP = "length", "stop"
MAX_WAITING = 256          # requests loading or waiting to join; more are refused
STREAM_POLL_S = 0.5


class DecodeBusy(Exception):
    """The engine holds MAX_WAITING requests that have not joined the batch yet."""


@dataclass
class DecodeSequence:
    request_id: str
    prompt: list[int]
    first_token: int
    stored_tokens: int
    max_tokens: int                       # new tokens in all, the prefill's first one included
    out: queue.Queue = field(default_factory=queue.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    cache: DynamicCache | None = None
    pending: list[int] = field(default_factory=list)
    produced: int = 1
    recomputed: bool = False
    first_step_at: float = 0.0            # perf_counter() when its first step began


class DecodeEngine:
    def __init__(self, loaded: LoadedModel, connector: StoreKVConnector, timings: Timings | None = None,
                 max_batch: int = 32):
        self.loaded = loaded
        self.connector = connector
        self.timings = timings or Timings()
        self.max_batch = max_batch
        self._loads: queue.Queue[DecodeSequence | None] = queue.Queue()
        self._ready: queue.Queue[DecodeSequence] = queue.Queue()
        self._waiting = 0
        self._running: list[DecodeSequence] = []
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._threads = [threading.Thread(target=self._load_loop, name="decode-loader", daemon=True),
                         threading.Thread(target=self._step_loop, name="decode-steps", daemon=True)]
        for t in self._threads:
            t.start()

    def submit(self, request_id: str, prompt: list[int], first_token: int, stored_tokens: int,
               max_tokens: int) -> DecodeSequence:
        """Queue a request; its tokens after the first come out of ``stream(seq)``."""
        if not prompt or max_tokens < 2:
            raise ValueError("decode needs a prompt and max_tokens >= 2 (the prefill makes the first token)")
        if len(prompt) + max_tokens > self.loaded.max_tokens:
            raise ValueError(f"prompt + max_tokens exceeds the model's context of {self.loaded.max_tokens}")
        with self._lock:
            if self._waiting >= MAX_WAITING:
                raise DecodeBusy(f"{MAX_WAITING} requests are already waiting to decode")
            self._waiting += 1
        seq = DecodeSequence(request_id, list(prompt), first_token,
                             max(0, min(stored_tokens, len(prompt))), max_tokens)
        self._loads.put(seq)
        return seq

    def stream(self, seq: DecodeSequence) -> Iterator[tuple[int, str | None]]:
        """(token, finish reason or None) as the batch produces them; stops on the finishing token."""
        while True:
            try:
                item = seq.out.get(timeout=STREAM_POLL_S)
            except queue.Empty:
                if self._stopped.is_set():
                    raise RuntimeError("the decode engine stopped")
                continue
            if isinstance(item, Exception):
                raise item
            yield item
            if item[1] is not None:
                return

    def load(self) -> tuple[int, int]:
        """(sequences in or waiting for the batch, tokens of KV they hold): the conductor's decode load."""
        with self._lock:
            kv = sum(len(s.prompt) + s.produced for s in self._running)
            return len(self._running) + self._waiting, kv

    def stop(self) -> None:
        self._stopped.set()
        self._loads.put(None)

    # ------------------------------------------------------------ loading

    def _load_loop(self) -> None:
        while not self._stopped.is_set():
            seq = self._loads.get()
            if seq is None:
                return
            try:
                self._rebuild(seq)
                self._ready.put(seq)
            except Exception as exc:        # reported to the request's stream, the engine goes on
                with self._lock:
                    self._waiting -= 1
                seq.out.put(exc)

    @torch.inference_mode()
    def _rebuild(self, seq: DecodeSequence) -> None:
        started = time.perf_counter()
        cache = None
        if seq.stored_tokens:
            plan_load(self.connector, EngineRequest(seq.request_id, seq.prompt), seq.stored_tokens)
            self.connector.start_load_kv()
            try:
                cache = loaded_cache(self.connector, self.loaded, seq.request_id)
            finally:
                self.connector.clear_connector_metadata()
                self.connector.release_load(seq.request_id)
            seq.recomputed = cache is None
            if cache is not None:
                self.timings.record_transfer(seq.stored_tokens, time.perf_counter() - started)
        start = seq.stored_tokens if cache is not None else 0
        seq.cache = cache if cache is not None else DynamicCache(config=self.loaded.model.config)
        seq.pending = seq.prompt[start:] + [seq.first_token]

    # ------------------------------------------------------------ stepping

    def _step_loop(self) -> None:
        while not self._stopped.is_set():
            self._admit()
            if not self._running:
                continue
            started = time.perf_counter()
            batch, kv = len(self._running), sum(len(s.prompt) + s.produced for s in self._running)
            for seq in list(self._running):
                self._step(seq)
            self.timings.record_decode(batch, kv, time.perf_counter() - started)
            with self._lock:
                self._running = [s for s in self._running if s.cache is not None]

    def _admit(self) -> None:
        """Move loaded requests into the batch; wait for one when the batch is empty."""
        while len(self._running) < self.max_batch:
            try:
                seq = self._ready.get(timeout=STREAM_POLL_S) if not self._running else self._ready.get_nowait()
            except queue.Empty:
                return
            with self._lock:
                self._waiting -= 1
                self._running.append(seq)

    @torch.inference_mode()
    def _step(self, seq: DecodeSequence) -> None:
        if seq.cancelled.is_set():
            seq.cache = None
            return
        if not seq.first_step_at:
            seq.first_step_at = time.perf_counter()
        try:
            ids = torch.tensor([seq.pending], dtype=torch.long)
            out = self.loaded.model(input_ids=ids, past_key_values=seq.cache, use_cache=True, logits_to_keep=1)
        except Exception as exc:
            seq.cache = None
            seq.out.put(exc)
            return
        token = int(torch.argmax(out.logits[0, -1]))
        seq.produced += 1
        seq.pending = [token]
        finish = None
        if self.loaded.eos_token_id is not None and token == self.loaded.eos_token_id:
            finish = FINISH_STOP
        elif seq.produced >= seq.max_tokens:
            finish = FINISH_LENGTH
        seq.out.put((token, finish))
        if finish is not None:
            seq.cache = None
