"""Fast-path commands: map the arena, lease values, reserve and publish extents.

The socket carries only these small control messages; the bytes move through
the client's own mapping of the DRAM arena (see kvstore/local/leases.py for why
everything a client holds has an id, an owner and a deadline).

    KV.ARENA                             -> [size, pid, fd, id offset, id token, fds passed,
                                             validity words fd, number of words,
                                             shared index fd, number of buckets]
    KV.LEASE token ttl_ms key [key ...]  -> per key: [lease id, offset, size, word, tag, hold ms] or nil
    KV.RELEASE id [id ...]               -> per lease: 1 if it was valid until released, else 0
    KV.RESERVE token ttl_ms size [...]   -> per size: [reservation id, offset]
    KV.PUBLISH id key [PARENT p] [NX] [NEXT ttl_ms]
                                         -> 1 stored, 0 key existed under NX (extent given back);
                                            with NEXT: [that, [reservation id, offset] or an error]
    KV.MPUBLISH NX|OVERWRITE id key parent [id key parent ...]
                                         -> per value: as KV.PUBLISH, or an error (EXPIRED);
                                            parent "" for none
    KV.UNRESERVE id [id ...]             -> how many reservations were given back
    KV.TOUCH key [key ...]               -> how many of the keys exist (each counted as a read hit)
    KV.LEASES                            -> lease, reservation, partial-block and shared index counters
    KV.GPUARENA                          -> [device, PCI bus id, CUDA IPC handle, size, generation]
                                            or nil without a GPU tier
    KV.LEASEGPU token gen ttl_ms key [...] -> per key: [lease id, tier, offset, size, word, tag, header]
                                            or nil (header: a GPU value's first 128 bytes)

How a client maps the arena: over the Unix socket the arena's memfd comes
with the KV.ARENA reply (SCM_RIGHTS), and with it the lease table's validity
words (kvstore/local/leases.py: a lease is valid while its word holds its tag) and
the shared index (kvstore/local/shared_index.py: where each DRAM value is, so a
first get needs no KV.LEASE; the first KV.ARENA starts publishing it); over
TCP a client on the same host opens ``/proc/<pid>/fd/<fd>`` for each (same
user). Either way it then checks the
16-byte token written at the id offset, so a client that reached a node on
another host (where the pid means nothing) finds no match and stays on the
wire.

A writer puts values of a few sizes over and over, so KV.PUBLISH can reserve
the extent of the next put of the same size in the same command (NEXT): one
command to parse and dispatch per put instead of two (the node's part of a
put, alternating after a 1 MiB copy: 70.8 -> 64.2 us). The published
reservation vouches for the client's mapping (a restarted node knows no
reservation of the old one). A spare the node has no room for now is an error
in its place (NOSPARE): the value is published all the same, and the client's
next put reserves with KV.RESERVE, which may make room by demoting or
evicting.

A batch of puts commits with one KV.MPUBLISH: parsing and dispatching a
command costs the node more than committing a value, so a batch of 256
values pays for one command instead of 256 (10.7 -> 5.4 ms, same A/B).

Commands that hand out arena offsets take the client's arena token first: a
client still holding the mapping of a node that has since restarted (a new
arena) gets ``-STALEARENA`` instead of offsets into memory it no longer
shares with the node, and maps the arena again.

The GPU arena is named the same way: KV.GPUARENA gives the device's PCI bus
id (the client's device numbers may differ from the node's) and the arena's
generation, and KV.LEASEGPU takes the generation back after the arena token
(empty on a node without a GPU tier); any other answers ``-STALEGPU``, and the
client opens the GPU arena again. A GPU value's lease also holds its device
extent: until the lease ends the extent is neither freed nor reused, so a
copy made while the lease's validity word still held its tag is one whole
value (the client then releases it with its next request, as after a DRAM
read). The lease hands out the value's first bytes (a tensor's header, kept
in host memory), so the client checks the destination without a device read.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import NamedTuple, NoReturn

from kvstore.commands.args import check_arena_token, option_map, parse_ids, parse_int, parse_ttl_ms
from kvstore.commands.table import CommandError, Family
from kvstore.net.protocol import writer
from kvstore.store.engine import GPU, SSD, STAGED, OutOfMemory
from proto import fastpath as fp

FAMILY = Family()

@FAMILY.command(fp.KV_ARENA, 1, "fast", "fastpath", "Describes the DRAM arena for a local mapping; "
         "passes its fd over a Unix socket.", keys=(0, 0, 0))
def kv_arena(conn, args):
    arena, words, index = conn.engine.arena, conn.server.leases.words, conn.server.shared_index
    offset, token = conn.server.arena_identity
    index.activate()
    passed = conn.sock.family == socket.AF_UNIX
    if passed:
        conn.attach_fds([arena.fd, words.fd, index.fd])
    tiers = conn.tiers
    ssd_dir = os.path.abspath(tiers.ssd.path).encode() if tiers is not None and tiers.ssd is not None else b""
    return writer.array([writer.integer(arena.size), writer.integer(os.getpid()), writer.integer(arena.fd),
                         writer.integer(offset), writer.bulk(token), writer.integer(int(passed)),
                         writer.integer(words.fd), writer.integer(words.count),
                         writer.integer(index.fd), writer.integer(index.buckets), writer.bulk(ssd_dir)])


def _lease_reads(conn, args: list) -> list[bytes]:
    return args[3:]


@FAMILY.command(fp.KV_LEASE, -4, "readonly fast", "fastpath",
         "Pins values for a direct read from the arena; per key [lease id, offset, size, word, tag, "
         "hold ms] or nil.",
         keys=(3, -1, 1), spans_slots=True, reads=_lease_reads)
def kv_lease(conn, args):
    check_arena_token(conn, args[1])
    ttl = parse_ttl_ms(args[2])
    table = conn.server.leases
    leases = [dram_lease(conn, table, key, ttl) for key in args[3:]]
    if any(lease is not None and lease.offset is None for lease in leases):
        refuse_outside_arena(table, [lease.id for lease in leases if lease is not None])
    return writer.array([conn.enc.null if lease is None else writer.array(
        [writer.integer(lease.id), writer.integer(lease.offset), writer.integer(lease.nbytes),
         writer.integer(lease.word), writer.integer(lease.tag), writer.integer(hold_ms(conn, key, ttl))])
        for key, lease in zip(args[3:], leases)])


def refuse_outside_arena(table, granted: list[int]) -> NoReturn:
    """Refuse a lease command because a value is not in the arena.

    A value read up from SSD while DRAM is full of values that exist nowhere
    else is staged on the heap for this one command, where no client can map
    it. The leases the command already granted end, and the client reads over
    the socket instead (the NOTINARENA error tells it to).
    """
    for lease_id in granted:
        table.release(lease_id)
    raise CommandError("a value is staged outside the shared arena; read it over the socket", "NOTINARENA")


def hold_ms(conn, key: bytes, ttl_ms: int) -> int:
    """How long a client may keep copying under a lease (a cached lease) after asking for it.

    Half the lease's life, so it is renewed or given up well before its deadline; 0 (use it
    for this read only) when the key has an expiry time: an expired key leaves the index
    only when it is next looked up, and a cached lease would not look.
    """
    return 0 if key in conn.engine.expiry.deadlines else ttl_ms // 2


@dataclass(slots=True)
class DramLease:
    id: int
    offset: int
    nbytes: int
    word: int
    tag: int


def dram_lease(conn, table, key: bytes, ttl_ms: int) -> DramLease | None:
    """Lease the DRAM copy of ``key`` (ended early if the value leaves the index), or None when absent."""
    engine = conn.engine
    entry = engine.get_entry(key)
    if entry is None:
        return None
    size = engine.size_of(entry)
    token = engine.holds.hold(entry)
    lease = table.grant(conn, size, ttl_ms, lambda: engine.holds.release(token), entry=entry)
    return DramLease(lease.id, token, size, lease.word, lease.tag)


@FAMILY.command(fp.KV_RELEASE, -2, "fast", "fastpath",
         "Ends leases; per lease 1 when it was still valid, 0 when it had expired or was reclaimed.",
         keys=(0, 0, 0))
def kv_release(conn, args):
    table = conn.server.leases
    return writer.array([writer.ONE if table.release(i) else writer.ZERO for i in parse_ids(args[1:])])


@FAMILY.command(fp.KV_RESERVE, -4, "write denyoom fast", "fastpath",
         "Reserves arena extents for direct writes; per size [reservation id, offset].", keys=(0, 0, 0))
def kv_reserve(conn, args):
    check_arena_token(conn, args[1])
    ttl = parse_ttl_ms(args[2])
    sizes = [parse_int(a, "sizes are non-negative integers") for a in args[3:]]
    if any(size < 0 for size in sizes):
        raise CommandError("sizes are non-negative integers")
    table, made = conn.server.leases, []
    try:
        for size in sizes:
            made.append(table.reserve(conn, size, ttl))
    except Exception:
        for reservation in made:
            table.cancel(reservation.id)
        raise
    return writer.array([writer.array([writer.integer(r.id), writer.integer(r.extent.offset)]) for r in made])


PUBLISH_OPTIONS = {b"PARENT": 1, b"NX": 0, b"NEXT": 1}
EXPIRED = ("reservation expired or unknown", "EXPIRED")


@FAMILY.command(fp.KV_PUBLISH, -3, "write fast", "fastpath",
         "Commits a written reservation as the value of a key; NX keeps an existing value; NEXT reserves "
         "another extent of its size.", keys=(2, 2, 1))
def kv_publish(conn, args):
    reservation_id = parse_int(args[1], "lease and reservation ids are integers")
    key, opts = args[2], option_map(args, 3, PUBLISH_OPTIONS) if len(args) > 3 else {}
    next_ttl = parse_ttl_ms(opts[b"NEXT"]) if b"NEXT" in opts else None     # checked before anything changes
    reservation = conn.server.leases.take(reservation_id)
    if reservation is None:
        raise CommandError(*EXPIRED)
    stored = _commit(conn, reservation, key, opts.get(b"PARENT"), b"NX" in opts)
    return stored if next_ttl is None else writer.array([stored, _spare(conn, reservation.extent.size, next_ttl)])


@FAMILY.command(fp.KV_MPUBLISH, -5, "write fast", "fastpath",
         "Commits written reservations as the values of keys (a batch): NX|OVERWRITE id key parent ...; "
         "per value 1, 0 or EXPIRED.", keys=(3, -2, 3), spans_slots=True)
def kv_mpublish(conn, args):
    mode = args[1].upper()
    if mode not in (b"NX", b"OVERWRITE") or (len(args) - 2) % 3:
        raise CommandError("syntax error: KV.MPUBLISH NX|OVERWRITE id key parent [id key parent ...]")
    ids = parse_ids(args[2::3])                      # all checked before anything is committed
    table, replies = conn.server.leases, []
    for reservation_id, key, parent in zip(ids, args[3::3], args[4::3]):
        reservation = table.take(reservation_id)
        replies.append(writer.error(*EXPIRED) if reservation is None
                       else _commit(conn, reservation, key, parent or None, mode == b"NX"))
    return writer.array(replies)


def _commit(conn, reservation, key: bytes, parent: bytes | None, nx: bool) -> bytes:
    """Commit a taken reservation as ``key``'s value (under NX only when the key is absent;
    else its extent goes back): the reply, 1 stored or 0 existed."""
    conn.server.leases.published()
    if nx and conn.engine.lookup(key) is not None:
        conn.engine.release(reservation.extent)
        return writer.ZERO
    conn.engine.commit(key, reservation.extent, parent)
    return writer.ONE


def _spare(conn, size: int, ttl_ms: int) -> bytes:
    """NEXT's extent for the client's next put, or NOSPARE when there is no room without demoting
    (a command that already committed cannot wait for a demotion and run again)."""
    try:
        reservation = conn.server.leases.reserve(conn, size, ttl_ms)
    except OutOfMemory:
        return writer.error("no room for a spare extent now (reserve it with KV.RESERVE)", "NOSPARE")
    return writer.array([writer.integer(reservation.id), writer.integer(reservation.extent.offset)])


@FAMILY.command(fp.KV_UNRESERVE, -2, "write fast", "fastpath", "Gives back reservations that will not be published.",
         keys=(0, 0, 0))
def kv_unreserve(conn, args):
    table = conn.server.leases
    return writer.integer(sum(table.cancel(i) for i in parse_ids(args[1:])))


@FAMILY.command(fp.KV_TOUCH, -2, "readonly fast", "fastpath",
         "Counts reads a local client served from the shared index as hits; how many keys exist.",
         keys=(1, -1, 1), spans_slots=True)
def kv_touch(conn, args):
    engine = conn.engine
    return writer.integer(sum(engine.get_entry(key) is not None for key in args[1:]))


@FAMILY.command(fp.KV_LEASES, 1, "readonly fast", "fastpath",
         "Returns lease, reservation, partial-block and shared index counters.", keys=(0, 0, 0))
def kv_leases(conn, args):
    server = conn.server
    fields = {**server.leases.info(), **server.blocks.info(), **server.shared_index.info()}
    return conn.enc.map([(writer.bulk(k), writer.integer(v)) for k, v in fields.items()])


# --------------------------------------------------------------- GPU tier

def _gpu_tier(conn):
    """The node's GPU tier while it serves (None without one, or once closed)."""
    tiers = conn.tiers
    gpu = None if tiers is None else tiers.gpu
    return gpu if gpu is not None and gpu.generation is not None else None


