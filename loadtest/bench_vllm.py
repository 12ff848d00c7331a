"""vLLM 0.34's own scheduler and worker hooks driving `VllmStoreConnector` against a real store: the
figures, and the harness the tests use.

    python -m loadtest.bench_vllm [--blocks 16] [--repeats 15] [--torch-threads N]

The harness is one vLLM instance without a model (`Engine`): vLLM's `Scheduler` (built as vLLM's own
KV-connector unit tests build it, with a `VllmConfig` on CPU from SmolLM2-135M's config.json), the
connector built by vLLM's `KVConnectorFactory` for both roles, paged caches allocated by vLLM's
`allocate_kv_cache` (``LBHNC``, what vLLM resolves for its CPU attention backend), vLLM's CPU worker
driver `ActiveKVConnector` (binds the step's metadata, starts the loads, `wait_for_save`, transfer
results, load errors), and per layer vLLM's `maybe_transfer_kv_layer` hook around a stand-in attention
inside `set_forward_context` (vLLM's attention kernels are CUDA or C++ builds this machine lacks): it
writes deterministic KV for the step's tokens into their slots.

Figures printed:

- external tokens: a prompt whose first blocks another instance saved is offered exactly that
  prefix (`get_num_new_matched_tokens` through the scheduler), and its pages after the load are
  compared byte for byte with the saved ones;
- restart: the store restarted between the two requests; the second is offered 0 tokens, and no error
  reaches the engine;
- timing: saving ``--blocks`` blocks of all 30 layers (the worker's `save_kv_layer` for each layer, then
  every put answered) and loading them back into other pages (`start_load_kv` to `wait_for_save`),
  against a raw memcpy of the same bytes between pages and a host buffer; medians of ``--repeats``
  runs, the ratio the median of the paired runs' ratios, with the host load before and after.
  ``--torch-threads`` sets torch's intra-op threads for both (on a small shared host torch's default
  pool makes even the reference copy swing by two orders of magnitude: a copy split over two threads
  waits for whichever the scheduler runs last).
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import shlex
import sys
import time
import types
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")       # nothing downloads here: no hub lookups
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
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

from client.connectors.vllm_paged import BlockTransfer, PagedStoreMetadata, VllmStoreConnector  # noqa: E402
from loadtest.procs import DEFAULT_KVSTORE_CMD, ProcessGroup, start_kvstore, wait_for_ping  # noqa: E402
from loadtest.report import Table, machine_info  # noqa: E402

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


_request_ids = iter(range(1, 10**6))


def write_model_dir(folder: Path) -> str:
    """A model folder holding SmolLM2's config.json: the converted copy's when there is one, else the
    same fields (nothing downloads here; no weights are needed, no model runs)."""
    from workers.catalog import SMOLLM2 as NAME, cache_root

    converted = cache_root() / NAME / "config.json"
    config = json.loads(converted.read_text()) if converted.exists() else SMOLLM2
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def prompt(seed: int, length: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 40000 + 3 for i in range(length)]


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

    def __init__(self, model_dir: str, extra: dict, num_blocks: int = NUM_BLOCKS):
        self.config = vllm_config(model_dir, extra)
        spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=3, head_size=64, dtype=torch.float32)
        self.kv_cache_config = get_kv_cache_config_from_groups(
            self.config, [KVCacheGroupSpec(LAYERS, spec)], num_blocks * len(LAYERS) * spec.page_size_bytes)
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
        result = ModelRunnerOutput(req_ids=req_ids,
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

    def run(self, request: Request, steps: int = 8) -> list:
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
        """Wait until the worker's puts are answered."""
        if not self.worker._saver.wait_idle(30):
            raise TimeoutError("the worker's saves did not finish in 30 s")

    def close(self) -> None:
        self.worker.shutdown()
        self.connector.shutdown()




# ------------------------------------------------------------------ the benchmark

def restart(group: ProcessGroup, server, memory: str):
    """Stop the store and start a fresh one on the same port (it comes back empty)."""
    group.stop(server.process)
    argv = shlex.split(DEFAULT_KVSTORE_CMD.format(python=shlex.quote(sys.executable), port=server.port,
                                                  memory=memory))
    server.process = group.start("kvstore-restarted", argv)
    wait_for_ping(server.host, server.port, server.process)


def sharing(model_dir: str, extra: dict, blocks: int) -> dict:
    """One instance saves a prefix, another loads it: tokens offered and pages compared."""
    first, second = Engine(model_dir, extra), Engine(model_dir, extra)
    try:
        shared = prompt(1, blocks * BLOCK)
        writer = make_request(shared + [11, 12, 13])
        first.run(writer)
        first.flush()
        saved = first.pages(writer.request_id, blocks)
        reader = make_request(shared + [21, 22])
        offered, _ = second.connector.get_num_new_matched_tokens(reader, 0)
        (out, kv_output), *_ = second.run(reader)
        loaded = second.pages(reader.request_id, blocks)
        equal = sum(torch.equal(a[i].view(torch.uint8), b[i].view(torch.uint8))
                    for a, b in zip(saved, loaded) for i in range(blocks))
        return {"cached prefix": blocks * BLOCK, "offered": offered,
                "computed at schedule": out.scheduled_new_reqs[0].num_computed_tokens,
                "pages equal": equal, "pages": blocks * len(LAYERS),
                "load errors": len(kv_output.invalid_block_ids) if kv_output else 0}
    finally:
        first.close()
        second.close()


