"""A live `specmoe serve` subprocess on a free 127.0.0.1 port, for the server tests.

The process imports this checkout (PYTHONPATH is set to the repository root), is waited for
until /health answers (bounded), and is always terminated (then killed) at the end.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str, timeout: float = 10.0, headers: dict | None = None) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            return e.code, json.loads(raw)
        except ValueError:  # uvicorn's own plain-text answers (503 over --max-connections)
            return e.code, {"error": raw.decode(errors="replace")}


def post_raw(url: str, body: bytes, timeout: float = 60.0, headers: dict | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json", **(headers or {})},
                                 method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def cli_env(**extra) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(extra)
    return env


def wait_for_health(base: str, proc: subprocess.Popen, log_path: Path, startup_s: float, what: str) -> None:
    """Poll BASE/health until it answers 200; raise (with the log) if `proc` exits or `startup_s` passes."""
    deadline = time.monotonic() + startup_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}:\n{log_path.read_text()}")
        try:
            if get_json(base + "/health", timeout=2)[0] == 200:
                return
        except (OSError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not answer /health in {startup_s:g} s:\n{log_path.read_text()}")
        time.sleep(0.3)


@contextmanager
def serve(args: list[str], log_path: Path, startup_s: float = 240.0):
    """Yields the base URL (http://127.0.0.1:PORT) of `specmoe serve ARGS --port PORT`."""
    with serve_process(args, log_path, startup_s) as (base, _):
        yield base


def open_fds(pid: int) -> int:
    """File descriptors process `pid` holds open (Linux /proc)."""
    return len(os.listdir(f"/proc/{pid}/fd"))


@contextmanager
def serve_process(args: list[str], log_path: Path, startup_s: float = 240.0, env: dict | None = None):
    """Yields (base URL, the server's Popen) of `specmoe serve ARGS --port PORT`."""
    port = free_port()
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "runtime.cli.app", "serve", *args, "--port", str(port)],
                            cwd=ROOT, env=cli_env(**(env or {})), stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for_health(base, proc, log_path, startup_s, "specmoe serve")
        yield base, proc
    finally:
        end_process(proc, log)


def end_process(proc: subprocess.Popen, log) -> None:
    """Terminate a server process (kill it if it lingers) and close its log."""
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)
    log.close()