@FAMILY.command(fp.KV_GPUARENA, 1, "fast", "fastpath",
         "Returns the GPU tier's device, PCI bus id, CUDA IPC handle, size and generation, or nil "
         "without a GPU tier.", keys=(0, 0, 0))
def kv_gpuarena(conn, args):
    gpu = _gpu_tier(conn)
    if gpu is None:
        return conn.enc.null
    return writer.array([writer.integer(gpu.device_id), writer.bulk(gpu.pci_bus_id.encode()),
                         writer.bulk(gpu.ipc_handle()), writer.integer(gpu.capacity_bytes),
                         writer.bulk(gpu.generation)])


def _check_gpu_generation(conn, generation: bytes) -> None:
    """Refuse offsets to a client whose GPU mapping is not of this node's GPU arena."""
    gpu = _gpu_tier(conn)
    if generation != (b"" if gpu is None else gpu.generation):
        raise CommandError("the client's GPU arena mapping is not this node's GPU arena (open it again)",
                           "STALEGPU")


def _ssd_reads(conn, args: list) -> list[bytes]:
    """Only SSD values are brought up first: GPU values are leased where they are."""
    engine = conn.engine
    return [k for k in args[4:] if (entry := engine.lookup(k)) is not None and engine.tier_code(entry) == SSD]


