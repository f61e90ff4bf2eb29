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


def get_json(url: str, timeout: float = 10.0) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def post_raw(url: str, body: bytes, timeout: float = 60.0) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"}, method="POST")
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
    port = free_port()
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "runtime.cli.app", "serve", *args, "--port", str(port)],
                            cwd=ROOT, env=cli_env(), stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for_health(base, proc, log_path, startup_s, "specmoe serve")
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        log.close()
