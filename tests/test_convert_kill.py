"""`specmoe convert` killed with SIGKILL at many moments.

A child process runs the packer with its I/O steps instrumented (every fsync,
rename, file copy, manifest write and expert record is a numbered point). The
parent lets it reach point N, SIGKILLs it there, and checks:
- the source checkpoint is byte-identical;
- every directory left next to the destination either fails to open as a store
  or opens as a complete one (every record's CRC checks out): never a partial
  store that opens;
- the next convert succeeds (or refuses an existing complete destination) and
  cleans up the leftover partial directory.
A few more kills land at random times, without instrumentation.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from storage import ExpertKey, ExpertStore, StoreError
from storage.packer import convert
from tests.conftest import tree_digest

ROOT = Path(__file__).resolve().parent.parent

CHILD = r"""
import os, shutil, sys, time
from pathlib import Path
import storage.packer as packer

src, dst, stop_at, force = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1"
count = 0

def point(label):
    global count
    count += 1
    if count == stop_at:
        print(f"{count} {label}", flush=True)
        time.sleep(60)  # the parent SIGKILLs us here

def before(label, fn):
    def wrapped(*a, **k):
        point(label)
        out = fn(*a, **k)
        if label == "rename":
            point("after rename")
        return out
    return wrapped

os.fsync = before("fsync", os.fsync)
os.rename = before("rename", os.rename)
shutil.copy2 = before("copy", shutil.copy2)
Path.write_text = before("write manifest", Path.write_text)
packer.convert(src, dst, force=force, progress=lambda n: point("record"))
print(f"total {count}", flush=True)
"""


def _child(src: Path, dst: Path, stop_at: int, force: bool) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-c", CHILD, str(src), str(dst), str(stop_at), "1" if force else "0"],
                            stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)


def _complete(d: Path) -> bool | None:
    """None: does not open as a store; True: opens and every record checks out."""
    try:
        store = ExpertStore.open(d)
    except StoreError:
        return None
    try:
        if store.kind != "packed":
            return None
        return all(store.verify(ExpertKey(l, e)) for l in store.moe_layers for e in range(store.layout(l).n_experts))
    finally:
        store.close()


def _survey(dst: Path) -> dict[str, bool | None]:
    """What is left next to the destination: name -> _complete()."""
    return {p.name: _complete(p) for p in sorted(dst.parent.iterdir()) if p.name.lstrip(".").startswith(dst.name)}


def kill_at(src: Path, dst: Path, stop_at: int, force: bool = False) -> tuple[str, dict]:
    """Run convert until point `stop_at`, SIGKILL it there; returns (point label, survey)."""
    proc = _child(src, dst, stop_at, force)
    line = proc.stdout.readline().strip()
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    proc.stdout.close()
    return line.partition(" ")[2], _survey(dst)


def count_points(src: Path, dst: Path, force: bool = False) -> int:
    """Points of one uninterrupted convert (with force: replacing an existing store at `dst`)."""
    if force:
        convert(src, dst)
    proc = _child(src, dst, -1, force)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    return int(out.strip().split()[-1])


def _check_leftovers(survey: dict, dst: Path) -> None:
    for name, state in survey.items():
        assert state is not False, f"{name} opens as a store but a record fails its CRC"
        if name != dst.name:
            assert name.startswith(f".{dst.name}."), f"unexpected leftover {name}"


@pytest.mark.slow
def test_sigkill_at_every_kind_of_point_leaves_no_partial_store(tmp_path, tiny_qwen):
    src = tiny_qwen
    digest = tree_digest(src)
    dry = tmp_path / "dry" / "store"
    total = count_points(src, dry)
    assert _complete(dry) is True
    # Every step of the start and the end (copies, resident weights, manifest, fsyncs,
    # renames) and a few records in between.
    points = sorted({*range(1, 5), total // 4, total // 2, 3 * total // 4, *range(total - 7, total + 1)})
    seen_labels = set()
    for n in points:
        dst = tmp_path / f"k{n}" / "store"
        label, survey = kill_at(src, dst, n)
        seen_labels.add(label)
        assert tree_digest(src) == digest, f"killed at {n} ({label}): the source changed"
        _check_leftovers(survey, dst)
        if survey.get(dst.name) is None:
            # Not there (or not a store): the next convert must succeed and clean up.
            convert(src, dst)
            assert _survey(dst) == {dst.name: True}, f"killed at {n} ({label}): leftovers after a retry"
        else:
            with pytest.raises(ValueError, match="exists"):
                convert(src, dst)
    assert {"record", "fsync", "rename", "after rename", "write manifest", "copy"} <= seen_labels


@pytest.mark.slow
def test_sigkill_while_replacing_with_force(tmp_path, tiny_qwen):
    """--force replaces DST by two renames; between them DST is missing but the old store
    survives intact under .DST.old-PID (documented in docs/reliability.md)."""
    src = tiny_qwen
    digest = tree_digest(src)
    dst = tmp_path / "out" / "store"
    total = count_points(src, tmp_path / "dry" / "store", force=True)
    convert(src, dst)
    for n in (total // 2, *range(total - 5, total + 1)):
        label, survey = kill_at(src, dst, n, force=True)
        assert tree_digest(src) == digest
        _check_leftovers(survey, dst)
        complete = [name for name, state in survey.items() if state]
        assert complete, f"killed at {n} ({label}): no complete store left at all"
        convert(src, dst, force=True)  # recovers; the .old-* copy (if any) stays for the user
        assert _survey(dst)[dst.name] is True


@pytest.mark.slow
def test_sigkill_at_random_times(tmp_path, tiny_qwen):
    src = tiny_qwen
    digest = tree_digest(src)
    t0 = time.perf_counter()
    count_points(src, tmp_path / "dry" / "store")
    duration = time.perf_counter() - t0
    rng = random.Random(7)
    for i in range(6):
        dst = tmp_path / f"r{i}" / "store"
        proc = _child(src, dst, 0, False)
        time.sleep(rng.uniform(0.0, duration))
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        proc.stdout.close()
        assert tree_digest(src) == digest
        dst.parent.mkdir(parents=True, exist_ok=True)
        _check_leftovers(_survey(dst), dst)