class TierLease(NamedTuple):
    """One key's answer to KV.LEASEGPU: a lease on the value where it lives."""

    id: int
    tier: bytes
    offset: int | None
    nbytes: int
    word: int
    tag: int
    header: bytes              # a GPU value's first bytes (b"" for DRAM: the client reads its mapping)


@FAMILY.command(fp.KV_LEASEGPU, -5, "readonly fast", "fastpath",
         "Pins values where they live; per key [lease id, tier, offset, size, word, tag, header] or nil.",
         keys=(4, -1, 1), spans_slots=True, reads=_ssd_reads)
def kv_leasegpu(conn, args):
    check_arena_token(conn, args[1])
    _check_gpu_generation(conn, args[2])
    ttl = parse_ttl_ms(args[3])
    table, engine, granted = conn.server.leases, conn.engine, []
    for key in args[4:]:
        entry = engine.lookup(key)
        if entry is not None and engine.tier_code(entry) == GPU and not engine.flags_of(entry) & STAGED:
            granted.append(_gpu_lease(conn, table, key, entry, ttl))
        elif (lease := dram_lease(conn, table, key, ttl)) is None:
            granted.append(None)
        else:
            granted.append(TierLease(lease.id, b"dram", lease.offset, lease.nbytes, lease.word, lease.tag, b""))
    if any(g is not None and g.offset is None for g in granted):
        refuse_outside_arena(table, [g.id for g in granted if g is not None])
    return writer.array([conn.enc.null if g is None else writer.array(
        [writer.integer(g.id), writer.bulk(g.tier), writer.integer(g.offset), writer.integer(g.nbytes),
         writer.integer(g.word), writer.integer(g.tag), writer.bulk(g.header)]) for g in granted])


def _gpu_lease(conn, table, key: bytes, entry: int, ttl_ms: int) -> TierLease:
    """Pin a GPU-tier value against demotion and hold its extent; a delete or move shows at release."""
    engine = conn.engine
    tiers = conn.tiers
    engine.get_entry(key)
    offset, size = tiers.hold_gpu_extent(entry), engine.size_of(entry)
    engine.eviction.hold(entry)

    def unpin() -> None:
        tiers.let_go_gpu_extent(offset)
        if engine.index.get(key) == entry:
            engine.eviction.release_hold(entry)

    def unchanged() -> bool:
        return (engine.index.get(key) == entry and engine.tier_code(entry) == GPU
                and tiers.gpu_offset(entry) == offset)

    lease = table.grant(conn, size, ttl_ms, unpin, unchanged)
    return TierLease(lease.id, b"gpu", offset, size, lease.word, lease.tag, tiers.gpu_header(entry))
