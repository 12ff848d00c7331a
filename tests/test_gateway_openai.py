"""The gateway through the official `openai` client, on SmolLM2-135M-Instruct (`kvstore llm up`): chat completions
token for token equal to transformers' `apply_chat_template` and greedy `generate`, streamed or not, completions
streamed or not (their exactness is tests/test_gateway.py's, on the tiny model), the usage chunk, models, and a
malformed chat as `openai.BadRequestError`."""
from __future__ import annotations

import threading

import pytest
import torch

from llm_procs import LlmUp
from workers.catalog import SMOLLM2
from workers.model import load_model

openai = pytest.importorskip("openai", reason="the openai client comes with the engines extra")

MAX_TOKENS = 16
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one short sentence."},
     {"role": "user", "content": "Why do caches make programs faster?"},
     {"role": "assistant", "content": "They keep data close."},
     {"role": "user", "content": "And why does a prefix cache help language models?"}],
]


@pytest.fixture(scope="module")
def deployment():
    """`kvstore llm up` and the reference model, loaded while the deployment starts."""
    up, started = LlmUp("--model", SMOLLM2, "--port", "0", "--block-tokens", "16", "--dram-size", "256mb"), []
    starting = threading.Thread(target=lambda: started.append(up.__enter__()))
    starting.start()
    smol = load_model(SMOLLM2)
    starting.join()
    assert started, "llm up did not start"
    try:
        yield started[0], smol
    finally:
        up.__exit__(None, None, None)


@pytest.fixture(scope="module")
def client(deployment):
    with openai.OpenAI(base_url=deployment[0]["gateway"] + "/v1", api_key="unused", max_retries=0,
                       timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def smol(deployment):
    return deployment[1]


_GENERATED: dict[tuple[int, ...], list[int]] = {}


def greedy(smol, prompt: list[int]) -> list[int]:
    """transformers' greedy generate, up to and with the end-of-turn token (once per prompt)."""
    if tuple(prompt) not in _GENERATED:
        ids = torch.tensor([prompt])
        out = smol.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                                  do_sample=False, pad_token_id=smol.eos_token_id)[0, len(prompt):].tolist()
        _GENERATED[tuple(prompt)] = out[:out.index(smol.eos_token_id) + 1] if smol.eos_token_id in out else out
    return _GENERATED[tuple(prompt)]


def chat_prompt(smol, messages: list[dict]) -> list[int]:
    return list(smol.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                   return_dict=False))


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_chat_equals_apply_chat_template_and_greedy_generate(client, smol, messages):
    prompt = chat_prompt(smol, messages)
    expected = greedy(smol, prompt)
    reply = client.chat.completions.create(model=SMOLLM2, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                           extra_body={"return_token_ids": True})
    choice = reply.choices[0]
    assert reply.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.token_ids == expected
    assert choice.message.content == smol.tokenizer.decode(expected, skip_special_tokens=True)
    assert choice.finish_reason == ("stop" if expected[-1] == smol.eos_token_id else "length")
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(prompt), len(expected))


def test_a_streamed_chat_is_the_same_text_with_the_role_first_and_the_usage_last(client, smol):
    messages = CONVERSATIONS[1]
    expected = greedy(smol, chat_prompt(smol, messages))
    chunks = list(client.chat.completions.create(model=SMOLLM2, messages=messages, max_tokens=MAX_TOKENS,
                                                 stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    assert "".join(c.choices[0].delta.content for c in chunks[:-1]) == \
        smol.tokenizer.decode(expected, skip_special_tokens=True)
    assert [c.choices[0].finish_reason for c in chunks[:-1]][-1] in ("stop", "length")
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(expected)
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_through_the_client_streamed_or_not(client):
    prompt = "The three primary colours are"
    reply = client.completions.create(model=SMOLLM2, prompt=prompt, max_tokens=8, temperature=0)
    assert reply.object == "text_completion" and reply.usage.completion_tokens == 8
    chunks = list(client.completions.create(model=SMOLLM2, prompt=prompt, max_tokens=8, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks[:-1]) == reply.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage == reply.usage


def test_models_and_a_malformed_chat(client):
    assert [m.id for m in client.models.list()] == [SMOLLM2]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=SMOLLM2, messages=[{"role": "robot", "content": "hi"}])
    assert err.value.status_code == 400 and err.value.param == "messages[0].role"
