"""Local launches: `mlx.launch -n N --backend ring` on 127.0.0.1, for tests, benches and development.

mlx.launch's ring backend listens on consecutive ports from --starting-port (default 32323), so two
launches on one machine at once collide; `local_launch_command` picks N free consecutive ports.
"""

from __future__ import annotations

import socket
import sys

_LAUNCH = "import sys; from mlx._distributed_utils.launch import main; sys.exit(main())"  # mlx.launch's entry point


def free_port_base(n: int, tries: int = 50) -> int:
    """A port p such that p .. p+n-1 are free on 127.0.0.1 now (a race remains, as with any port pick)."""
    for _ in range(tries):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n >= 65535:
            continue
        socks = []
        try:
            for p in range(base, base + n):
                t = socket.socket()
                socks.append(t)
                t.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for t in socks:
                t.close()
    raise RuntimeError(f"no {n} consecutive free ports on 127.0.0.1")


def local_launch_command(n: int, command: list[str]) -> list[str]:
    """argv running `command` as n ring ranks on this machine (mlx.launch with the current Python)."""
    return [sys.executable, "-c", _LAUNCH, "-n", str(n), "--backend", "ring", "-p", str(free_port_base(n)), "--", *command]
