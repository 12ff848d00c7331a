"""`VllmStoreConnector` driven by vLLM 0.34's own code against a real `kvstore serve`.

vLLM's factory builds the connector for both roles; vLLM's `Scheduler` (built as vLLM's own
KV-connector unit tests build it) asks it for external tokens and hands it the step's output; the
worker side runs as vLLM's CPU model runner runs it (`ActiveKVConnector`: bind metadata, start the
sync loads, `wait_for_save`, transfer results, load errors), on paged caches allocated by vLLM's
`allocate_kv_cache`, and its per-layer hooks are called by vLLM's `maybe_transfer_kv_layer` inside
`set_forward_context`. Only the attention kernel is ours (vLLM's CPU kernels are not built here): it
writes deterministic KV for the scheduled tokens into their slots.
"""
from __future__ import annotations

import json
import os
import subprocess
import types

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")       # nothing downloads here: no hub lookups
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402
from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig,  # noqa: E402
                         VllmConfig)
from vllm.distributed.kv_transfer import kv_transfer_state  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole  # noqa: E402
from vllm.forward_context import set_forward_context  # noqa: E402
from vllm.model_executor.layers.attention.kv_transfer_utils import maybe_transfer_kv_layer  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec  # noqa: E402
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402
from vllm.v1.worker.cpu.kv_connector import ActiveKVConnector  # noqa: E402
from vllm.v1.worker.utils import allocate_kv_cache  # noqa: E402

from client import KVClient  # noqa: E402
from client.connectors.vllm_paged import VllmStoreConnector  # noqa: E402
from conftest import start_kvstore, wait_ready  # noqa: E402

BLOCK = 32                  # the CPU attention backend takes multiples of 32
NUM_BLOCKS = 48
EOS = 2

# SmolLM2-135M's config.json (as `workers.catalog` converts it): 30 layers, 3 KV heads of 64.
SMOLLM2 = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
           "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
           "num_key_value_heads": 3, "head_dim": 64, "max_position_embeddings": 8192, "vocab_size": 49152,
           "rms_norm_eps": 1e-5, "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"},
           "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2, "dtype": "float32"}
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(SMOLLM2["num_hidden_layers"])]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """SmolLM2's config.json: the converted copy's when there is one, else the same fields."""
    from workers.catalog import SMOLLM2 as NAME, cache_root

    folder = tmp_path_factory.mktemp("smollm2")
    converted = cache_root() / NAME / "config.json"
    config = json.loads(converted.read_text()) if converted.exists() else SMOLLM2
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    daemon = start_kvstore(tmp_path_factory.mktemp("kvstore"))
    yield daemon
    daemon.stop()


def vllm_config(model_dir: str, extra: dict) -> VllmConfig:
    """A VllmConfig as vLLM's KV-connector unit tests make one (create_vllm_config), on CPU."""
    model = ModelConfig(model=model_dir, dtype="float32", seed=0, skip_tokenizer_init=True)
    scheduler = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512, max_model_len=1024,
                                enable_chunked_prefill=True, is_encoder_decoder=False,
                                disable_hybrid_kv_cache_manager=True)
    cache = CacheConfig(block_size=BLOCK, cache_dtype="auto", enable_prefix_caching=True)
    cache.kv_cache_layout = "LBHNC"             # what vLLM resolves for its CPU attention backend
    transfer = KVTransferConfig(kv_connector="VllmStoreConnector", kv_connector_module_path="client.connectors.vllm_v1",
                                kv_role="kv_both", kv_load_failure_policy="recompute",
                                kv_connector_extra_config=extra)
    return VllmConfig(model_config=model, scheduler_config=scheduler, cache_config=cache,
                      kv_transfer_config=transfer, device_config=DeviceConfig(device="cpu"))


def address(daemon) -> dict:
    return {"store_host": daemon.host, "store_port": daemon.port, "namespace": "smollm2-test"}


_request_ids = iter(range(1, 10**6))


def make_request(tokens: list[int]) -> Request:
    """A vLLM request (create_request's way) that finishes after its first token."""
    init_none_hash(sha256)
    params = SamplingParams(max_tokens=1)
    params.update_from_generation_config({}, EOS)
    return Request(request_id=f"req-{next(_request_ids)}", prompt_token_ids=tokens, sampling_params=params,
                   pooling_params=None, mm_features=None, block_hasher=get_request_block_hasher(BLOCK, sha256))


