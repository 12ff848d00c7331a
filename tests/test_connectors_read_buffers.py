"""ReadBuffers: kept load buffers are reused for loads that fit, and what is kept stays bounded."""
from __future__ import annotations

import numpy as np

from client.connectors.read_buffers import ReadBuffers


def test_a_given_back_buffer_serves_a_load_that_fits_and_the_smallest_fitting_one_is_taken():
    buffers = ReadBuffers(max_buffers=4, max_bytes=1 << 20)
    big, small = buffers.take((4, 1024), np.float32), buffers.take((2, 8), np.float32)
    buffers.give_back(big)
    buffers.give_back(small)
    again = buffers.take((1, 8), np.float32)
    assert np.shares_memory(again, small) and again.shape == (1, 8) and again.flags.c_contiguous
    assert np.shares_memory(buffers.take((3, 1024), np.float32), big)
    assert not np.shares_memory(buffers.take((3, 1024), np.float32), big)      # taken: never handed out twice


def test_what_is_kept_is_bounded_by_count_and_bytes():
    by_count = ReadBuffers(max_buffers=2, max_bytes=1 << 20)
    for array in [by_count.take((n,), np.uint8) for n in (10, 20, 30)]:
        by_count.give_back(array)
    assert sorted(b.nbytes for b in by_count._free) == [20, 30]                  # the smallest went
    by_bytes = ReadBuffers(max_buffers=8, max_bytes=100)
    by_bytes.give_back(by_bytes.take((200,), np.uint8))                          # larger than all it keeps
    for array in [by_bytes.take((n,), np.uint8) for n in (60, 50)]:
        by_bytes.give_back(array)
    assert [b.nbytes for b in by_bytes._free] == [60]


def test_an_array_it_did_not_make_is_not_kept():
    buffers = ReadBuffers(max_buffers=2, max_bytes=1 << 20)
    buffers.give_back(np.empty((4, 4), np.float32))
    assert buffers._free == []
