"""Dropping page-cache copies of loaded bytes (storage/file_pages.py), checked against the kernel's own view
(mincore on a mapping of the file): --io-mode direct drops the resident tensors' pages once the model holds
them, and a drafter's; buffered leaves them (the contrast shows the check can fail)."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import sys

import pytest

from runtime.decode.offloaded_model import OffloadConfig, OffloadedModel
from storage import ExpertStore, drop_pages

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="posix_fadvise and mincore: Linux")

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


def cached_share(path, offset: int = 0, nbytes: int | None = None) -> float:
    """The share of [offset, offset + nbytes) of `path` that sits in the page cache (the kernel's mincore)."""
    size = os.path.getsize(path)
    nbytes = size - offset if nbytes is None else nbytes
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert addr not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        try:
            pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
            vec = (ctypes.c_ubyte * pages)()
            assert _libc.mincore(addr, size, vec) == 0, os.strerror(ctypes.get_errno())
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)
    first, last = offset // mmap.PAGESIZE, (offset + nbytes - 1) // mmap.PAGESIZE
    return sum(vec[i] & 1 for i in range(first, last + 1)) / (last - first + 1)


def warm(path) -> None:
    """Read the file through the page cache; written back first (advice drops clean pages only)."""
    with open(path, "rb") as f:
        os.fsync(f.fileno())
        while f.read(1 << 20):
            pass


def resident_spans(model_dir) -> list[tuple[str, int, int]]:
    """(file, offset, nbytes) of every resident (non-expert) tensor of the checkpoint."""
    store = ExpertStore.open(model_dir)
    try:
        return [(store.resident_file(n), e.offset, e.nbytes) for n, e in store.resident_tensors().items()]
    finally:
        store.close()


def resident_share(spans) -> float:
    """The page-cached share of these spans' bytes."""
    total = sum(n for _, _, n in spans)
    return sum(cached_share(f, o, n) * n for f, o, n in spans) / total


def require_evictable(path) -> None:
    """Skip where the file system keeps clean pages on advice (tmpfs: the checks would mean nothing). On this
    project's machines /tmp is ext4, so the tests run."""
    warm(path)
    drop_pages(path)
    if cached_share(path) >= 0.5:
        pytest.skip("this file system keeps clean pages (tmpfs)")


def warm_checkpoint(model_dir) -> list[tuple[str, int, int]]:
    """Every weight file of the checkpoint read into the page cache; its resident spans (skips on tmpfs)."""
    files = sorted(model_dir.glob("*.safetensors"))
    require_evictable(files[0])
    spans = resident_spans(model_dir)
    for f in files:
        warm(f)
    return spans


def test_drop_pages_evicts_that_file_only(tiny_qwen, tmp_path):
    f = next(tiny_qwen.glob("*.safetensors"))
    other = tmp_path / "other.bin"
    other.write_bytes(os.urandom(1 << 20))
    require_evictable(f)
    warm(f)
    warm(other)
    assert cached_share(f) > 0.9 and cached_share(other) > 0.9
    assert drop_pages(f) == os.path.getsize(f)
    assert cached_share(f) == 0
    assert cached_share(other) > 0.9


@pytest.mark.parametrize("io_mode, dropped", [("direct", True), ("buffered", False)])
def test_load_drops_resident_pages_only_with_direct_io(tiny_qwen, io_mode, dropped):
    spans = warm_checkpoint(tiny_qwen)
    assert resident_share(spans) > 0.9
    om = OffloadedModel.load(tiny_qwen, OffloadConfig(budget="50%", io_mode=io_mode))
    try:
        share = resident_share(spans)
    finally:
        om.close()
    assert (share < 0.05) if dropped else (share > 0.9), share


@pytest.mark.parametrize("io_mode, dropped", [("direct", True), ("buffered", False)])
def test_drafter_pages_dropped_only_with_direct_io(tiny_qwen, tmp_path, io_mode, dropped):
    from runtime.checkpoints.tiny import make_tiny
    from runtime.decode.pairing import load_drafter

    draft = make_tiny(tmp_path / "drafter", "qwen3", seed=9, layers=3)
    files = sorted(draft.glob("*.safetensors"))
    require_evictable(files[0])
    om = OffloadedModel.load(tiny_qwen, OffloadConfig(budget="50%", io_mode=io_mode))
    try:
        for f in files:
            warm(f)
        load_drafter(draft, om)
        shares = [cached_share(f) for f in files]
    finally:
        om.close()
    assert all((x == 0) if dropped else (x > 0.9) for x in shares), shares


def test_resident_pages_go_before_the_expert_cache_allocates(tiny_qwen, monkeypatch):
    """The load's peak is max(resident weights + their page-cache copy, resident + slabs), not the sum: by the time
    the expert cache is built, the resident weights are evaluated and their pages dropped."""
    import runtime.decode.offloaded_model as om_module

    spans = warm_checkpoint(tiny_qwen)
    seen = []
    real = om_module.ExpertCache

    def recording_cache(*args, **kwargs):
        seen.append(resident_share(spans))
        return real(*args, **kwargs)

    monkeypatch.setattr(om_module, "ExpertCache", recording_cache)
    om = OffloadedModel.load(tiny_qwen, OffloadConfig(budget="50%", io_mode="direct"))
    om.close()
    assert seen == [0.0]