def kv_of(layer: int, position: int, token: int, shape: tuple[int, ...]) -> torch.Tensor:
    """The KV the fake attention computes for one token: a function of layer, position and token."""
    return torch.arange(shape[0] * shape[1], dtype=torch.float32).reshape(shape) + (
        layer * 1e6 + position * 1e2 + token % 89)


@maybe_transfer_kv_layer
def attention(layer_name: str, slots: torch.Tensor, kv: torch.Tensor) -> None:
    """Stands in for vLLM's unified attention: writes the step's KV into its slots of this layer's pages
    (vLLM's hook waits for the layer's load before and saves the layer after)."""
    from vllm.forward_context import get_forward_context

    cache = get_forward_context().no_compile_layers[layer_name].kv_cache       # [B, H, N, C]
    cache[slots // BLOCK, :, slots % BLOCK] = kv


class Engine:
    """One vLLM instance: its scheduler with the scheduler-side connector, and one worker."""

    def __init__(self, model_dir: str, extra: dict):
        self.config = vllm_config(model_dir, extra)
        spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=3, head_size=64, dtype=torch.float32)
        self.kv_cache_config = get_kv_cache_config_from_groups(
            self.config, [KVCacheGroupSpec(LAYERS, spec)], NUM_BLOCKS * len(LAYERS) * spec.page_size_bytes)
        self.config.cache_config.num_gpu_blocks = self.kv_cache_config.num_blocks
        self.scheduler = Scheduler(vllm_config=self.config, kv_cache_config=self.kv_cache_config, log_stats=True,
                                   structured_output_manager=StructuredOutputManager(self.config), block_size=BLOCK)
        self.worker = KVConnectorFactory.create_connector(self.config, KVConnectorRole.WORKER, self.kv_cache_config)
        self.caches = allocate_kv_cache(self.kv_cache_config, torch.device("cpu"), KVCacheLayout.LBHNC)
        self.layers = {name: types.SimpleNamespace(kv_cache=self.caches[name]) for name in LAYERS}
        self.config.compilation_config.static_forward_context.update(self.layers)
        with self.active():
            self.runner = ActiveKVConnector(self.config, self.caches)
        self.block_ids: dict[str, list[int]] = {}
        self.tokens: dict[str, list[int]] = {}
        self.outputs = []

    def active(self):
        """The worker connector as vLLM's process-wide KV transfer group while it runs."""
        engine = self

        class Active:
            def __enter__(self):
                kv_transfer_state._KV_CONNECTOR_AGENT = engine.worker

            def __exit__(self, *exc):
                kv_transfer_state._KV_CONNECTOR_AGENT = None
        return Active()

    @property
    def connector(self) -> VllmStoreConnector:
        return self.scheduler.connector

    def step(self):
        out = self.scheduler.schedule()
        positions: dict[str, range] = {}
        for new in out.scheduled_new_reqs:
            self.block_ids[new.req_id] = list(new.block_ids[0])
            self.tokens[new.req_id] = list(new.prompt_token_ids)
            positions[new.req_id] = range(new.num_computed_tokens,
                                          new.num_computed_tokens + out.num_scheduled_tokens[new.req_id])
        cached = out.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            if cached.new_block_ids[i] is not None:
                self.block_ids[rid] += cached.new_block_ids[i][0]
            positions[rid] = range(cached.num_computed_tokens[i],
                                   cached.num_computed_tokens[i] + out.num_scheduled_tokens[rid])
        with self.active():
            self.runner.pre_forward(out)
            if positions:
                self._forward(positions)
            self.runner.finish_forward()
            kv_output = self.runner.post_forward(out.finished_req_ids)
        self.outputs.append((out, kv_output))
        req_ids = list(positions)
        result = ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                   sampled_token_ids=[[7] for _ in req_ids], logprobs=None, prompt_logprobs_dict={},
                                   pooler_output=None, kv_connector_output=kv_output)
        self.scheduler.update_from_output(out, result)
        return out, kv_output

    def _forward(self, positions: dict[str, range]) -> None:
        slots, tokens, places = [], [], []
        for rid, span in positions.items():
            for p in span:
                slots.append(self.block_ids[rid][p // BLOCK] * BLOCK + p % BLOCK)
                places.append(p)
                tokens.append(self.tokens[rid][p] if p < len(self.tokens[rid]) else 7)
        slot_tensor = torch.tensor(slots)
        page = self.caches[LAYERS[0]].shape
        with set_forward_context({name: object() for name in LAYERS}, self.config,
                                 slot_mapping={name: slot_tensor for name in LAYERS}):
            for layer, name in enumerate(LAYERS):
                kv = torch.stack([kv_of(layer, p, t, (page[1], page[3])) for p, t in zip(places, tokens)])
                attention(name, slot_tensor, kv)

    def run(self, request: Request, steps: int = 6) -> list:
        """Add a request and step until it is finished; the step outputs."""
        self.scheduler.add_request(request)
        taken = []
        for _ in range(steps):
            taken.append(self.step())
            if not self.scheduler.requests:
                break
        return taken

    def pages(self, request_id: str, blocks: int) -> list[torch.Tensor]:
        """Copies of the request's first ``blocks`` pages in every layer."""
        ids = self.block_ids[request_id][:blocks]
        return [self.caches[name][ids].clone() for name in LAYERS]

    def flush(self) -> None:
        assert self.worker._saver.wait_idle(30)

    def close(self) -> None:
        self.worker.shutdown()
        self.connector.shutdown()


@pytest.fixture
def engines(model_dir, store):
    made = []

    def make(extra: dict | None = None) -> Engine:
        engine = Engine(model_dir, extra or address(store))
        made.append(engine)
        return engine
    yield make
    for engine in made:
        engine.close()


def prompt(seed: int, length: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 40000 + 3 for i in range(length)]


def test_a_prefix_saved_by_one_engine_is_loaded_by_another_byte_for_byte(engines):
    first, second = engines(), engines()
    shared = prompt(1, 3 * BLOCK)
    writer = make_request(shared + [11, 12, 13, 14])
    first.run(writer)
    first.flush()
    saved = first.pages(writer.request_id, 3)

    reader = make_request(shared + [21, 22, 23, 24, 25])
    assert second.connector.get_num_new_matched_tokens(reader, 0) == (3 * BLOCK, False)
    (out, kv_output), *_ = second.run(reader)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 3 * BLOCK       # the cached prefix, exactly
    assert out.num_scheduled_tokens[reader.request_id] == 5
    loads = out.kv_connector_metadata.loads
    assert [len(t.block_ids) for t in loads] == [3]
    assert kv_output is None or not kv_output.invalid_block_ids
    for want, got in zip(saved, second.pages(reader.request_id, 3)):
        assert torch.equal(want.view(torch.uint8), got.view(torch.uint8))

    whole = make_request(list(shared))                   # the whole prompt hits: one token is computed
    assert second.connector.get_num_new_matched_tokens(whole, 0) == (3 * BLOCK - 1, False)
    assert second.connector.get_num_new_matched_tokens(whole, BLOCK) == (2 * BLOCK - 1, False)
    assert second.connector.get_num_new_matched_tokens(make_request([5] + shared), 0) == (0, False)


def test_lookups_change_nothing_and_finished_requests_are_freed_at_once(engines):
    engine = engines()
    request = make_request(prompt(2, 2 * BLOCK + 3))
    before = dict(vars(engine.connector))
    for _ in range(3):
        engine.connector.get_num_new_matched_tokens(request, 0)
    assert {k: v for k, v in vars(engine.connector).items() if k != "_hashers"} == \
        {k: v for k, v in before.items() if k != "_hashers"}
    steps = engine.run(request)
    for _, kv_output in steps:                    # never a finished send the scheduler did not wait for
        assert kv_output is None or not kv_output.finished_sending
    assert not engine.scheduler.requests
    saves = [t for out, _ in steps for t in out.kv_connector_metadata.saves]
    assert [len(t.block_ids) for t in saves] == [2]


def test_a_block_gone_between_lookup_and_load_is_reported_and_never_written(engines, store):
    first, second = engines(), engines()
    shared = prompt(3, 3 * BLOCK)
    writer = make_request(shared + [1])
    first.run(writer)
    first.flush()
    saved = first.pages(writer.request_id, 3)

    reader = make_request(shared + [2, 3])
    second.scheduler.add_request(reader)
    keys = second.connector._keys(reader)
    original_schedule = second.scheduler.schedule

    def schedule_then_evict(*args, **kwargs):           # the block vanishes after the lookup
        out = original_schedule(*args, **kwargs)
        with KVClient(store.host, store.port) as kv:
            kv.delete(keys[1])
        second.scheduler.schedule = original_schedule
        return out
    second.scheduler.schedule = schedule_then_evict
    out, kv_output = second.step()
    block_ids = second.block_ids[reader.request_id]
    assert kv_output.invalid_block_ids == set(block_ids[1:3])
    pages = second.pages(reader.request_id, 3)
    for layer, want in enumerate(saved):
        assert torch.equal(pages[layer][0], want[0])                 # the block still there was loaded
        assert not torch.equal(pages[layer][1], want[1])             # the gone one was not written
    assert reader.num_computed_tokens < 3 * BLOCK                  # vLLM recomputes from the gap


def test_a_store_restart_between_requests_gives_no_tokens_and_no_error(engines, tmp_path, caplog):
    daemon = start_kvstore(tmp_path)
    try:
        first, second = engines(address(daemon)), engines(address(daemon))
        shared = prompt(4, 2 * BLOCK)
        first.run(make_request(shared + [1]))
        first.flush()
        daemon.stop()
        request = make_request(shared + [2])
        assert second.connector.get_num_new_matched_tokens(request, 0) == (0, False)      # down: no tokens
        log_path = tmp_path / "restarted.log"
        with open(log_path, "wb") as log:
            daemon.proc = subprocess.Popen(daemon.args, stdout=log, stderr=subprocess.STDOUT)
        wait_ready(daemon.host, daemon.port, daemon.proc)
        second.connector.health._retry_at = 0.0      # skip the back-off wait
        (out, kv_output), *_ = second.run(request)
        assert out.scheduled_new_reqs[0].num_computed_tokens == 0
        second.flush()
        again = make_request(shared + [3])            # the store is used again once it is back
        assert second.connector.get_num_new_matched_tokens(again, 0) == (2 * BLOCK, False)
        assert sum("unavailable" in r.getMessage() for r in caplog.records) <= 2
    finally:
        daemon.stop()


def test_a_store_that_is_down_costs_one_log_line_and_no_tokens(engines, caplog):
    from conftest import free_port

    engine = engines({"store_host": "127.0.0.1", "store_port": free_port()})
    request = make_request(prompt(5, 2 * BLOCK + 1))
    with caplog.at_level("WARNING"):
        for _ in range(3):
            assert engine.connector.get_num_new_matched_tokens(request, 0) == (0, False)
        engine.run(request)
    assert not engine.scheduler.requests
    assert sum("unavailable" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize("extra, key", [
    ({"store_host": "127.0.0.1", "store_port": "abc"}, "store_port"),
    ({"store_host": "127.0.0.1"}, "store_port"),
    ({"store_host": "", "store_port": 6380}, "store_host"),
    ({"store_port": 70000}, "store_port"),
    ({"store_port": 6380, "store_timeout_s": "soon"}, "store_timeout_s"),
])
def test_a_bad_store_address_stops_start_up_naming_the_key(model_dir, extra, key):
    config = vllm_config(model_dir, extra)
    with pytest.raises(ValueError, match=key):
        KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER, None)


def test_the_connector_is_vllms_kind(model_dir, store):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata

    from client.connectors import vllm_v1

    config = vllm_config(model_dir, address(store))
    connector = KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER, None)
    try:
        assert isinstance(connector, KVConnectorBase_V1) and vllm_v1.VllmStoreConnector is VllmStoreConnector
        assert connector.role is KVConnectorRole.SCHEDULER
        with pytest.raises(AttributeError):
            connector.role = KVConnectorRole.WORKER
        meta = vllm_v1.PagedStoreMetadata()
        assert isinstance(meta, KVConnectorMetadata)
        connector.bind_connector_metadata(meta)
        assert connector.has_connector_metadata()
        connector.clear_connector_metadata()
        assert not connector.has_connector_metadata()
        assert not connector.requires_kv_delivery
    finally:
        connector.shutdown()
