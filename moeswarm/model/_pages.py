"""Giving a memory-mapped array's pages back once a copy built from it holds its values."""

from __future__ import annotations

import mmap
from collections.abc import Iterable

import numpy as np


def release_pages(a: object) -> None:
    """``MADV_DONTNEED`` over the whole pages of ``a`` inside its file mapping (an ``np.memmap`` base), if it is
    a contiguous view of one: RSS stops counting them, the file keeps them (a later read faults them back).
    Used once a kernel or a float32 copy holds a stored tensor's values, so RSS counts the copy, not both."""
    if not isinstance(a, np.ndarray) or a.size == 0 or not a.flags.c_contiguous:
        return
    base = a
    while base is not None and not isinstance(base, np.memmap):
        base = base.base  # type: ignore[assignment]
    mm = getattr(base, "_mmap", None)
    if mm is None:
        return
    origin = np.frombuffer(mm, np.uint8).__array_interface__["data"][0]
    low = a.__array_interface__["data"][0] - origin
    start, end = -(-low // mmap.PAGESIZE) * mmap.PAGESIZE, (low + a.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
    if end > start:
        mm.madvise(mmap.MADV_DONTNEED, start, end - start)


def release_stored(tensors: Iterable[object]) -> None:
    """Each stored tensor's mapped pages leave the process (``release_pages`` of a ``QuantizedTensor``), once a
    kernel holds its values and the stored bytes are not read again (the file keeps them)."""
    for a in tensors:
        release = getattr(a, "release_pages", None)
        if release is not None:
            release()
