"""The OpenAI gateway. Starts `kvstore llm up` (store, conductor, one prefill and one decode worker,
gateway; tiny model) for the end-to-end tests, and a bare `kvstore conductor` with instances
registered by hand for rejections (429) and unreachable workers (503)."""
from __future__ import annotations

import json
import signal
import subprocess
import sys

import grpc
import pytest

from conftest import free_port
from llm_procs import LlmUp, get, post
from proto import grpc_codegen
from workers.catalog import TINY, TINY_CONTEXT, ByteTokenizer
from workers.gateway import Router
from workers.http_app import GatewayServer
from workers.metrics import GatewayMetrics
from workers.model import load_model, reference_generate

cpb, cpb_grpc = grpc_codegen.load("conductor")


@pytest.fixture(scope="module")
def deployment():
    with LlmUp("--prefill", "1", "--decode", "1", "--model", TINY, "--port", "0", "--block-tokens", "16",
               "--dram-size", "64mb") as info:
        yield info


def test_llm_up_prints_every_part(deployment):
    assert deployment["gateway"].startswith("http://127.0.0.1:")
    assert sorted(w["role"] for w in deployment["workers"]) == ["decode", "prefill"]
    assert deployment["store"] and deployment["conductor"]


def test_completion_equals_monolithic_generate(deployment):
    tiny = load_model(TINY)
    prompt = list(range(40, 110))
    status, body = post(deployment["gateway"], {"model": TINY, "prompt": prompt, "max_tokens": 10,
                                                "temperature": 0, "return_token_ids": True})
    assert status == 200, body
    reply = json.loads(body)
    assert reply["choices"][0]["token_ids"] == reference_generate(tiny, prompt, 10)
    assert reply["choices"][0]["finish_reason"] == "length"
    assert reply["usage"] == {"prompt_tokens": 70, "completion_tokens": 10, "total_tokens": 80}


def test_a_repeated_prefix_is_reused(deployment):
    prompt = "The same long prefix, repeated by every request of this test. " * 2
    for suffix in ("one", "two"):
        assert post(deployment["gateway"], {"prompt": prompt + suffix, "max_tokens": 3})[0] == 200
    metrics = get(deployment["gateway"], "/metrics")[1].decode()
    reused = [line for line in metrics.splitlines() if line.startswith("kvstore_gateway_prefix_tokens_reused_total")]
    assert int(reused[0].split()[1]) >= 96


def test_stream_is_server_sent_events_ending_in_done(deployment):
    status, body = post(deployment["gateway"], {"prompt": "stream me", "max_tokens": 5, "stream": True,
                                                "return_token_ids": True})
    assert status == 200
    events = [e for e in body.decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert len(chunks) == 5
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 4 + ["length"]
    assert chunks[-1]["usage"]["completion_tokens"] == 5
    tiny = load_model(TINY)
    streamed = [c["choices"][0]["token_ids"][0] for c in chunks]
    assert streamed == reference_generate(tiny, list(b"stream me"), 5)


@pytest.mark.parametrize("body, param", [
    (b"", None),
    (b"{not json", None),
    (b"[1, 2]", None),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": -3}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": "many"}, "max_tokens"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": [1, -2]}, "prompt"),
    ({"max_tokens": 4}, "prompt"),
    ({"prompt": "hi", "model": "gpt-4"}, "model"),
    ({"prompt": "hi", "temperature": 0.7}, "temperature"),
    ({"prompt": "hi", "stream": "yes"}, "stream"),
    ({"prompt": [1] * TINY_CONTEXT, "max_tokens": 1}, "max_tokens"),
])
def test_bad_requests_get_400_with_an_openai_error(deployment, body, param):
    status, reply = post(deployment["gateway"], body)
    assert status == 400
    error = json.loads(reply)["error"]
    assert error["message"] and error["param"] == param and error["code"] == 400


def test_models_health_and_unknown_routes(deployment):
    assert json.loads(get(deployment["gateway"], "/v1/models")[1])["data"][0]["id"] == TINY
    assert get(deployment["gateway"], "/health") == (200, b'{"status": "ok"}')
    assert get(deployment["gateway"], "/nowhere")[0] == 404
    metrics = get(deployment["gateway"], "/metrics")[1].decode()
    assert "kvstore_gateway_ttft_seconds_bucket" in metrics and "kvstore_gateway_tbt_seconds_count" in metrics


