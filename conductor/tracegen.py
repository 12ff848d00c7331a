"""Synthetic Mooncake-format traces: a family of workloads to judge scheduling on, not one file.

A scheduler tuned on one trace can be tuned to it by accident; a generator
lets every claim be checked on traces of other shapes. A trace here is a
stream of requests whose parts are chosen separately:

- **When** (`arrival`): the request times of a Poisson process, of a gamma
  renewal process whose gaps have a coefficient of variation `burst_cv`
  (`bursty` or `gamma`: above 1 requests come in clumps, 1 is Poisson, below
  1 they come steadier than Poisson, near 0 like a clock), or of a Poisson
  process whose rate swings as
  ``rate * (1 + amplitude * sin(2 pi t / period_s))`` (a compressed day).
  `tick_s` rounds times down to a grid, as logged traces do.
- **What is shared** (the prefix structure). A new conversation starts with
  one of `system_prompts` system prompts (Zipf popularity), then with
  probability `document_share` one of `documents` documents (Zipf), then its
  user message. Every request is followed up with probability `continue_p`
  after a think time; the follow-up's prompt is the whole previous prompt,
  the previous answer and a new message, so a conversation is a chain of
  growing prompts. Each extra follow-up of the same request, with
  probability `branch_p` each (a retry or an edited turn), makes the
  conversation a tree whose branches share the common part.
- **How long**: messages, documents, system prompts and answers each have a
  length distribution (`Lengths`: a mixture of clipped log-normals).
- **Length and reuse apart** (`reuse` >= 0). The structure above ties how much
  of a prompt is shared to how long it is (a document is long, a message
  short). With `reuse` set, an opening prompt's whole length is drawn from
  `first_tokens` and its first `reuse` share is the head of one of
  `system_prompts` long shared contexts (Zipf `system_zipf`); the rest is its
  own. So the prompt length, the share of it that others also send, and the
  answer length are three separate knobs.

Block ids follow from the content: a prompt is a path in a tree of content
segments (system prompt, document, message, answer), and a 512-token block
is named by the segment holding its last token plus where it ends. Two
prompts therefore share block i exactly when they share every token up to
its end, as Mooncake's prefix-chained `hash_ids` do, without a table of all
blocks: each segment reserves its ids once, when it is created. Memory is
bounded by the shared pools and the conversations still waiting for a
follow-up, so a million requests stream in constant memory.

The request times come first and are exact: at each time, a follow-up whose
think time has passed is sent if there is one, else a new conversation
starts. The same seed always gives the same trace: every random quantity
draws from its own stream, seeded from `seed`.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field, fields, replace
from typing import Callable, Iterator, TextIO

import numpy as np

from conductor.trace import BLOCK_TOKENS, TraceRequest

ARRIVALS = ("poisson", "bursty", "gamma", "diurnal")
_CHUNK = 4096


@dataclass(frozen=True)
class Lengths:
    """A mixture of log-normals, clipped to [low, high]: ``(weight, median, sigma)`` parts."""

    parts: tuple[tuple[float, float, float], ...]
    low: int = 1
    high: int = 131_072

    def __post_init__(self) -> None:
        if not self.parts or any(w <= 0 or m <= 0 or s < 0 for w, m, s in self.parts):
            raise ValueError("a length distribution needs parts with positive weight and "
                             "median and a non-negative sigma")
        if not 1 <= self.low <= self.high:
            raise ValueError("length bounds must satisfy 1 <= low <= high")

    @classmethod
    def parse(cls, text: str) -> Lengths:
        """``MEDIAN:SIGMA[:WEIGHT],...[@LOW-HIGH]``, e.g. ``20:1:0.15,380:0.4:0.85@1-2000``."""
        body, _, bounds = text.partition("@")
        parts = []
        try:
            for item in body.split(","):
                nums = [float(x) for x in item.split(":")]
                if len(nums) not in (2, 3):
                    raise ValueError
                parts.append((nums[2] if len(nums) == 3 else 1.0, nums[0], nums[1]))
            low, high = (int(x) for x in bounds.split("-")) if bounds else (1, 131_072)
        except ValueError:
            raise ValueError(f"bad length distribution '{text}' (expected "
                             "MEDIAN:SIGMA[:WEIGHT],...[@LOW-HIGH])") from None
        return cls(tuple(parts), low, high)

    def __str__(self) -> str:
        body = ",".join(f"{m:g}:{s:g}:{w:g}" for w, m, s in self.parts)
        return f"{body}@{self.low}-{self.high}"

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        weights = np.array([w for w, _, _ in self.parts])
        which = rng.choice(len(self.parts), size=n, p=weights / weights.sum())
        medians = np.array([m for _, m, _ in self.parts])[which]
        sigmas = np.array([s for _, _, s in self.parts])[which]
        values = np.rint(medians * np.exp(sigmas * rng.standard_normal(n)))
        return np.clip(values, self.low, self.high).astype(np.int64)


@dataclass(frozen=True)
class TraceSpec:
    """Everything that decides a generated trace; the field help is the CLI's."""

    requests: int = field(default=4000, metadata={"help": "requests to generate"})
    seed: int = field(default=0, metadata={"help": "random seed (same seed, same trace)"})
    arrival: str = field(default="poisson", metadata={
        "help": "poisson, bursty or gamma (gamma gaps with CV burst_cv), or diurnal"})
    rate: float = field(default=3.4, metadata={"help": "mean requests per second"})
    burst_cv: float = field(default=3.0, metadata={
        "help": "bursty/gamma: coefficient of variation of the gaps between requests "
                "(> 1 clumps, 1 Poisson, < 1 steadier)"})
    period_s: float = field(default=600.0, metadata={"help": "diurnal: period of the rate"})
    amplitude: float = field(default=0.6, metadata={
        "help": "diurnal: rate swings by this share of its mean (0-1)"})
    tick_s: float = field(default=0.0, metadata={
        "help": "round request times down to multiples of this (0: exact)"})
    system_prompts: int = field(default=1, metadata={"help": "distinct system prompts"})
    system_zipf: float = field(default=1.0, metadata={"help": "Zipf exponent of their use"})
    system_tokens: Lengths = field(default=Lengths(((1.0, 880.0, 0.0),)), metadata={
        "help": "system prompt length"})
    documents: int = field(default=0, metadata={"help": "distinct shared documents"})
    document_share: float = field(default=0.0, metadata={
        "help": "share of new conversations that open with a shared document"})
    document_zipf: float = field(default=1.0, metadata={"help": "Zipf exponent of their use"})
    document_tokens: Lengths = field(default=Lengths(((1.0, 8000.0, 0.8),)), metadata={
        "help": "document length"})
    first_tokens: Lengths = field(default=Lengths(((1.0, 4000.0, 1.2),)), metadata={
        "help": "user message opening a conversation"})
    followup_tokens: Lengths = field(default=Lengths(((1.0, 100.0, 1.5),)), metadata={
        "help": "user message of a follow-up turn"})
    output_tokens: Lengths = field(default=Lengths(((1.0, 300.0, 0.8),), 1, 4096), metadata={
        "help": "answer length"})
    continue_p: float = field(default=0.3, metadata={
        "help": "chance that a request gets a follow-up turn"})
    branch_p: float = field(default=0.0, metadata={
        "help": "chance of each further follow-up of the same turn (a session tree)"})
    think_s: Lengths = field(default=Lengths(((1.0, 60.0, 1.2),), 1, 86_400), metadata={
        "help": "seconds between an answer and its follow-up"})
    max_input: int = field(default=131_072, metadata={
        "help": "longest prompt; a conversation that would outgrow it ends"})
    reuse: float = field(default=-1.0, metadata={
        "help": "share of an opening prompt (its length from first_tokens) that is the head "
                "of one of system_prompts shared contexts; -1: off (system prompt, document "
                "and message as set)"})

    def __post_init__(self) -> None:
        checks = [
            (self.requests >= 1, "requests must be at least 1"),
            (self.arrival in ARRIVALS, f"arrival must be one of {', '.join(ARRIVALS)}"),
            (self.rate > 0, "rate must be positive"),
            (self.burst_cv > 0, "burst_cv must be positive"),
            (self.period_s > 0, "period_s must be positive"),
            (0 <= self.amplitude <= 1, "amplitude must be within 0-1"),
            (self.tick_s >= 0, "tick_s must not be negative"),
            (self.system_prompts >= 1, "system_prompts must be at least 1"),
            (self.documents >= 0, "documents must not be negative"),
            (0 <= self.document_share <= 1, "document_share must be within 0-1"),
            (self.document_share == 0 or self.documents >= 1,
             "document_share needs documents >= 1"),
            (0 <= self.continue_p < 1 and 0 <= self.branch_p < 1,
             "continue_p and branch_p must be within [0, 1)"),
            (self.continue_p / (1 - self.branch_p) < 1,
             "continue_p / (1 - branch_p), the mean follow-ups per request, must be below 1"),
            (self.max_input >= 1, "max_input must be at least 1"),
            (self.reuse == -1.0 or 0 <= self.reuse <= 1, "reuse must be within 0-1 (or -1: off)"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


SPEC_FIELDS = {f.name: f for f in fields(TraceSpec)}

# Parameters that reproduce a public trace's measured statistics (docs/conductor.md).
PRESETS: dict[str, dict] = {
    "conversation": dict(
        arrival="bursty", rate=3.4, burst_cv=1.3, tick_s=3.0,
        system_prompts=1, system_tokens=Lengths(((1.0, 880.0, 0.0),)),
        first_tokens=Lengths(((0.25, 40.0, 1.0), (0.75, 8000.0, 1.05)), 1, 125_000),
        followup_tokens=Lengths(((0.7, 30.0, 1.0), (0.3, 2500.0, 1.3)), 1, 60_000),
        output_tokens=Lengths(((0.16, 15.0, 1.0), (0.84, 370.0, 0.4)), 1, 2000),
        continue_p=0.32, branch_p=0.16, think_s=Lengths(((1.0, 78.0, 1.2),), 1, 3600),
        max_input=126_000),
    "documents": dict(
        arrival="poisson", rate=1.0,
        system_prompts=4, system_tokens=Lengths(((1.0, 1500.0, 0.3),)),
        documents=400, document_share=0.5, document_zipf=0.6, document_tokens=Lengths(((1.0, 9000.0, 0.6),)),
        first_tokens=Lengths(((1.0, 300.0, 1.0),)),
        followup_tokens=Lengths(((1.0, 120.0, 1.0),)),
        output_tokens=Lengths(((1.0, 300.0, 0.7),), 1, 2000),
        continue_p=0.35, branch_p=0.1, think_s=Lengths(((1.0, 40.0, 1.0),), 1, 3600)),
}


def spec_from(preset: str | None = None, **overrides) -> TraceSpec:
    """A spec from a named preset (or the defaults), with fields overridden."""
    if preset is not None and preset not in PRESETS:
        raise ValueError(f"unknown preset '{preset}' (choose from {', '.join(PRESETS)})")
    return replace(TraceSpec(**PRESETS.get(preset, {})), **overrides)


class _Draws:
    """One random quantity, drawn in chunks from its own seeded stream."""

    def __init__(self, seed: np.random.SeedSequence, draw: Callable[[np.random.Generator, int],
                                                                     np.ndarray]):
        self._rng = np.random.default_rng(seed)
        self._draw = draw
        self._buf: list = []
        self._i = 0

    def __call__(self):
        if self._i == len(self._buf):
            self._buf, self._i = self._draw(self._rng, _CHUNK).tolist(), 0
        self._i += 1
        return self._buf[self._i - 1]


def _zipf(n: int, s: float) -> Callable[[np.random.Generator, int], np.ndarray]:
    p = 1.0 / np.arange(1, n + 1) ** s
    p /= p.sum()
    return lambda rng, k: rng.choice(n, size=k, p=p)


def arrival_times(spec: TraceSpec, seed: np.random.SeedSequence) -> Iterator[float]:
    """Request times in seconds, non-decreasing, ``spec.requests`` of them."""
    rng = np.random.default_rng(seed)
    t, left = 0.0, spec.requests
    while left:
        if spec.arrival == "poisson":
            times = t + np.cumsum(rng.exponential(1 / spec.rate, _CHUNK))
        elif spec.arrival in ("bursty", "gamma"):
            shape = 1 / spec.burst_cv ** 2
            times = t + np.cumsum(rng.gamma(shape, 1 / (spec.rate * shape), _CHUNK))
        else:   # thinning a Poisson process at the peak rate
            peak = spec.rate * (1 + spec.amplitude)
            cand = t + np.cumsum(rng.exponential(1 / peak, _CHUNK))
            keep = 1 + spec.amplitude * np.sin(2 * math.pi * cand / spec.period_s)
            times = cand[rng.random(_CHUNK) * (1 + spec.amplitude) < keep]
            t = float(cand[-1])
        if times.size:
            t = max(t, float(times[-1]))
        times = times[:left]
        left -= times.size
        if spec.tick_s:
            times = np.floor(times / spec.tick_s) * spec.tick_s
        yield from times.tolist()


@dataclass
class _Prefix:
    """A node of the content tree: the ids of the full blocks up to it, and its length."""

    full_ids: list[int]
    tokens: int


@dataclass
class _Turn:
    """A sent request whose follow-ups are still to come."""

    prompt: _Prefix
    output_tokens: int
    answered: _Prefix | None = None     # prompt + answer, made by the first follow-up


class TraceGenerator:
    """Streams the requests of one `TraceSpec`; see the module docstring."""

    def __init__(self, spec: TraceSpec, block_tokens: int = BLOCK_TOKENS):
        self.spec, self.block = spec, block_tokens
        seeds = iter(np.random.SeedSequence(spec.seed).spawn(11))
        s = spec
        self._times = arrival_times(s, next(seeds))
        self._system = _Draws(next(seeds), _zipf(s.system_prompts, s.system_zipf))
        self._document = _Draws(next(seeds), _zipf(max(1, s.documents), s.document_zipf))
        self._has_document = _Draws(next(seeds), lambda g, k: g.random(k) < s.document_share)
        self._first = _Draws(next(seeds), s.first_tokens.sample)
        self._followup = _Draws(next(seeds), s.followup_tokens.sample)
        self._output = _Draws(next(seeds), s.output_tokens.sample)
        self._continues = _Draws(next(seeds), lambda g, k: g.random(k) < s.continue_p)
        self._branches = _Draws(next(seeds), lambda g, k: g.random(k) < s.branch_p)
        self._think = _Draws(next(seeds), s.think_s.sample)
        self._pool_rng = np.random.default_rng(next(seeds))
        self._next_id = 0
        heads = ([s.max_input] * s.system_prompts if s.reuse >= 0
                 else s.system_tokens.sample(self._pool_rng, s.system_prompts))
        self._systems = [self._extend(_Prefix([], 0), int(n)) for n in heads]
        self._doc_tokens = s.document_tokens.sample(self._pool_rng, max(1, s.documents))
        self._docs: dict[tuple[int, int], _Prefix] = {}
        self._waiting: list[tuple[float, int, _Turn]] = []
        self._seq = 0

    def __iter__(self) -> Iterator[TraceRequest]:
        for now in self._times:
            yield self._request(now)

    def _extend(self, prefix: _Prefix, tokens: int) -> _Prefix:
        """A new segment of ``tokens`` after ``prefix``; reserves ids for the full blocks
        whose last token falls in it."""
        end = prefix.tokens + tokens
        n = end // self.block - prefix.tokens // self.block
        ids = prefix.full_ids + list(range(self._next_id, self._next_id + n))
        self._next_id += n
        return _Prefix(ids, end)

    def _hash_ids(self, prompt: _Prefix) -> list[int]:
        """A prompt's block ids: its full blocks, then its own id for a partial last block."""
        if prompt.tokens % self.block == 0:
            return prompt.full_ids
        self._next_id += 1
        return prompt.full_ids + [self._next_id - 1]

    def _request(self, now: float) -> TraceRequest:
        prompt = None
        while prompt is None and self._waiting and self._waiting[0][0] <= now:
            _, _, parent = heapq.heappop(self._waiting)
            prompt = self._followup_prompt(parent)
        if prompt is None:
            prompt = self._opening_prompt()
        output = int(self._output())
        self._schedule_followups(now, _Turn(prompt, output))
        return TraceRequest(now, prompt.tokens, output, tuple(self._hash_ids(prompt)))

    def _opening_prompt(self) -> _Prefix:
        system = int(self._system())
        head = self._systems[system]
        if self.spec.reuse >= 0:
            return self._shared_head_prompt(head)
        if self._has_document():
            key = (system, int(self._document()))
            if key not in self._docs:
                self._docs[key] = self._extend(head, int(self._doc_tokens[key[1]]))
            head = self._docs[key]
        message = min(int(self._first()), max(1, self.spec.max_input - head.tokens))
        return self._extend(head, message)

    def _shared_head_prompt(self, context: _Prefix) -> _Prefix:
        """A prompt of `first_tokens` whose first `reuse` share is the head of ``context``."""
        length = max(1, min(int(self._first()), self.spec.max_input))
        shared = min(round(self.spec.reuse * length), length)
        head = _Prefix(context.full_ids[:shared // self.block], shared)
        return self._extend(head, length - shared)

    def _followup_prompt(self, parent: _Turn) -> _Prefix | None:
        """The previous prompt, its answer and a new message; None when too long."""
        if parent.answered is None:
            parent.answered = self._extend(parent.prompt, parent.output_tokens)
        message = int(self._followup())
        if parent.answered.tokens + message > self.spec.max_input:
            return None
        return self._extend(parent.answered, message)

    def _schedule_followups(self, now: float, turn: _Turn) -> None:
        if not self._continues():
            return
        while True:
            self._seq += 1
            heapq.heappush(self._waiting, (now + self._think(), self._seq, turn))
            if not self._branches():
                return


def generate(spec: TraceSpec) -> Iterator[TraceRequest]:
    """The requests of ``spec`` in arrival order (a generator: nothing is held)."""
    return iter(TraceGenerator(spec))


def write_jsonl(requests: Iterator[TraceRequest], out: TextIO) -> int:
    """Write requests as Mooncake JSONL (timestamp in ms); returns how many."""
    n = 0
    lines = []
    for r in requests:
        ids = ", ".join(map(str, r.hash_ids))
        lines.append(f'{{"timestamp": {round(r.arrival_s * 1000)}, "input_length": '
                     f'{r.input_length}, "output_length": {r.output_length}, '
                     f'"hash_ids": [{ids}]}}\n')
        n += 1
        if len(lines) == 1024:
            out.writelines(lines)
            lines.clear()
    out.writelines(lines)
    return n
