"""Run a command under a memory cap that counts page cache: a Linux cgroup v1 memory controller.

A 16 GB Mac cannot keep a 17-20 GB checkpoint in its page cache; this machine (24 GB) can, which would
make every "disk" read a memory copy. A memory cgroup charges the page cache its processes fault in to
the cgroup, so under an 8 GB cap a 19 GB checkpoint really streams from the disk.

    with MemoryCgroup(8 * 10**9) as cg:
        result = cg.run(["specmoe", "generate", ...])
    result.cgroup_peak_bytes   memory.max_usage_in_bytes: process memory plus charged page cache
    result.rss_peak_bytes      the command's own peak RSS (wait4's ru_maxrss, the kernel's VmHWM)
    result.oom_killed          the kernel's OOM killer fired inside the cgroup (exit 137)

With `read_bps` (and `device`, the disk a checkpoint is on: `disk_of(path)`), the command also joins a
cgroup v1 blkio group whose throttle caps its reads from that disk at `read_bps` bytes/s, direct and
buffered alike: a slower disk than this one, for the runs where reads, not compute, set the pace.

`drop_file_cache(paths)` evicts one checkpoint's pages from the page cache (posix_fadvise DONTNEED, this
file's pages only, nobody else's) so a run starts cold even after an uncapped run read the same files.

Invariants: the cgroup is /sys/fs/cgroup/memory/specmoe-<pid>-<n> (and blkio/specmoe-<pid>-<n> with a
read throttle), created for one `with` block and removed after it (its processes have exited by then); only the command's process (and its children) join
it, never the caller; `available()` says whether this machine allows it (root, cgroup v1 memory mounted).
"""

from __future__ import annotations

import itertools
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from storage import drop_pages

CGROUP_MEMORY_ROOT = Path("/sys/fs/cgroup/memory")
CGROUP_BLKIO_ROOT = Path("/sys/fs/cgroup/blkio")
_counter = itertools.count()


@dataclass(frozen=True)
class CappedResult:
    exit_code: int  # the command's exit code (-9 / 137: killed)
    wall_s: float  # wall time of the command
    cgroup_peak_bytes: int  # memory.max_usage_in_bytes: RSS plus the page cache charged to the cgroup
    rss_peak_bytes: int  # the command's peak RSS (its largest process, ru_maxrss)
    oom_killed: bool  # the OOM killer fired in the cgroup
    limit_bytes: int  # the cap the command ran under


def _controller(root: Path, control: str, what: str) -> str | None:
    if not (root / control).exists():
        return f"no cgroup v1 {what} at {root}"
    if not os.access(root, os.W_OK):
        return f"{root} is not writable (run as root)"
    return None


def available(root: Path = CGROUP_MEMORY_ROOT) -> str | None:
    """None when capped runs work here, else why not (one line)."""
    return _controller(root, "memory.limit_in_bytes", "memory controller")


def throttle_available(root: Path = CGROUP_BLKIO_ROOT) -> str | None:
    """None when read throttles work here, else why not (one line)."""
    return _controller(root, "blkio.throttle.read_bps_device", "blkio throttle")


def disk_of(path) -> str:
    """"major:minor" of the whole disk holding `path` (a partition's parent: the throttle applies per disk)."""
    dev = os.stat(path).st_dev
    node = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    if (node / "partition").exists():
        return (node.resolve().parent / "dev").read_text().strip()
    return f"{os.major(dev)}:{os.minor(dev)}"


