"""INFO: the operator's window, in Redis's format.

Sections as Redis names them (server, clients, memory, stats, keyspace) with
Redis's field names, so dashboards and `redis-cli INFO` read them as usual,
plus a `kvcache` section for what only a KV-cache store has: the arena's
fill and fragmentation, metadata bytes per key, KV hits and misses, and a
`tenants` section: the value bytes each tenant (an ACL user with a quota,
kvstore/store/quotas.py) holds per tier against its quota, and the shared pool's.
"""
from __future__ import annotations

import os
import platform
import resource
import sys
import time

from kvstore import __version__
from kvstore.store.deadlines import now_ms
from kvstore.store.engine import DRAM, GPU, SSD
from kvstore.store.quotas import NO_QUOTA, QUOTA_TIERS

DEFAULT_SECTIONS = ("server", "clients", "memory", "stats", "cluster", "keyspace", "kvcache", "gpu", "dram", "ssd",
                    "tenants")
# What INFO (and INFO default) shows, in Redis's order; INFO all / everything adds commandstats.
INFO_DEFAULT = ("server", "clients", "memory", "stats", "replication", "cpu", "cluster", "keyspace",
                "kvcache", "gpu", "dram", "ssd", "tenants")
INFO_ALL = INFO_DEFAULT + ("commandstats",)


def human(n: float) -> str:
    for unit in ("B", "K", "M", "G", "T"):
        if abs(n) < 1024 or unit == "T":
            return f"{n:.2f}{unit}" if unit != "B" else f"{int(n)}B"
        n /= 1024
    return str(n)


def _rss() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def server_section(server) -> dict:
    uptime = int(time.time() - server.started_at)
    return {"redis_version": "7.0.0", "kvstore_version": __version__, "redis_mode": "standalone",
            "os": f"{platform.system()} {platform.release()} {platform.machine()}", "arch_bits": 64,
            "multiplexing_api": server.loop_name, "python_version": platform.python_version(),
            "process_id": os.getpid(), "tcp_port": server.config.port, "uptime_in_seconds": uptime,
            "uptime_in_days": uptime // 86400, "executable": sys.executable,
            "config_file": server.config_file or ""}


def clients_section(server) -> dict:
    return {"connected_clients": len(server.clients), "maxclients": server.config.maxclients,
            "blocked_clients": 0}


def memory_section(server) -> dict:
    engine, cfg = server.engine, server.config
    used = engine.allocator.used
    rss = _rss()
    return {"used_memory": used, "used_memory_human": human(used), "used_memory_rss": rss,
            "used_memory_rss_human": human(rss), "used_memory_dataset": engine.value_bytes,
            "maxmemory": engine.limit, "maxmemory_human": human(engine.limit),
            "maxmemory_policy": cfg.maxmemory_policy,
            "mem_fragmentation_ratio": f"{(used / engine.value_bytes) if engine.value_bytes else 1.0:.2f}",
            "mem_allocator": "slabs+buddy", **_fragmentation(engine)}


def _fragmentation(engine) -> dict:
    """How the arena is cut up (kvstore/store/slabs.py) and what eviction cost (kvstore/store/room.py)."""
    alloc, stats, room = engine.allocator, engine.stats, engine.room
    largest_class = alloc.largest_chunk
    return {"mem_footprint": alloc.footprint, "mem_free_bytes": alloc.free_bytes,
            "mem_largest_free_extent": alloc.largest_free(), "mem_largest_class": largest_class,
            "mem_fragmented_bytes": alloc.fragmented_bytes(largest_class) if largest_class else 0,
            "mem_slab_slack_bytes": alloc.slack_bytes(), "mem_slab_pages": sum(alloc.slab_pages),
            "mem_slab_page_bytes": alloc.page,
            "evicted_keys_for_small": stats.evicted_for_small, "evicted_keys_for_big": stats.evicted_for_big,
            "evicted_keys_beyond_region": stats.evicted_beyond_region,
            "evicted_keys_other": stats.evicted_other, "evicted_keys_companion": stats.evicted_companions,
            "eviction_seconds": f"{stats.evict_seconds:.6f}", "eviction_deferrals": stats.evict_deferrals,
            "eviction_regions": stats.evict_regions, "eviction_max_turn_ms": f"{room.max_slice * 1000:.3f}",
            "eviction_turn_budget_ms": f"{room.budget * 1000:.3f}" if room.budget is not None else "0"}