@pytest.fixture
def bare_conductor(kvstore_factory, request):
    """A conductor (admission from the test's parameter) with two prefill and one decode instance whose
    addresses nothing listens on, and an in-process gateway in front of it."""
    store = kvstore_factory()
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kvstore", "conductor", "--port", str(port), "--store",
                             f"127.0.0.1:{store.port}", *request.param], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().startswith("conductor listening")
    stub = cpb_grpc.ConductorStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
    for name, role in (("p", cpb.PREFILL), ("p2", cpb.PREFILL), ("d", cpb.DECODE)):
        stub.RegisterInstance(cpb.InstanceInfo(instance_id=name, role=role, address=f"127.0.0.1:{free_port()}"))
    router = Router(f"127.0.0.1:{port}", TINY, ByteTokenizer(), TINY_CONTEXT, None, GatewayMetrics())
    server = GatewayServer(router, "127.0.0.1", 0).start()
    yield server.url
    server.stop()
    proc.send_signal(signal.SIGTERM)
    proc.wait(10)


@pytest.mark.parametrize("bare_conductor", [["--rejection", "baseline", "--ttft-slo", "0.000000001"]],
                         indirect=True)
def test_a_rejected_request_gets_429_with_the_reason(bare_conductor):
    for path, body in (("/v1/completions", {"prompt": "hello", "max_tokens": 4}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4,
                                                 "stream": True})):
        status, reply = post(bare_conductor, body, path)
        assert status == 429
        assert "SLO" in json.loads(reply)["error"]["message"]


@pytest.mark.parametrize("bare_conductor", [["--rejection", "none"]], indirect=True)
def test_an_unreachable_worker_gets_503_not_a_hang_and_the_retry_goes_elsewhere(bare_conductor):
    status, reply = post(bare_conductor, {"prompt": "hello", "max_tokens": 4})
    assert status == 503
    assert "prefill worker p2:" in json.loads(reply)["error"]["message"]      # p was tried first, then p2


CHAT = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("body, param", [
    ({}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": ["hi"]}, "messages[0]"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "tool", "content": "42", "tool_call_id": "t"}]}, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": 7}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content"),
    ({"messages": [*CHAT, {"role": "assistant", "content": "", "tool_calls": [{"id": "t"}]}]},
     "messages[1].tool_calls"),
    ({"messages": CHAT, "max_tokens": 0}, "max_tokens"),
    ({"messages": CHAT, "max_completion_tokens": "many"}, "max_completion_tokens"),
    ({"messages": CHAT, "temperature": 1}, "temperature"),
    ({"messages": CHAT, "n": 2}, "n"),
    ({"messages": CHAT, "stop": ["\n"]}, "stop"),
    ({"messages": CHAT, "stream": "yes"}, "stream"),
    ({"messages": CHAT, "stream_options": {"include_usage": True}}, "stream_options"),
    ({"messages": CHAT, "stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options"),
    ({"messages": CHAT, "model": "gpt-4"}, "model"),
    ({"messages": [{"role": "user", "content": "x" * TINY_CONTEXT}]}, "messages"),
])
def test_bad_chat_requests_get_400_with_an_openai_error(deployment, body, param):
    status, reply = post(deployment["gateway"], body, "/v1/chat/completions")
    assert status == 400, reply
    error = json.loads(reply)["error"]
    assert error["message"] and error["param"] == param and error["code"] == 400


def test_a_tiny_chat_is_its_chatml_prompt_greedily_continued(deployment):
    tiny = load_model(TINY)
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    status, body = post(deployment["gateway"], {"messages": messages, "max_tokens": 6, "return_token_ids": True},
                        "/v1/chat/completions")
    assert status == 200, body
    reply = json.loads(body)
    assert reply["object"] == "chat.completion" and reply["choices"][0]["message"]["role"] == "assistant"
    prompt = "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert reply["choices"][0]["token_ids"] == reference_generate(tiny, list(prompt.encode()), 6)
    assert reply["usage"]["prompt_tokens"] == len(prompt.encode())
