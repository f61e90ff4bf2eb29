"""The machine `specmoe doctor` runs on: chip, RAM, GPU working set, SSD, MLX version and backend.

Each field is read where the OS exposes it and is None otherwise; `sources` says where each value
came from. Nothing here needs root, and nothing takes more than a few seconds: macOS-only calls
(`sysctl`, `diskutil`, Metal device info) run only on macOS, Linux-only files only on Linux.

Invariant: reading never raises on a missing tool or file; the field is None and `notes` says why.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

__all__ = ["MachineInfo", "machine_info", "mlx_info"]


@dataclass
class MachineInfo:
    os: str  # "macOS 15.1" / "Linux 6.8"
    chip: str | None  # "Apple M4" / CPU model name
    cpu_cores: int | None  # logical CPUs
    ram_bytes: int | None  # installed memory
    gpu_working_set_bytes: int | None  # Metal recommendedMaxWorkingSetSize (None without Metal)
    wired_limit_mb: int | None  # iogpu.wired_limit_mb when raised (macOS; 0 = default)
    ssd_model: str | None  # device model of the disk holding the data directory
    ssd_size_bytes: int | None  # size of that disk (or of its filesystem when the disk is not readable)
    sources: dict[str, str] = field(default_factory=dict)  # field -> where it was read
    notes: list[str] = field(default_factory=list)  # what could not be read, and why

    def to_json(self) -> dict:
        return asdict(self)


def _run(args: list[str], timeout: float = 10.0) -> str | None:
    if shutil.which(args[0]) is None:
        return None
    try:
        out = subprocess.run(args, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _macos(info: MachineInfo, data_dir: Path) -> None:
    info.os = f"macOS {platform.mac_ver()[0]}"
    info.chip = _run(["sysctl", "-n", "machdep.cpu.brand_string"])
    memsize = _run(["sysctl", "-n", "hw.memsize"])
    info.ram_bytes = int(memsize) if memsize and memsize.isdigit() else None
    wired = _run(["sysctl", "-n", "iogpu.wired_limit_mb"])
    info.wired_limit_mb = int(wired) if wired and wired.isdigit() else None
    info.sources.update(chip="sysctl machdep.cpu.brand_string", ram_bytes="sysctl hw.memsize",
                        wired_limit_mb="sysctl iogpu.wired_limit_mb")
    disk = _run(["diskutil", "info", "/"])
    if disk:
        model = re.search(r"Device / Media Name:\s*(.+)", disk)
        size = re.search(r"Disk Size:.*\((\d+) Bytes\)", disk)
        info.ssd_model = model.group(1).strip() if model else None
        info.ssd_size_bytes = int(size.group(1)) if size else None
        info.sources.update(ssd_model="diskutil info /", ssd_size_bytes="diskutil info /")
    else:
        info.notes.append("diskutil not available: SSD model and size not read")


def _block_device(path: Path) -> str | None:
    """The whole-disk name (e.g. "nvme0n1", "sda") holding `path`, from /proc/self/mountinfo and /sys."""
    try:
        dev = os.stat(path).st_dev
        link = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}").resolve()
    except OSError:
        return None
    # /sys/devices/.../block/nvme0n1/nvme0n1p2 -> nvme0n1 (a partition's parent is the disk)
    parts = link.parts
    if "block" in parts:
        return parts[parts.index("block") + 1]
    return None


def _linux(info: MachineInfo, data_dir: Path) -> None:
    info.os = f"Linux {platform.release()}"
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
        match = re.search(r"model name\s*:\s*(.+)", cpuinfo)
        info.chip = match.group(1).strip() if match else None
        info.sources["chip"] = "/proc/cpuinfo"
    except OSError:
        info.notes.append("/proc/cpuinfo not readable")
    try:
        meminfo = Path("/proc/meminfo").read_text()
        match = re.search(r"MemTotal:\s*(\d+) kB", meminfo)
        info.ram_bytes = int(match.group(1)) * 1024 if match else None
        info.sources["ram_bytes"] = "/proc/meminfo MemTotal"
    except OSError:
        info.notes.append("/proc/meminfo not readable")
    disk = _block_device(data_dir)
    if disk:
        sys_disk = Path("/sys/block") / disk
        for name in ("device/model", "device/name"):
            try:
                info.ssd_model = (sys_disk / name).read_text().strip() or None
            except OSError:
                continue
            if info.ssd_model:
                info.sources["ssd_model"] = f"/sys/block/{disk}/{name}"
                break
        try:
            info.ssd_size_bytes = int((sys_disk / "size").read_text()) * 512
            info.sources["ssd_size_bytes"] = f"/sys/block/{disk}/size"
        except (OSError, ValueError):
            pass
    if info.ssd_model is None:
        info.notes.append("disk model not exposed (virtual disk or overlay filesystem)")


def machine_info(data_dir: Path | None = None) -> MachineInfo:
    """What this machine is; `data_dir` picks the disk whose model and size are reported."""
    data_dir = Path(data_dir or Path.cwd())
    info = MachineInfo(os=platform.system(), chip=None, cpu_cores=os.cpu_count(), ram_bytes=None,
                       gpu_working_set_bytes=None, wired_limit_mb=None, ssd_model=None, ssd_size_bytes=None)
    if sys.platform == "darwin":
        _macos(info, data_dir)
    elif sys.platform.startswith("linux"):
        _linux(info, data_dir)
    else:
        info.notes.append(f"{sys.platform}: machine details not read")
    if info.ssd_size_bytes is None:
        try:
            usage = shutil.disk_usage(data_dir)
            info.ssd_size_bytes = usage.total
            info.sources["ssd_size_bytes"] = "filesystem size (statvfs)"
        except OSError:
            pass
    working_set = mlx_info().get("max_recommended_working_set_size")
    if working_set:
        info.gpu_working_set_bytes = int(working_set)
        info.sources["gpu_working_set_bytes"] = "mx.metal.device_info()"
    else:
        info.notes.append("no Metal device: GPU working set does not apply")
    return info


def mlx_info() -> dict:
    """MLX version, backend and (with Metal) the device info MLX reports."""
    import mlx.core as mx

    metal = bool(mx.metal.is_available())
    info = {"mlx_version": getattr(mx, "__version__", "unknown"), "backend": "metal" if metal else "cpu",
            "default_device": str(mx.default_device())}
    try:
        import mlx_lm

        info["mlx_lm_version"] = getattr(mlx_lm, "__version__", "unknown")
    except ImportError:
        info["mlx_lm_version"] = None
    if metal:
        try:
            device = mx.metal.device_info()
            info["device_name"] = device.get("device_name")
            info["max_recommended_working_set_size"] = device.get("max_recommended_working_set_size")
            info["architecture"] = device.get("architecture")
        except Exception as error:  # noqa: BLE001 - an MLX without device_info is reported, not fatal
            info["device_info_error"] = repr(error)
    return info