def stats_section(server) -> dict:
    s, e = server.stats, server.engine.stats
    return {"total_connections_received": s.connections, "total_commands_processed": s.commands,
            "rejected_connections": s.rejected, "expired_keys": e.expired, "evicted_keys": e.evictions,
            "client_query_buffer_limit_disconnections": s.query_limit_disconnections,
            "client_output_buffer_limit_disconnections": s.output_limit_disconnections,
            "keyspace_hits": e.hits, "keyspace_misses": e.misses, "oom_rejections": e.oom_rejections}


def replication_section(server) -> dict:
    """A node is always a primary without replicas in Redis's sense (cluster copies are not replication)."""
    return {"role": "master", "connected_slaves": 0, "master_failover_state": "no-failover",
            "master_replid": server.replid, "master_replid2": "0" * 40, "master_repl_offset": 0,
            "second_repl_offset": -1, "repl_backlog_active": 0, "repl_backlog_size": 1048576,
            "repl_backlog_first_byte_offset": 0, "repl_backlog_histlen": 0}


def _seconds(t: float) -> str:
    return f"{t:.6f}"


def cpu_section(server) -> dict:
    """CPU time of the process (all threads), its children and the event-loop thread, as Redis's."""
    me, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    fields = {"used_cpu_sys": _seconds(me.ru_stime), "used_cpu_user": _seconds(me.ru_utime),
              "used_cpu_sys_children": _seconds(children.ru_stime),
              "used_cpu_user_children": _seconds(children.ru_utime)}
    try:
        main = resource.getrusage(resource.RUSAGE_THREAD)     # INFO runs on the loop thread
        fields.update(used_cpu_sys_main_thread=_seconds(main.ru_stime),
                      used_cpu_user_main_thread=_seconds(main.ru_utime))
    except (AttributeError, OSError):
        pass
    return fields


def commandstats_section(server) -> dict:
    """Per command: calls, time spent in it, and calls that failed (Redis's cmdstat_ lines)."""
    fields = {}
    for name, (calls, ns, rejected, failed) in sorted(server.stats.cmdstats.items()):
        usec = ns // 1000
        fields[f"cmdstat_{name}"] = (f"calls={calls},usec={usec},usec_per_call={usec / calls if calls else 0:.2f},"
                                     f"rejected_calls={rejected},failed_calls={failed}")
    return fields


def cluster_section(server) -> dict:
    fields = {"cluster_enabled": int(server.cluster is not None)}
    if server.cluster_services is not None:
        fields.update(server.cluster_services.info())     # hot copies and slot moves
    return fields


def keyspace_section(server) -> dict:
    engine = server.engine
    if not engine.index:
        return {}
    return {"db0": f"keys={len(engine.index)},expires={len(engine.expiry.deadlines)},avg_ttl={average_ttl_ms(engine)}"}


