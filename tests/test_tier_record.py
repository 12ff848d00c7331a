"""Unit tests for the on-SSD record format (kvstore/tiers/record.py): no processes."""
from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.tiers import CorruptValue, TierError
from kvstore.tiers.record import (HEADER, HEADER_V1, KEEP_RATIO, MAGIC, MAX_TENANT_LEN, Flags, RecordHeader,
                                  decode, decode_into, encode, shuffle_bytes, unshuffle_bytes)


def bf16_noise(n_values: int, seed: int = 0) -> np.ndarray:
    """Normal noise truncated to bf16, as a KV tensor looks to a byte compressor."""
    floats = np.random.default_rng(seed).standard_normal(n_values).astype(np.float32)
    return (floats.view(np.uint32) >> 16).astype(np.uint16)


@pytest.mark.parametrize("tenant", [None, b"alice", b"\xff" * MAX_TENANT_LEN])
def test_header_round_trip_with_and_without_parent_and_tenant(tenant):
    for parent in (None, b"p" * 16):
        header = RecordHeader(Flags.LZ4 | Flags.SHUFFLE, 4096, 1000, 0xDEADBEEF, parent, tenant)
        raw = header.pack()
        assert len(raw) == header.size == HEADER.size + len(parent or b"") + len(tenant or b"")
        assert RecordHeader.unpack(raw) == header


def test_a_header_written_before_tenants_is_read_as_the_shared_pool():
    for parent in (None, b"p" * 16):
        raw = HEADER_V1.pack(MAGIC, 1, Flags.LZ4, len(parent or b""), 4096, 1000, 7) + (parent or b"")
        assert RecordHeader.unpack(raw) == RecordHeader(Flags.LZ4, 4096, 1000, 7, parent, None)


def test_a_tenant_name_too_long_for_the_header_is_refused():
    with pytest.raises(TierError, match="tenant name"):
        encode(b"v", tenant=b"t" * (MAX_TENANT_LEN + 1))


@pytest.mark.parametrize("mangle", [
    lambda raw: b"XY" + raw[2:],              # magic
    lambda raw: raw[:2] + b"\x09" + raw[3:],  # version
    lambda raw: raw[:3] + b"\x80" + raw[4:],  # unknown flag
    lambda raw: raw[:-1],                     # tenant cut short
    lambda raw: raw + b"x",                   # a byte past the tenant
    lambda raw: raw[:10],                     # header cut short
])
def test_unpack_rejects_what_is_not_a_header(mangle):
    raw = RecordHeader(Flags.LZ4, 100, 50, 7, b"parent", b"alice").pack()
    with pytest.raises(CorruptValue):
        RecordHeader.unpack(mangle(raw))


def test_unpack_rejects_inconsistent_sizes():
    with pytest.raises(CorruptValue):
        RecordHeader.unpack(RecordHeader(Flags.NONE, 100, 99, 7).pack())
    with pytest.raises(CorruptValue):
        RecordHeader.unpack(RecordHeader(Flags.LZ4 | Flags.SHUFFLE, 101, 50, 7).pack())


def test_random_bytes_are_stored_raw_without_a_copy():
    value = os.urandom(1 << 20)
    header, payload = encode(value, b"parent")
    assert header.flags == Flags.NONE
    assert payload is value
    assert header.verify(payload)
    assert decode(header, payload) == value


def test_text_is_compressed_plainly():
    value = b"the quick brown fox jumps over the lazy dog. " * 5000
    header, payload = encode(value)
    assert header.flags == Flags.LZ4
    assert len(payload) < KEEP_RATIO * len(value)
    assert decode(header, payload) == value


def test_bf16_noise_compresses_only_when_shuffled():
    tensor = bf16_noise(1 << 19)
    plain, _ = encode(tensor, shuffle=False)
    shuffled, payload = encode(tensor, shuffle=True)
    assert plain.flags == Flags.NONE
    assert shuffled.flags == Flags.LZ4 | Flags.SHUFFLE
    assert shuffled.stored_size < KEEP_RATIO * tensor.nbytes
    assert decode(shuffled, payload) == tensor.tobytes()


def test_compression_off_stores_raw():
    value = b"a" * 100_000
    header, payload = encode(memoryview(value), compress=False)
    assert header.flags == Flags.NONE and payload == value


def test_decode_into_writes_the_value_and_leaves_the_rest():
    tensor = bf16_noise(50_000, seed=1)
    for compress in (True, False):
        header, payload = encode(tensor, compress=compress)
        out = bytearray(b"\xff" * (tensor.nbytes + 8))
        assert decode_into(header, payload, out) == tensor.nbytes
        assert out[:tensor.nbytes] == tensor.tobytes()
        assert out[tensor.nbytes:] == b"\xff" * 8


def test_decode_into_a_short_buffer_is_refused():
    header, payload = encode(b"x" * 100)
    with pytest.raises(ValueError):
        decode_into(header, payload, bytearray(99))


def test_verify_catches_one_flipped_bit():
    header, payload = encode(os.urandom(4096))
    damaged = bytearray(payload)
    damaged[1234] ^= 0x10
    assert not header.verify(bytes(damaged))
    assert not header.verify(payload[:-1])


def test_wrong_value_size_in_a_compressed_header_is_corrupt():
    header, payload = encode(b"abc" * 10_000)
    assert header.flags & Flags.LZ4
    lying = RecordHeader(header.flags, header.value_size + 1, header.stored_size,
                         header.checksum, header.parent)
    with pytest.raises(CorruptValue):
        decode(lying, payload)


def test_oversized_parent_is_refused():
    with pytest.raises(TierError):
        encode(b"v", b"p" * 70_000)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=5000), st.booleans(), st.booleans(),
       st.one_of(st.none(), st.binary(min_size=1, max_size=40)))
def test_any_value_round_trips(value, compress, shuffle, parent):
    header, payload = encode(value, parent, compress=compress, shuffle=shuffle)
    header = RecordHeader.unpack(header.pack())
    assert header.verify(payload)
    assert header.parent == parent
    assert decode(header, payload) == value
    out = bytearray(len(value))
    assert decode_into(header, payload, out) == len(value) and out == value


@given(st.binary(max_size=2000).filter(lambda b: len(b) % 2 == 0))
def test_shuffle_is_its_own_inverse(data):
    assert unshuffle_bytes(shuffle_bytes(data)) == data
