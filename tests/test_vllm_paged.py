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

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")       # nothing downloads here: no hub lookups
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
pytest.importorskip("vllm")

from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole  # noqa: E402

from client import KVClient  # noqa: E402
from client.connectors.vllm_paged import VllmStoreConnector  # noqa: E402
from loadtest.bench_vllm import BLOCK, Engine, make_request, prompt, vllm_config, write_model_dir  # noqa: E402

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model_dir(tmp_path_factory.mktemp("smollm2"))


@pytest.fixture(scope="module")
def store(kvstore_module_factory):
    return kvstore_module_factory()


def address(daemon) -> dict:
    # a generous timeout: with the suite's other workers loading the host a load can take
    # longer than the default 2 s, and a timeout makes every block of it a miss
    return {"store_host": daemon.host, "store_port": daemon.port, "namespace": "smollm2-test",
            "store_timeout_s": 30}


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


def test_a_store_restart_between_requests_gives_no_tokens_and_no_error(kvstore_factory, engines, caplog):
    daemon = kvstore_factory()
    first, second = engines(address(daemon)), engines(address(daemon))
    shared = prompt(4, 2 * BLOCK)
    first.run(make_request(shared + [1]))
    first.flush()
    daemon.stop()
    request = make_request(shared + [2])
    assert second.connector.get_num_new_matched_tokens(request, 0) == (0, False)      # down: no tokens
    kvstore_factory.restart(daemon)
    second.connector.health._next_try = 0.0     # skip the back-off wait
    (out, kv_output), *_ = second.run(request)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 0
    second.flush()
    again = make_request(shared + [3])            # the store is used again once it is back
    assert second.connector.get_num_new_matched_tokens(again, 0) == (2 * BLOCK, False)
    assert sum("cannot be used" in r.getMessage() for r in caplog.records) <= 2


def test_a_store_that_is_down_costs_one_log_line_and_no_tokens(engines, caplog):
    from conftest import free_port

    engine = engines({"store_host": "127.0.0.1", "store_port": free_port()})
    request = make_request(prompt(5, 2 * BLOCK + 1))
    with caplog.at_level("WARNING"):
        for _ in range(3):
            assert engine.connector.get_num_new_matched_tokens(request, 0) == (0, False)
        engine.run(request)
    assert not engine.scheduler.requests
    # One line from each side (in vLLM the scheduler and the worker are separate processes).
    assert sum("cannot be used" in r.getMessage() for r in caplog.records) == 2


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