class MemoryCgroup:
    """One memory cgroup with a limit, for running commands under it (see the module docstring)."""

    def __init__(self, limit_bytes: int, root: Path = CGROUP_MEMORY_ROOT, *, read_bps: int | None = None,
                 device: str | None = None, blkio_root: Path = CGROUP_BLKIO_ROOT):
        if limit_bytes <= 0:
            raise ValueError(f"cap {limit_bytes}: expected a positive number of bytes")
        if read_bps is not None and (read_bps <= 0 or not device):
            raise ValueError(f"read throttle {read_bps} B/s on {device!r}: expected a positive rate and a disk (disk_of)")
        self.limit_bytes = int(limit_bytes)
        name = f"specmoe-{os.getpid()}-{next(_counter)}"
        self.path = root / name
        self.read_bps, self.device = read_bps, device
        self.blkio = blkio_root / name if read_bps is not None else None

    def __enter__(self) -> "MemoryCgroup":
        self.path.mkdir()
        (self.path / "memory.limit_in_bytes").write_text(str(self.limit_bytes))
        if self.blkio is not None:
            try:
                self.blkio.mkdir()
                (self.blkio / "blkio.throttle.read_bps_device").write_text(f"{self.device} {int(self.read_bps)}")
            except OSError:
                self.__exit__()
                raise
        return self

    def __exit__(self, *exc) -> None:
        for path in (self.path, self.blkio):
            if path is None or not path.exists():
                continue
            for _ in range(50):  # the kernel frees the cgroup once its last task has gone
                if path is self.path:
                    try:
                        (path / "memory.force_empty").write_text("0")
                    except OSError:
                        pass
                try:
                    path.rmdir()
                    break
                except OSError:
                    time.sleep(0.1)

    def read_bytes(self) -> int:
        """Bytes the throttled group read from its disk so far (blkio's own count; 0 without a throttle)."""
        if self.blkio is None:
            return 0
        for line in (self.blkio / "blkio.throttle.io_service_bytes").read_text().splitlines():
            parts = line.split()
            if len(parts) == 3 and parts[0] == self.device and parts[1] == "Read":
                return int(parts[2])
        return 0

    def _read(self, name: str) -> str:
        return (self.path / name).read_text()

    def _oom_kills(self) -> int:
        for line in self._read("memory.oom_control").splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
        return 0

    def run(self, cmd: list[str], *, stdout=None, stderr=None, env=None, timeout_s: float | None = None) -> CappedResult:
        """Run `cmd` inside the cgroup (it joins before exec, so its whole life is capped) and wait."""
        procs = str(self.path / "cgroup.procs")
        (self.path / "memory.max_usage_in_bytes").write_text("0")  # reset the peak
        before = self._oom_kills()
        if self.blkio is None:
            wrapper = ["sh", "-c", 'echo $$ > "$0" && exec "$@"', procs, *cmd]
        else:
            wrapper = ["sh", "-c", 'echo $$ > "$0" && echo $$ > "$1" && shift && exec "$@"', procs,
                       str(self.blkio / "cgroup.procs"), *cmd]
        t0 = time.perf_counter()
        proc = subprocess.Popen(wrapper, stdout=stdout, stderr=stderr, env=env)
        deadline = None if timeout_s is None else t0 + timeout_s
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if deadline is not None and time.perf_counter() > deadline:
                proc.kill()
            time.sleep(0.05)
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        return CappedResult(exit_code=proc.returncode, wall_s=wall,
                            cgroup_peak_bytes=int(self._read("memory.max_usage_in_bytes")),
                            rss_peak_bytes=int(usage.ru_maxrss) * 1024, oom_killed=self._oom_kills() > before,
                            limit_bytes=int(self._read("memory.limit_in_bytes")))


def run_uncapped(cmd: list[str], *, stdout=None, stderr=None, env=None) -> CappedResult:
    """The same measurement without a cap (cgroup peak 0): for the resident reference runs."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=stdout, stderr=stderr, env=env)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return CappedResult(proc.returncode, time.perf_counter() - t0, 0, int(usage.ru_maxrss) * 1024,
                        proc.returncode in (-9, 137), 0)


def drop_file_cache(paths) -> int:
    """Evict these files' pages from the page cache (storage.drop_pages); returns bytes covered."""
    return sum(drop_pages(p) for p in paths)
