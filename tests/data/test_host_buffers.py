"""Reusable job buffers: reused only when every view is gone and the device copy is done."""

from __future__ import annotations

import gc
import threading

import numpy as np

from tierstore.data.host_buffers import HostBuffers


def _buffers(min_segment: int = 1 << 20) -> tuple[HostBuffers, list[int]]:
    made: list[int] = []

    def allocate(n: int) -> np.ndarray:
        made.append(n)
        return np.zeros(n, dtype=np.uint8)

    return HostBuffers(allocate, min_segment_bytes=min_segment), made


def _addr(a: np.ndarray) -> int:
    return a.ctypes.data


def test_a_released_buffer_is_reused_and_no_segment_is_added() -> None:
    buffers, made = _buffers()
    first = buffers.take(300_000)
    where = _addr(first)
    del first
    second = buffers.take(300_000)
    assert _addr(second) == where
    assert made == [1 << 20]


def test_a_slice_that_outlives_its_buffer_keeps_the_bytes_reserved() -> None:
    buffers, _ = _buffers()
    first = buffers.take(4096)
    first[:] = 7
    piece = first[100:200]  # e.g. a chunk the worker still hashes
    del first
    gc.collect()
    others = [buffers.take(4096) for _ in range(8)]
    for other in others:
        other[:] = 0
    assert (piece == 7).all()


def test_a_buffer_waits_for_its_device_copy_before_reuse() -> None:
    buffers, _ = _buffers(min_segment=8192)
    copy_done = threading.Event()
    first = buffers.take(8192, ready=copy_done.is_set)
    where = _addr(first)
    del first
    second = buffers.take(8192)  # the copy may still write there: not reused
    assert _addr(second) != where
    del second
    copy_done.set()
    assert _addr(buffers.take(8192)) == where


def test_segments_double_when_jobs_in_flight_need_room_and_are_kept() -> None:
    buffers, made = _buffers()
    held = [buffers.take(700_000) for _ in range(3)]
    assert made == [1 << 20, 1 << 20, 2 << 20]
    assert all(len(h) == 700_000 for h in held)
    del held
    again = [buffers.take(700_000) for _ in range(3)]  # reclaimed: nothing allocated
    assert made == [1 << 20, 1 << 20, 2 << 20]
    assert len({_addr(a) for a in again}) == 3


def test_adjacent_free_extents_coalesce() -> None:
    buffers, made = _buffers()
    parts = [buffers.take(256 << 10) for _ in range(4)]  # fills the 1 MiB segment
    del parts
    whole = buffers.take(1 << 20)
    assert len(whole) == 1 << 20
    assert made == [1 << 20]
