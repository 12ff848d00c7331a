"""`HiCacheStore` as SGLang runs it: built by SGLang's own storage factory over SGLang's own host KV pool,
its zero-copy page moves timed against a memcpy of the same bytes.

    python -m loadtest.bench_sglang [--layers 32] [--heads 2] [--head-dim 128] [--page 32]
                                    [--pages 64] [--repeats 7] [--layout page_first]

What it does, all on CPU:

- builds SGLang 0.5.23's `MHATokenToKVPool` (the device pool, here on CPU) and the
  `MHATokenToKVPoolHost` over it, as `build_kv_host_pool` does, for the layout asked (bf16);
- asks `StorageBackendFactory.create_backend("dynamic", ...)` for the backend named by the extra
  config (``module_path`` ``client.connectors.sglang_hicache``, ``class_name`` ``HiCacheStore``,
  ``store_host``/``store_port`` of a `kvstore serve` it starts) and registers the host pool, as
  SGLang's cache controller does; prints whether the factory returned our backend;
- checks the v1 round trip for every MHA layout: random pages written with `batch_set_v1`, read
  back with `batch_get_v1` into other pages of the pool, compared byte for byte;
- times `batch_set_v1` (fresh keys each repeat) and `batch_get_v1` of ``--pages`` pages, and, as
  the reference, one memcpy (`ctypes.memmove`) of the same number of bytes between two
  buffers allocated and touched beforehand. A figure is the median over ``--repeats``; the ratio is
  memcpy time / operation time (the throughput ratio), the median of the per-repeat ratios.

The load average of the host is printed with the figures: on a shared 2-core host the store,
the client and the copy compete for the same cores.

SGLang's model-config package imports every model's config up front, and two of those import
torchvision (and its quantization package imports compressed-tensors); neither is installed here
(the project installs SGLang without its dependencies) and the KV pools use neither. `load_sglang`
imports the pool modules with such SGLang modules made placeholders, and only for that import.
"""
from __future__ import annotations

import argparse
import ctypes
import importlib
import importlib.abc
import os
import sys
import time
from typing import Any

import torch

from loadtest.procs import ProcessGroup, start_kvstore
from loadtest.report import Row, Table, log, machine_info

MODULE_PATH = "client.connectors.sglang_hicache"
CLASS_NAME = "HiCacheStore"
LAYOUTS = ("page_first", "layer_first", "page_first_direct", "page_head")
MISSING_HERE = ("torchvision", "compressed_tensors")    # imported by SGLang modules the KV pools never use


# --------------------------------------------------------------- SGLang, as far as it imports here

class _Placeholders(importlib.abc.MetaPathFinder):
    """Loads ``sglang.*`` modules so that one failing on a MISSING_HERE import keeps what it defined
    and answers any other name with an inert placeholder class (isinstance against it is False)."""

    def find_spec(self, name: str, path: Any, target: Any = None):
        if not name.startswith("sglang."):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _TolerantLoader(spec.loader)
                return spec
        return None


class _TolerantLoader(importlib.abc.Loader):
    def __init__(self, loader: Any):
        self._loader = loader

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        try:
            self._loader.exec_module(module)
        except ModuleNotFoundError as e:
            if (e.name or "").split(".")[0] not in MISSING_HERE:
                raise
            made: dict[str, type] = {}

            def placeholder(attr: str) -> type:
                if attr.startswith("__"):
                    raise AttributeError(attr)
                return made.setdefault(attr, type(attr, (), {"__module__": module.__name__,
                                                             "model_type": f"{module.__name__}.{attr}"}))
            module.__getattr__ = placeholder


def load_sglang() -> dict[str, Any]:
    """SGLang's storage factory, config, device and host KV pools, and stats class (ImportError without SGLang)."""
    finder = _Placeholders()
    sys.meta_path.insert(0, finder)
    try:
        from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
        from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
        from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
        from sglang.srt.observability.metrics_collector import StorageMetrics
    finally:
        sys.meta_path.remove(finder)
    return {"HiCacheStorage": HiCacheStorage, "HiCacheStorageConfig": HiCacheStorageConfig,
            "MHATokenToKVPool": MHATokenToKVPool, "MHATokenToKVPoolHost": MHATokenToKVPoolHost,
            "StorageBackendFactory": StorageBackendFactory, "StorageMetrics": StorageMetrics}


