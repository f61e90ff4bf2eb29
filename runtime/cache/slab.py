"""Slabs: the per-layer, per-tensor MLX arrays that hold expert slots, and handing their pages back.

A slab is one evaluated MLX array [n_slots, *per_expert_shape] plus a writable,
contiguous uint8 numpy view [n_slots, nbytes] of the same memory, which the
loader reads into. release_pages() returns whole pages of a slab to the OS
where the platform allows it (see its docstring) and reports the bytes.
"""

from __future__ import annotations

import functools
import mmap
import sys

import mlx.core as mx
import numpy as np

_MX_DTYPE = {
    "U8": mx.uint8, "U16": mx.uint16, "U32": mx.uint32, "I8": mx.int8, "I16": mx.int16,
    "I32": mx.int32, "F16": mx.float16, "F32": mx.float32,
}


_PAGE = mmap.PAGESIZE


def pages_returnable() -> bool:
    """Whether release_pages() can hand slab memory back to the OS on this platform (Linux only)."""
    return sys.platform.startswith("linux") and _libc() is not None


def release_pages(address: int, nbytes: int) -> int:
    """Give the whole pages inside [address, address + nbytes) back to the OS; returns bytes.

    Linux only: madvise(MADV_DONTNEED) drops private anonymous pages (the slabs'
    malloc'd memory) and maps zero pages on the next touch. On macOS MLX slabs are
    Metal shared buffers, for which madvise does not reliably return memory, so we
    do nothing there and report 0.
    """
    start = -(-address // _PAGE) * _PAGE
    end = (address + nbytes) // _PAGE * _PAGE
    if end <= start or not pages_returnable():
        return 0
    import ctypes

    if _libc() is None or _libc().madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start),
                                          ctypes.c_int(mmap.MADV_DONTNEED)) != 0:
        return 0
    return end - start


@functools.lru_cache(maxsize=1)
def _libc():
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def allocate_slab(n_slots: int, shape: tuple[int, ...], dtype: str) -> tuple[mx.array, np.ndarray]:
    """An evaluated MLX array [n_slots, *shape] and a writable uint8 view [n_slots, nbytes] of it."""
    full = (n_slots, *shape)
    if dtype == "BF16":
        # numpy has no bfloat16: allocate 16-bit storage and view it as bf16 in MLX.
        base = mx.zeros(full, mx.uint16)
        mx.eval(base)
        slab = base.view(mx.bfloat16)
        mx.eval(slab)
        host = np.asarray(base)
    elif dtype in _MX_DTYPE:
        slab = mx.zeros(full, _MX_DTYPE[dtype])
        mx.eval(slab)
        host = np.asarray(slab)
    else:
        raise ValueError(f"cannot allocate a slab of dtype {dtype}; expected one of {sorted(_MX_DTYPE) + ['BF16']}")
    if not (host.flags.writeable and host.flags.c_contiguous):
        raise RuntimeError(f"slab {full} {dtype}: MLX returned a host view that is not writable and contiguous")
    return slab, host.reshape(n_slots, -1).view(np.uint8)


def allocate_table(values: np.ndarray) -> tuple[mx.array, np.ndarray]:
    """An evaluated MLX vector holding `values` (its dtype), and a writable numpy view of it (the
    device-side expert -> slot lookup of a layer, runtime/cache/resident_tables.py)."""
    table = mx.array(values)
    mx.eval(table)
    host = np.asarray(table)
    if not (host.flags.writeable and host.flags.c_contiguous):
        raise RuntimeError("MLX did not give a writable contiguous host view of a slot table")
    return table, host
