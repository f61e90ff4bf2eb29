"""One pipeline hop on this machine: mx.distributed ring send/recv (through runtime.pipeline's Channel)
against a raw TCP round trip between two processes, both on 127.0.0.1.

Physics: a decode step through N ranks costs N hops of a small message (a (1, 1, D) hidden state, a
few KB). On a Mac link the hop is latency-bound (TCP ~300 us, RDMA <50 us, see runtime/plan/
pipeline_plan.py). Here the ranks share two loaded CPU cores, and MLX's ring backend polls its
non-blocking sockets from its own threads, so a hop also costs thread wake-ups; the raw TCP round
trip shows what the kernel alone costs. Prints a table and ends with one JSON line.

    python bench/bench_pipeline_hop.py            # launches itself on 2 local ranks
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

ROUNDS = 30
HIDDEN = 2048  # Qwen3.5-35B-A3B's hidden size; bf16 -> 4 KB per token


def _rank_main() -> None:
    import mlx.core as mx

    from runtime.pipeline.channel import FORWARD, Channel, Message

    group = mx.distributed.init(strict=True)
    ch = Channel(group, timeout_s=120)
    x = mx.zeros((1, 1, HIDDEN), mx.bfloat16)
    times = []
    for _ in range(ROUNDS):
        t0 = time.perf_counter()
        if ch.rank == 0:
            ch.send(Message(FORWARD, 1, payload=x))
            ch.recv()
            times.append(time.perf_counter() - t0)
        else:
            m = ch.recv()
            ch.send(Message(FORWARD, 1, payload=m.payload))
    if ch.rank == 0:
        print("RESULT " + json.dumps({"round_trip_ms": [1000 * t for t in times]}), flush=True)


def _tcp_round_trips() -> list[float]:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]
    pid = os.fork()
    if pid == 0:
        c, _ = srv.accept()
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(ROUNDS):
            data = b""
            while len(data) < HIDDEN * 2:
                data += c.recv(HIDDEN * 2 - len(data))
            c.sendall(data)
        os._exit(0)
    c = socket.create_connection(("127.0.0.1", port))
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    out = []
    for _ in range(ROUNDS):
        t0 = time.perf_counter()
        c.sendall(b"x" * HIDDEN * 2)
        data = b""
        while len(data) < HIDDEN * 2:
            data += c.recv(HIDDEN * 2 - len(data))
        out.append(1000 * (time.perf_counter() - t0))
    os.waitpid(pid, 0)
    return out


def main() -> None:
    if os.environ.get("MLX_RANK") is not None:
        _rank_main()
        return
    from runtime.pipeline.local import local_launch_command

    r = subprocess.run(local_launch_command(2, [sys.executable, __file__]), capture_output=True, text=True, timeout=600,
                       cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    line = next((l for l in r.stdout.splitlines() if l.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"the ranks failed:\n{r.stderr[-2000:]}")
    ring = json.loads(line[7:])["round_trip_ms"]
    tcp = _tcp_round_trips()
    print(f"{'transport':<34}{'round trip ms median (min-max)':>32}{'per hop ms':>12}")
    for name, xs in (("mx.distributed ring (Channel)", ring), ("raw TCP, TCP_NODELAY", tcp)):
        print(f"{name:<34}{statistics.median(xs):>14.3f} ({min(xs):.3f}-{max(xs):.3f}){'':>4}{statistics.median(xs) / 2:>10.3f}")
    print(json.dumps({"bench": "pipeline_hop", "rounds": ROUNDS, "payload_bytes": HIDDEN * 2,
                      "machine": "shared 2-core x86 CPU, 127.0.0.1", "load_avg": os.getloadavg(),
                      "ring_round_trip_ms": ring, "tcp_round_trip_ms": tcp,
                      "ring_hop_ms_median": statistics.median(ring) / 2, "tcp_hop_ms_median": statistics.median(tcp) / 2}))


if __name__ == "__main__":
    main()