def host_pool(sg: dict, layout: str, *, layers: int = 4, heads: int = 2, head_dim: int = 16,
              page: int = 16, tokens: int = 512, dtype: torch.dtype = torch.bfloat16):
    """SGLang's device KV pool on CPU and its host pool (``layout``), as `build_kv_host_pool` makes them."""
    device = sg["MHATokenToKVPool"](size=tokens, page_size=page, dtype=dtype, head_num=heads,
                                    head_dim=head_dim, layer_num=layers, device="cpu",
                                    enable_memory_saver=False)
    info = device.get_device_pool_infos()[0].buffer_info
    host = sg["MHATokenToKVPoolHost"](info, 2.0, 0, page, layout, pin_memory=False, device="cpu",
                                      device_capacity_tokens=device.size, start_layer=device.start_layer,
                                      end_layer=device.end_layer)
    return device, host


def storage_config(sg: dict, extra: dict | None, *, model: str = "meta-llama/Llama-3.1-8B",
                   tp_rank: int = 0, tp_size: int = 1, layout: str = "page_first"):
    """A `HiCacheStorageConfig` as SGLang's cache controller fills it in."""
    return sg["HiCacheStorageConfig"](
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=True, is_page_first_layout=layout.startswith("page_first"),
        model_name=model, extra_config=extra)


def extra_config(host: str, port: int, **more: Any) -> dict:
    """The ``--hicache-storage-backend-extra-config`` that loads `HiCacheStore`."""
    return {"backend_name": "kvstore", "module_path": MODULE_PATH, "class_name": CLASS_NAME,
            "store_host": host, "store_port": port, **more}


def create_backend(sg: dict, config: Any, pool: Any):
    """What SGLang's cache controller does on attach: the factory, then the host pool registered."""
    backend = sg["StorageBackendFactory"].create_backend("dynamic", config, pool)
    backend.register_mem_pool_host(pool)
    return backend


def fill_pages(pool: Any, first_page: int, pages: int, seed: int) -> torch.Tensor:
    """Random bytes in every piece of pages first_page.. of the pool; their host indices."""
    indices = torch.arange(first_page * pool.page_size, (first_page + pages) * pool.page_size, dtype=torch.int64)
    generator = torch.Generator().manual_seed(seed)
    for index in range(first_page, first_page + pages):
        page = pool.get_data_page(index * pool.page_size, flat=False)
        page.view(torch.int16).copy_(torch.randint(-2 ** 15, 2 ** 15, page.shape, dtype=torch.int16,
                                                   generator=generator))
    return indices