def average_ttl_ms(engine) -> int:
    """Mean time to live, in ms, of the keys with an expiry (Redis's avg_ttl; 0 when none).

    Redis estimates it from the keys its expiry cycle samples; here every
    deadline sits in one dict of ints, so the exact mean is one pass in C
    (about 9 ns a key), paid only when INFO is asked. Keys past their
    deadline that active expiry has not reached yet pull it down a little.
    """
    expires = engine.expiry.deadlines
    if not expires:
        return 0
    return max(0, sum(expires.values()) // len(expires) - now_ms())


def kvcache_section(server) -> dict:
    engine = server.engine
    alloc = engine.allocator
    return {"kv_hits": engine.stats.hits, "kv_misses": engine.stats.misses,
            "dram_capacity": alloc.capacity, "dram_used": alloc.used, "dram_values": len(engine.index),
            "dram_value_bytes": engine.value_bytes, "dram_largest_free_extent": alloc.largest_free(),
            "dram_internal_fragmentation": f"{alloc.internal_fragmentation():.4f}",
            "dram_external_fragmentation": f"{alloc.external_fragmentation():.4f}",
            "dram_prefault_seconds": f"{engine.arena.prefault_seconds:.3f}",
            "arena_page_size": engine.arena.page_size, "arena_hugepages": engine.arena.hugepages,
            "metadata_bytes_per_key": f"{engine.metadata_bytes_per_key():.1f}"}


def _tier_stats(server, tier: int) -> dict:
    """Hits and misses per tier: a read misses a tier when it has to go below it."""
    engine = server.engine
    tiers = server.tiers
    if tiers is None:
        return {"hits": engine.stats.hits, "misses": engine.stats.misses} if tier == DRAM else {}
    lower = tiers.stats[SSD].hits + tiers.stats[GPU].hits
    st = tiers.stats[tier]
    hits, misses = st.hits, st.misses + engine.stats.misses
    if tier == DRAM:
        hits, misses = engine.stats.hits - lower, engine.stats.misses + lower
    return {"hits": hits, "misses": misses, "promotions": st.promotions, "demotions": st.demotions,
            "evictions": st.evictions, "checksum_failures": st.checksum_failures, "errors": st.errors}


def _tier_section(server, prefix: str, tier: int, fields: dict) -> dict:
    """A tier's own fields, then its movement counters, all named ``<prefix>_<field>``."""
    fields = {**fields, "values": server.engine.tier_counts()[tier], **_tier_stats(server, tier)}
    return {f"{prefix}_{k}": v for k, v in fields.items()}


def dram_section(server) -> dict:
    engine = server.engine
    section = _tier_section(server, "dram", DRAM, {"capacity": engine.limit, "used": engine.allocator.used,
                                                   "value_bytes": engine.tier_bytes[DRAM]})
    if server.tiers is None:
        section["dram_evictions"] = engine.stats.evictions
    return section


def ssd_section(server) -> dict:
    tiers = server.tiers
    if tiers is None or tiers.ssd is None:
        return {"ssd_enabled": 0}
    ssd = tiers.ssd
    return _tier_section(server, "ssd", SSD, {
        "enabled": 1, "capacity": ssd.capacity_bytes, "used": ssd.used_bytes, "records": ssd.count,
        "compression_ratio": f"{ssd.compression_ratio:.3f}", "recovered": tiers.recovered,
        "loading": int(tiers.loading), "write_stalls": ssd.write_stalls})


def gpu_section(server) -> dict:
    tiers = server.tiers
    if tiers is None or tiers.gpu is None:
        return {"gpu_enabled": 0}
    gpu = tiers.gpu
    return _tier_section(server, "gpu", GPU, {"enabled": 1, "device": gpu.device_id,
                                              "capacity": gpu.capacity_bytes, "used": gpu.used_bytes})


def tenants_section(server) -> dict:
    """``tenant_<user>:used_dram=...,quota_dram=...,used_ssd=...,quota_ssd=...`` per tenant (quota
    ``none`` when it has none in that tier), then the shared pool's bytes; empty without tenants."""
    report = server.engine.quotas.report()
    if len(report) == 1:
        return {}
    section = {}
    for name, used, quota in report[1:]:
        section[f"tenant_{name}"] = ",".join(
            f"used_{word}={used[tier]},quota_{word}={'none' if quota[tier] == NO_QUOTA else quota[tier]}"
            for word, tier in QUOTA_TIERS.items())
    shared = report[0][1]
    section["shared_pool"] = ",".join(f"used_{word}={shared[tier]}" for word, tier in QUOTA_TIERS.items())
    return section


SECTIONS = {"server": server_section, "clients": clients_section, "memory": memory_section,
            "stats": stats_section, "replication": replication_section, "cpu": cpu_section,
            "commandstats": commandstats_section, "cluster": cluster_section, "keyspace": keyspace_section, "kvcache": kvcache_section,
            "gpu": gpu_section, "dram": dram_section, "ssd": ssd_section, "tenants": tenants_section}

TITLES = {"kvcache": "KVCache", "gpu": "GPU", "dram": "DRAM", "ssd": "SSD", "cpu": "CPU", "commandstats": "Commandstats"}


def collect(server, names=DEFAULT_SECTIONS) -> dict[str, dict]:
    """Section name -> fields, for INFO and the metrics endpoint."""
    return {name: SECTIONS[name](server) for name in names}


def render(server, wanted: list[str]) -> str:
    """The INFO text for the named sections, each once, in Redis's order: none or 'default'
    means the default ones, 'all' and 'everything' add commandstats."""
    chosen = set(wanted)
    if not wanted or "default" in chosen:
        chosen |= set(INFO_DEFAULT)
    if chosen & {"all", "everything"}:
        chosen |= set(INFO_ALL)
    names = [name for name in INFO_ALL if name in chosen]
    parts = []
    for name, fields in collect(server, names).items():
        lines = [f"# {TITLES.get(name, name.capitalize())}"]
        lines += [f"{k}:{v}" for k, v in fields.items()]
        parts.append("\r\n".join(lines) + "\r\n")
    return "\r\n".join(parts)
