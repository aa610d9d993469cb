"""Processes the benchmarks start and stop: a command running for a block (its whole process
group stopped afterwards), a free loopback port, a server waited on until ``/health``
answers, and a benchmark that SIGTERM stops as it stops on an error."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from eval.demo_run import REPO

START_S = 600  # how long a `vllm serve` may take to answer: a CPU engine starting on a busy machine


def exit_on_sigterm() -> None:
    """From now on SIGTERM raises ``SystemExit`` in the main thread, so a benchmark that is
    stopped leaves its ``with`` blocks as on any other exit: its temporary directories are
    deleted and the servers it started (their own sessions) are stopped, not left behind."""
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def started(
    command: list[str], env: dict, log: Path, cwd: Path = REPO
) -> Iterator[subprocess.Popen]:
    """``command`` running, its output in ``log``, until the block ends (its whole process
    group stopped then)."""
    with open(log, "w") as out:
        server = subprocess.Popen(
            command, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        yield server
    finally:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(server.pid, sig)
                server.wait(60)
                break
            except ProcessLookupError:  # already gone
                break
            except subprocess.TimeoutExpired:
                continue


def wait_healthy(server: subprocess.Popen, base: str, log: Path) -> None:
    """Return once ``base``'s ``/health`` answers; ``SystemExit`` naming ``log`` if ``server``
    exits first or :data:`START_S` pass."""
    deadline = time.monotonic() + START_S
    while True:
        if server.poll() is not None:
            raise SystemExit(f"vllm serve exited with code {server.returncode}; see {log}.")
        if time.monotonic() > deadline:
            raise SystemExit(f"vllm serve did not answer at {base} in {START_S} s; see {log}.")
        try:
            urllib.request.urlopen(f"{base}/health", timeout=5)
            return
        except OSError:
            time.sleep(2)
