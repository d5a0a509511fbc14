"""Large CPU tensors that a kernel fills from scratch (weight gradients).

A fresh allocation of that size comes from the kernel untouched, and its first write pays one
page fault per 4 KB page: for the 1.6 GB weight gradient of a 128-expert layer that fault cost,
not the kernel, was most of the backward at decode. Asking for transparent huge pages
(madvise MADV_HUGEPAGE, honoured where /sys/kernel/mm/transparent_hugepage/enabled is `always`
or `madvise`) makes it one fault per 2 MB. A hint only: where the kernel refuses it, nothing
changes. torch's own allocator does the same for every allocation under THP_MEM_ALLOC_ENABLE=1.

Even on huge pages the kernel clears every fresh page before the first write (about half of a
bf16 weight-gradient launch at 64 tokens over 64 experts), and where physical memory is
fragmented (after many small allocations) the huge-page faults compact memory first. So the
weight gradients come from a pool (``GradientBuffers``): a buffer torch has let go of (no tensor
or storage refers to it any more: the optimizer's ``zero_grad()`` sets every ``.grad`` to None)
is handed out again instead of fresh memory, as torch's caching allocators do on GPUs. The pool
keeps what it has handed out, at most the peak of gradients alive at once;
``moe_xpu.release_gradient_buffers()`` gives it back, ``MOE_XPU_GRAD_BUFFERS=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading

import torch

_HUGE_PAGE = 1 << 21
_MADV_HUGEPAGE = 14
# Below a few huge pages the faults cost little and the tensor may share its pages with the heap.
_MIN_BYTES = 8 * _HUGE_PAGE

_libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def advise_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """Ask for huge pages behind the whole 2 MB pages of a large CPU tensor not yet written.
    Returns t."""
    nbytes = t.untyped_storage().nbytes()
    if _libc is None or t.device.type != "cpu" or nbytes < _MIN_BYTES:
        return t
    start = t.untyped_storage().data_ptr()
    lo = (start + _HUGE_PAGE - 1) & ~(_HUGE_PAGE - 1)
    hi = (start + nbytes) & ~(_HUGE_PAGE - 1)
    if hi > lo:
        _libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), _MADV_HUGEPAGE)
    return t


def empty_strided_for_write(size, stride, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.empty_strided, with huge pages asked for when it is a large CPU tensor."""
    return advise_huge_pages(torch.empty_strided(size, stride, dtype=dtype, device=device))


def _storage_references(t: torch.Tensor) -> tuple[int, int] | None:
    """What refers to t's storage: the C++ use count (tensors and views; on torch 2.8 also Python
    storage objects) and the Python reference count of its storage object (torch 2.13 keeps one
    Python object per storage, which the use count does not see). None where torch does not say."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    if count is None:
        return None
    storage = t.untyped_storage()
    return count(storage._cdata), sys.getrefcount(storage)


class GradientBuffers:
    """Large CPU weight-gradient buffers handed out again once torch has let go of them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pool: dict[tuple, list[torch.Tensor]] = {}
        # What the count reads for a buffer only the pool refers to (torch versions differ by
        # the Python storage object the query itself makes).
        self._free_count = _storage_references(torch.empty(1))

    def enabled(self) -> bool:
        return self._free_count is not None and os.environ.get("MOE_XPU_GRAD_BUFFERS", "1") != "0"

    def empty_strided(self, size, stride, *, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised CPU tensor: a free pooled buffer of the same size, stride and dtype, or
        a new one (kept in the pool). Small tensors and a disabled pool get plain fresh memory."""
        size, stride = tuple(size), tuple(stride)
        nbytes = (1 + sum((n - 1) * s for n, s in zip(size, stride))) * dtype.itemsize
        if not self.enabled() or nbytes < _MIN_BYTES or 0 in size:
            return empty_strided_for_write(size, stride, dtype=dtype, device=torch.device("cpu"))
        key = (size, stride, dtype)
        with self._lock:
            buffers = self._pool.setdefault(key, [])
            for buffer in buffers:
                if _storage_references(buffer) == self._free_count:
                    return buffer.as_strided(size, stride)  # a new tensor: the pool's stays its own
            buffer = empty_strided_for_write(size, stride, dtype=dtype, device=torch.device("cpu"))
            buffers.append(buffer)
            return buffer.as_strided(size, stride)

    def _held_bytes_locked(self) -> int:
        return sum(b.untyped_storage().nbytes() for buffers in self._pool.values() for b in buffers)

    def held_bytes(self) -> int:
        with self._lock:
            return self._held_bytes_locked()

    def release(self) -> int:
        """Drops the pool's references (buffers still in use stay with their users); returns the
        bytes the pool held."""
        with self._lock:
            held = self._held_bytes_locked()
            self._pool.clear()
            return held


gradient_buffers = GradientBuffers()


def release_gradient_buffers() -> int:
    """Gives the memory of moe_xpu's pooled CPU weight-gradient buffers back (those no gradient
    uses any more are freed; those in use are freed with their last tensor). Returns the bytes the
    pool held."""
    return gradient_buffers.release()