def after_restart(model_dir: str, extra: dict, group: ProcessGroup, server, memory: str) -> dict:
    first, second = Engine(model_dir, extra), Engine(model_dir, extra)
    try:
        shared = prompt(2, 4 * BLOCK)
        first.run(make_request(shared + [1]))
        first.flush()
        restart(group, server, memory)
        request = make_request(shared + [2])
        error = None
        try:
            (out, _), *_ = second.run(request)
            offered = out.scheduled_new_reqs[0].num_computed_tokens
        except Exception as exc:              # noqa: BLE001 - reported, not raised: that is the figure
            error, offered = repr(exc), None
        return {"offered after restart": offered, "error": error}
    finally:
        first.close()
        second.close()


def timing(model_dir: str, extra: dict, blocks: int, repeats: int, table: Table) -> None:
    """Save and load ``blocks`` blocks of every layer through the worker side, against memcpy."""
    engine = Engine(model_dir, extra, num_blocks=2 * blocks + 2)
    worker: VllmStoreConnector = engine.worker
    source, target = list(range(1, blocks + 1)), list(range(blocks + 1, 2 * blocks + 1))
    for layer, name in enumerate(LAYERS):
        engine.caches[name][source].copy_(torch.randn(engine.caches[name][source].shape))
    host = torch.zeros((len(LAYERS), blocks, *engine.caches[LAYERS[0]].shape[1:]))     # touched once here
    src, dst = slice(1, blocks + 1), slice(blocks + 1, 2 * blocks + 1)                  # the same pages
    nbytes = host.numel() * host.element_size()
    save_row = table.row(f"save {blocks} blocks x {len(LAYERS)} layers ({nbytes / 2**20:.1f} MiB)", "ms")
    load_row = table.row(f"load {blocks} blocks x {len(LAYERS)} layers ({nbytes / 2**20:.1f} MiB)", "ms")
    try:
        for _ in range(repeats):
            keys = [secrets.token_hex(16) for _ in source]
            started = time.perf_counter()
            worker.bind_connector_metadata(PagedStoreMetadata(saves=[BlockTransfer("bench", source, keys)]))
            for name in LAYERS:
                worker.save_kv_layer(name, engine.caches[name], None)
            engine.flush()
            worker.clear_connector_metadata()
            save_row.add("store", (time.perf_counter() - started) * 1e3)
            save_row.add("memcpy", memcpy_ms(lambda: [host[i].copy_(engine.caches[n][src])
                                                      for i, n in enumerate(LAYERS)]))
            started = time.perf_counter()
            worker.bind_connector_metadata(PagedStoreMetadata(loads=[BlockTransfer("bench", target, keys)]))
            worker.start_load_kv(None)
            worker.wait_for_save()
            worker.clear_connector_metadata()
            load_row.add("store", (time.perf_counter() - started) * 1e3)
            if worker.get_block_ids_with_load_errors():
                load_row.fail("store", "load errors")
            load_row.add("memcpy", memcpy_ms(lambda: [engine.caches[n][dst].copy_(host[i])
                                                      for i, n in enumerate(LAYERS)]))
        for name in LAYERS:
            if not torch.equal(engine.caches[name][source], engine.caches[name][target]):
                table.notes.append(f"{name}: loaded pages differ from the saved ones")
    finally:
        engine.close()


def memcpy_ms(copy) -> float:
    started = time.perf_counter()
    copy()
    return (time.perf_counter() - started) * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=16, help="blocks (32 tokens each) per save and load")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--memory", default="512mb", help="the store's DRAM")
    parser.add_argument("--torch-threads", type=int, default=None,
                        help="torch's intra-op threads for the copies (default: torch's own)")
    args = parser.parse_args(argv)
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    load_before = os.getloadavg()
    with ProcessGroup() as group:
        server = start_kvstore(group, args.memory)
        extra = {"store_host": server.host, "store_port": server.port, "namespace": "bench-vllm"}
        model_dir = write_model_dir(group.log_dir / "smollm2")
        shared = sharing(model_dir, extra, 4)
        print(f"external tokens offered {shared['offered']} (scheduled as computed: "
              f"{shared['computed at schedule']}) for a cached prefix of {shared['cached prefix']}; "
              f"pages byte-equal {shared['pages equal']}/{shared['pages']}; load errors {shared['load errors']}")
        restarted = after_restart(model_dir, extra, group, server, args.memory)
        print(f"store restarted between the requests: external tokens {restarted['offered after restart']}, "
              f"error {restarted['error'] or 'none'}")
        table = Table("vLLM paged KV through the store vs memcpy", "store", "memcpy")
        table.notes.append("times in ms; store/memcpy is the time ratio (lower is better)")
        timing(model_dir, extra, args.blocks, args.repeats, table)
    load_after = os.getloadavg()
    print(table.render_text(machine_info()))
    print(f"host load (1/5/15 min) before {load_before[0]:.2f}/{load_before[1]:.2f}/{load_before[2]:.2f}, "
          f"after {load_after[0]:.2f}/{load_after[1]:.2f}/{load_after[2]:.2f} on {os.cpu_count()} CPUs; "
          f"torch threads {torch.get_num_threads()}")
    ok = (shared["offered"] == shared["cached prefix"] and shared["pages equal"] == shared["pages"]
          and restarted["offered after restart"] == 0 and restarted["error"] is None)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
