"""Registering the node's arena for DMA (the CUDA copier's ``attach_arena``), on CPU.

The driver calls are the only part that needs a GPU; the bookkeeping around them runs
here with recording stand-ins for ``cudaHostRegister``/``cudaHostUnregister``: ranges
of at most the limit, all-or-nothing, copies drained before anything is unregistered.
vLLM's own helper is also called for real: on this CPU platform it registers nothing,
and the registry says so.
"""

from __future__ import annotations

import numpy as np

from tierstore.vllm.host_register import HostRegistry


class _Driver:
    """Records (un)registrations; refuses the ``fail_at``-th registration."""

    def __init__(self, fail_at: int | None = None, raises: bool = False) -> None:
        self.calls: list[tuple[str, int, int]] = []
        self.fail_at = fail_at
        self.raises = raises

    def register(self, ptr: int, nbytes: int) -> bool:
        self.calls.append(("register", ptr, nbytes))
        if self.fail_at is not None and sum(c[0] == "register" for c in self.calls) == self.fail_at:
            if self.raises:
                raise RuntimeError("driver said no")
            return False
        return True

    def unregister(self, ptr: int) -> None:
        self.calls.append(("unregister", ptr, 0))

    def quiesce(self) -> None:
        self.calls.append(("quiesce", 0, 0))


def _registry(driver: _Driver, max_bytes: int = 4096) -> HostRegistry:
    return HostRegistry(
        driver.quiesce, helpers=(driver.register, driver.unregister), max_bytes=max_bytes
    )


def test_an_arena_is_registered_in_ranges_and_unregistered_after_its_copies() -> None:
    arena = np.zeros(10_000, dtype=np.uint8)
    base = arena.ctypes.data
    driver = _Driver()
    registry = _registry(driver)
    assert not registry.active()
    assert registry.register(arena)
    assert registry.register(arena)  # once per worker: a second call registers nothing
    assert driver.calls == [
        ("register", base, 4096),
        ("register", base + 4096, 4096),
        ("register", base + 8192, 10_000 - 8192),
    ]
    assert registry.active() and registry.registered(arena)
    assert registry.range_bytes == 4096  # where the copier cuts its DMA runs
    driver.calls.clear()
    registry.unregister(arena)
    assert driver.calls == [
        ("quiesce", 0, 0),  # every queued copy done first
        ("unregister", base + 8192, 0),
        ("unregister", base + 4096, 0),
        ("unregister", base, 0),
    ]
    assert not registry.active()
    driver.calls.clear()
    registry.unregister(arena)  # idempotent: nothing left to wait for or unregister
    assert driver.calls == []


def test_a_refused_range_rolls_back_the_ones_before_it() -> None:
    for raises in (False, True):
        arena = np.zeros(10_000, dtype=np.uint8)
        base = arena.ctypes.data
        driver = _Driver(fail_at=3, raises=raises)
        registry = _registry(driver)
        assert not registry.register(arena)
        assert driver.calls[3:] == [("unregister", base + 4096, 0), ("unregister", base, 0)]
        assert not registry.active()


def test_an_empty_mapping_is_not_registered() -> None:
    driver = _Driver()
    assert not _registry(driver).register(np.empty(0, dtype=np.uint8))
    assert driver.calls == []


def test_vllms_helper_on_a_cpu_platform_registers_nothing() -> None:
    calls: list[str] = []
    registry = HostRegistry(lambda: calls.append("quiesce"))
    arena = np.zeros(1 << 16, dtype=np.uint8)
    assert not registry.register(arena)  # vLLM: "not implemented on cpu"
    assert not registry.active()
    registry.unregister(arena)
    assert calls == []
