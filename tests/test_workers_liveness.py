"""A worker killed with SIGKILL under `kvstore llm up` (two prefill and two decode worker processes, tiny
model, the `random` policy, which ignores load): no request hangs, at most the one that meets the dead
decode worker fails (503), the conductor lists both dead workers once their load reports stop, and every
later request is served by the survivors, token-exact."""
from __future__ import annotations

import json
import os
import signal
import time

import grpc

from llm_procs import LlmUp, post
from proto import grpc_codegen
from workers.catalog import TINY
from workers.model import load_model, reference_generate

cpb, cpb_grpc = grpc_codegen.load("conductor")


def dead_instances(conductor: str) -> list[str]:
    with grpc.insecure_channel(conductor) as channel:
        return sorted(cpb_grpc.ConductorStub(channel).Stats(cpb.StatsRequest(), timeout=10).dead_instances)


def wait_for_dead(conductor: str, wanted: list[str], limit_s: float = 30.0) -> list[str]:
    deadline = time.monotonic() + limit_s
    while (dead := dead_instances(conductor)) != wanted and time.monotonic() < deadline:
        time.sleep(0.2)
    return dead


def test_killed_workers_get_no_more_requests_and_nothing_hangs():
    tiny = load_model(TINY)
    prompts = [[(i * 11 + k * 3) % 256 for k in range(24 + i)] for i in range(12)]
    with LlmUp("--prefill", "2", "--decode", "2", "--model", TINY, "--policy", "random", "--port", "0",
               "--block-tokens", "8", "--dram-size", "64mb", "--threads", "1") as info:
        assert wait_for_dead(info["conductor"], []) == []
        pids = {w["id"]: w["pid"] for w in info["workers"]}
        for victim in ("prefill-0", "decode-0"):
            os.kill(pids[victim], signal.SIGKILL)
        right_after = [post(info["gateway"], {"prompt": p, "max_tokens": 4, "return_token_ids": True})[0]
                       for p in prompts[:6]]
        assert set(right_after) <= {200, 503} and right_after.count(503) <= 1, right_after
        assert wait_for_dead(info["conductor"], ["decode-0", "prefill-0"]) == ["decode-0", "prefill-0"]
        for prompt in prompts[6:]:
            status, body = post(info["gateway"], {"prompt": prompt, "max_tokens": 4, "return_token_ids": True})
            assert status == 200, body
            assert json.loads(body)["choices"][0]["token_ids"] == reference_generate(tiny, prompt, 4)
