"""Large CPU tensors that a kernel fills from scratch (weight gradients).

A fresh allocation of that size comes from the kernel untouched, and its first write pays one
page fault per 4 KB page: for the 1.6 GB weight gradient of a 128-expert layer that fault cost,
not the kernel, was most of the backward at decode. Asking for transparent huge pages
(madvise MADV_HUGEPAGE, honoured where /sys/kernel/mm/transparent_hugepage/enabled is `always`
or `madvise`) makes it one fault per 2 MB. A hint only: where the kernel refuses it, nothing
changes. torch's own allocator does the same for every allocation under THP_MEM_ALLOC_ENABLE=1.
"""

from __future__ import annotations

import ctypes
import sys

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
