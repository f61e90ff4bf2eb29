"""bench/fullscale_cgroup.py's read throttle: a command in a capped cgroup with `read_bps` joins a blkio group whose
rule holds its disk reads to that rate (a slower disk than this one). The kernel enforces the rate, so the check is a
lower bound on the time a direct read takes, which only gets longer on a busy machine; without the rule the same
read would take milliseconds."""

from __future__ import annotations

import os
import sys

import pytest

from tests.bench_scripts import BENCH

sys.path.insert(0, str(BENCH.parent))
from bench import fullscale_speculative  # noqa: E402
from bench.fullscale_cgroup import MemoryCgroup, available, disk_of, throttle_available  # noqa: E402

READER = """
import mmap, os, sys
fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECT)
buf = mmap.mmap(-1, 1 << 20)
for i in range(int(sys.argv[2])):
    assert os.preadv(fd, [buf], i << 20) == 1 << 20
"""


def test_reads_are_held_to_the_throttle(tmp_path):
    if available() or throttle_available():
        pytest.skip(available() or throttle_available())
    f = tmp_path / "data.bin"
    with open(f, "wb") as out:
        out.write(os.urandom(4 << 20))
        os.fsync(out.fileno())
    with MemoryCgroup(1 << 30, read_bps=2_000_000, device=disk_of(f)) as cg:
        assert (cg.blkio / "blkio.throttle.read_bps_device").read_text().split() == [disk_of(f), "2000000"]
        res = cg.run([sys.executable, "-c", READER, str(f), "4"])
        read = cg.read_bytes()
    assert res.exit_code == 0
    assert read >= 4 << 20  # the kernel counted the direct reads against the group
    assert res.wall_s >= 1.0  # 4.2 MB at 2 MB/s: about 2 s
    assert not cg.path.exists() and not cg.blkio.exists()  # both groups removed


def test_disk_of_names_a_block_device(tmp_path):
    dev = disk_of(tmp_path)
    major, minor = dev.split(":")
    assert major.isdigit() and minor.isdigit()
    if os.path.exists(f"/sys/dev/block/{dev}"):
        assert not os.path.exists(f"/sys/dev/block/{dev}/partition")  # a whole disk, never a partition


def test_a_throttle_needs_a_rate_and_a_disk():
    with pytest.raises(ValueError, match="positive rate"):
        MemoryCgroup(1 << 30, read_bps=0, device="254:0")
    with pytest.raises(ValueError, match="disk"):
        MemoryCgroup(1 << 30, read_bps=10**6)


def test_bad_read_rate_is_one_line_exit_2(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{}")
    if available():
        pytest.skip(available())
    assert fullscale_speculative.main(["--model", str(tmp_path), "--read-mbps", "-5"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--read-mbps -5" in err