def same_pages(pool: Any, a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the pages at host indices a and b hold the same bytes."""
    step = pool.page_size
    return all(torch.equal(pool.get_data_page(int(a[i]), flat=False).view(torch.int16),
                           pool.get_data_page(int(b[i]), flat=False).view(torch.int16))
               for i in range(0, a.numel(), step))


def round_trip(sg: dict, backend_for, layout: str, pages: int = 4) -> bool:
    """batch_set_v1 of random pages, batch_get_v1 into other pages of the pool: byte for byte the same."""
    _, pool = host_pool(sg, layout)
    backend = backend_for(pool, layout)
    try:
        src = fill_pages(pool, 0, pages, seed=7)
        dst = torch.arange(pages * pool.page_size, 2 * pages * pool.page_size, dtype=torch.int64)
        keys = [f"rt-{layout}-{i}" for i in range(pages)]
        return (all(backend.batch_set_v1(keys, src)) and backend.batch_exists(keys) == pages
                and all(backend.batch_get_v1(keys, dst)) and same_pages(pool, src, dst))
    finally:
        backend.clear()
        backend.close()


# --------------------------------------------------------------------------------------- the run

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--heads", type=int, default=2, help="KV heads on this TP rank")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--page", type=int, default=32, help="tokens a page")
    parser.add_argument("--pages", type=int, default=64, help="pages a batch")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--layout", default="page_first", choices=LAYOUTS)
    parser.add_argument("--memory", default="1gb", help="the node's --dram-size")
    args = parser.parse_args(argv)

    try:
        sg = load_sglang()
    except ImportError as e:
        print(f"SGLang is not importable here ({e}); install it with `make install-test`")
        return 2
    machine = machine_info()
    with ProcessGroup() as group:
        node = start_kvstore(group, args.memory)

        def backend_for(pool, layout, **config):
            return create_backend(sg, storage_config(sg, extra_config(node.host, node.port), layout=layout,
                                                     **config), pool)

        _, probe_pool = host_pool(sg, "page_first")
        probe = backend_for(probe_pool, "page_first")
        ours = type(probe).__module__ == MODULE_PATH and type(probe).__name__ == CLASS_NAME
        probe.close()
        print(f"SGLang StorageBackendFactory('dynamic') returns our backend: {'yes' if ours else 'no'} "
              f"({type(probe).__module__}.{type(probe).__name__})")
        for layout in LAYOUTS:
            print(f"v1 round trip through {layout} host pool byte-exact: "
                  f"{'yes' if round_trip(sg, backend_for, layout) else 'no'}")

        table = throughput(sg, backend_for, args)
        machine["load average at end"] = "%.1f" % os.getloadavg()[0]
        print()
        print(table.render_text(machine))
    return 0


def throughput(sg: dict, backend_for, args) -> Table:
    page_tokens = args.page
    tokens = (2 * args.pages + 1) * page_tokens
    _, pool = host_pool(sg, args.layout, layers=args.layers, heads=args.heads, head_dim=args.head_dim,
                        page=page_tokens, tokens=tokens)
    backend = backend_for(pool, args.layout)
    src = fill_pages(pool, 0, args.pages, seed=1)
    dst = torch.arange(args.pages * page_tokens, 2 * args.pages * page_tokens, dtype=torch.int64)
    page_bytes = pool.get_size_per_token() * page_tokens
    total = page_bytes * args.pages
    a = torch.empty(total, dtype=torch.uint8).fill_(1)
    b = torch.empty(total, dtype=torch.uint8).fill_(2)

    table = Table(f"HiCacheStore v1 vs memcpy: {args.pages} pages of {page_bytes / (1 << 20):.2f} MiB "
                  f"({args.layout}, {args.layers} layers x {args.heads} heads x {args.head_dim}, bf16, "
                  f"{page_tokens} tokens a page), {total / (1 << 20):.0f} MiB a batch",
                  subject="HiCacheStore", reference="memcpy")
    put_row: Row = table.row("batch_set_v1", "GB/s")
    get_row: Row = table.row("batch_get_v1", "GB/s")
    exact = True
    backend.batch_set_v1(["warm-up"], src[:page_tokens])          # the first connection and arena mapping
    backend.batch_get_v1(["warm-up"], dst[:page_tokens])
    backend.clear()
    for rep in range(args.repeats):
        keys = [f"bench-{rep}-{i}" for i in range(args.pages)]
        ref = _timed(lambda: ctypes.memmove(b.data_ptr(), a.data_ptr(), total))
        put = _timed(lambda: backend.batch_set_v1(keys, src))
        get = _timed(lambda: backend.batch_get_v1(keys, dst))
        ok_put, ok_get = put[1], get[1]
        ref2 = _timed(lambda: ctypes.memmove(a.data_ptr(), b.data_ptr(), total))
        if not (all(ok_put) and all(ok_get)):
            log(f"  repeat {rep}: {ok_put.count(False)} puts and {ok_get.count(False)} gets failed")
            exact = False
        exact = exact and same_pages(pool, src, dst) if rep == 0 else exact
        reference = min(ref[0], ref2[0])
        put_row.add("HiCacheStore", total / put[0] / 1e9)
        get_row.add("HiCacheStore", total / get[0] / 1e9)
        for row in (put_row, get_row):
            row.add("memcpy", total / reference / 1e9)
        log(f"  repeat {rep}: set {total / put[0] / 1e9:.2f} GB/s, get {total / get[0] / 1e9:.2f} GB/s, "
            f"memcpy {total / reference / 1e9:.2f} GB/s")
        backend.clear()
    backend.close()
    table.notes.append(f"Medians of {args.repeats} repeats; memcpy: one memmove of the same bytes between "
                       f"two buffers touched beforehand (the faster of the two around each repeat).")
    table.notes.append(f"Pages read back byte-exact: {'yes' if exact else 'no'}.")
    return table


def _timed(fn) -> tuple[float, Any]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


if __name__ == "__main__":
    sys.exit(main())
