"""Chat completions through `kvstore llm up`, driven by the official `openai` client as an engine's users drive it.

    python -m loadtest.bench_chat [--documents 6] [--document-tokens 2000] [--port 0]

Starts `kvstore llm up --model smollm2-135m` (a store, the conductor, one
prefill and one decode worker, the gateway) and, with `openai.OpenAI` on its
`/v1`:

- exact: ten chat conversations sharing a system prompt (loadtest.bench_serving's)
  and two more (one turn; several turns), greedy, 32 tokens; each reply's token
  ids (`return_token_ids`) against transformers' `apply_chat_template` and greedy
  `generate` on the same model in this process, first unstreamed (the store
  cold), then streamed (prefixes cached; the deltas' text against the decoded
  reference).
- repeated documents: `--documents` documents of about `--document-tokens`
  tokens, each asked a question in a streamed chat (first pass, nothing cached)
  and right after asked another question about the same document (repeated
  pass: the document's blocks are in the store). TTFT is the time from sending
  to the first non-empty content delta, one request in flight; the figure is
  the median over documents of repeated / first pass, beside both medians.

The host's load average is printed before and after: on a shared host the
first passes' prefill is what a busy neighbour slows most.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import time

import openai
import torch

from loadtest.bench_serving import QUESTIONS, SYSTEM
from loadtest.report import Figure, describe_machine, log, machine_info
from loadtest.serving_replay import llm_up
from workers.catalog import SMOLLM2
from workers.model import LoadedModel, load_model

NEW_TOKENS = 32
EXTRA_CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one short sentence."},
     {"role": "user", "content": "Why do caches make programs faster?"},
     {"role": "assistant", "content": "They keep data close."},
     {"role": "user", "content": "And why does a prefix cache help language models?"}],
]
WORDS = ("the store keeps blocks of keys and values for every prefix a model has seen so a later request that "
         "shares the prefix skips its prefill and reads them back from memory instead while the scheduler sends "
         "it to the worker whose cache holds the longest match of its tokens").split()
FIRST_QUESTION = "Summarise the document above in one sentence."
REPEAT_QUESTION = "Which word does the document above use most often?"
TTFT_TARGET = 0.5


def reference(smol: LoadedModel, messages: list[dict]) -> list[int]:
    """apply_chat_template + greedy generate, cut after the end-of-turn token."""
    prompt = smol.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                return_dict=False)
    ids = torch.tensor([prompt])
    out = smol.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
                              pad_token_id=smol.eos_token_id)[0, len(prompt):].tolist()
    return out[:out.index(smol.eos_token_id) + 1] if smol.eos_token_id in out else out


def streamed(client: openai.OpenAI, messages: list[dict], max_tokens: int) -> tuple[str, float]:
    """(the reply's text, seconds to its first non-empty content delta)."""
    started, ttft, pieces = time.perf_counter(), None, []
    for chunk in client.chat.completions.create(model=SMOLLM2, messages=messages, max_tokens=max_tokens,
                                                temperature=0, stream=True, stream_options={"include_usage": True}):
        if chunk.choices and chunk.choices[0].delta.content:
            ttft = ttft if ttft is not None else time.perf_counter() - started
            pieces.append(chunk.choices[0].delta.content)
    return "".join(pieces), ttft if ttft is not None else time.perf_counter() - started


def bench_exact(client: openai.OpenAI, smol: LoadedModel) -> list[Figure]:
    conversations = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}] for q in QUESTIONS]
    conversations += EXTRA_CONVERSATIONS
    log(f"exact: {len(conversations)} conversations, references first")
    expected = [reference(smol, m) for m in conversations]
    unstreamed = streamed_ok = 0
    for messages, want in zip(conversations, expected):
        reply = client.chat.completions.create(model=SMOLLM2, messages=messages, max_tokens=NEW_TOKENS,
                                               temperature=0, extra_body={"return_token_ids": True})
        unstreamed += reply.choices[0].token_ids == want
    for messages, want in zip(conversations, expected):
        streamed_ok += streamed(client, messages, NEW_TOKENS)[0] == smol.tokenizer.decode(want,
                                                                                          skip_special_tokens=True)
    n = len(conversations)
    log(f"exact: {unstreamed}/{n} token ids (cold), {streamed_ok}/{n} streamed texts (warm)")
    return [Figure("chat token-exact vs apply_chat_template + generate (cold)", f"{unstreamed}/{n}", f"{n}/{n}",
                   unstreamed == n),
            Figure("chat streamed text equal to the reference (warm)", f"{streamed_ok}/{n}", f"{n}/{n}",
                   streamed_ok == n)]


def document(smol: LoadedModel, index: int, tokens: int, rng: random.Random) -> str:
    """About `tokens` tokens of words, different from the first token on for each document."""
    words = [f"Document {index} ({rng.randrange(10**9)})."] + [rng.choice(WORDS) for _ in range(tokens)]
    ids = smol.tokenizer(" ".join(words), add_special_tokens=False).input_ids[:tokens]
    return smol.tokenizer.decode(ids)


def bench_documents(client: openai.OpenAI, smol: LoadedModel, documents: int, tokens: int) -> list[Figure]:
    rng = random.Random(time.time_ns())
    first, repeated = [], []
    for i in range(documents):
        doc = document(smol, i, tokens, rng)
        first.append(streamed(client, [{"role": "user", "content": f"{doc}\n\n{FIRST_QUESTION}"}], 4)[1])
        repeated.append(streamed(client, [{"role": "user", "content": f"{doc}\n\n{REPEAT_QUESTION}"}], 4)[1])
        log(f"document {i}: first pass {first[-1]:.3f}s, repeated {repeated[-1]:.3f}s "
            f"(load average {os.getloadavg()[0]:.1f})")
    ratio = statistics.median(r / f for r, f in zip(repeated, first))
    return [Figure(f"TTFT repeated document / first pass ({tokens} tokens, median of {documents})",
                   f"{ratio:.2f}x ({statistics.median(repeated):.2f}/{statistics.median(first):.2f}s)",
                   f"<= {TTFT_TARGET}x", ratio <= TTFT_TARGET)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--documents", type=int, default=6, help="documents, each asked twice (default 6)")
    p.add_argument("--document-tokens", type=int, default=2000, help="tokens per document (default 2000)")
    p.add_argument("--port", type=int, default=0, help="the gateway's port (default 0: any free one)")
    p.add_argument("--only", default="exact,documents", help="comma-separated: exact, documents")
    args = p.parse_args()
    sections = set(args.only.split(","))
    print(describe_machine(machine_info()), flush=True)
    log("starting kvstore llm up and loading the reference model")
    with llm_up(["--model", SMOLLM2, "--port", str(args.port), "--dram-size", "2gb"]) as info:
        smol = load_model(SMOLLM2)
        figures = []
        with openai.OpenAI(base_url=info["gateway"] + "/v1", api_key="unused", max_retries=0, timeout=600) as client:
            streamed(client, [{"role": "user", "content": "Hello!"}], 2)        # first-request costs, unmeasured
            if "exact" in sections:
                figures += bench_exact(client, smol)
            if "documents" in sections:
                figures += bench_documents(client, smol, args.documents, args.document_tokens)
    print(f"\nload average at the end: {os.getloadavg()[0]:.1f}")
    for f in figures:
        print(f.line())


if __name__ == "__main__":
    main()
