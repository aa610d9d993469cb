"""Commands killed with SIGKILL at chosen points, cheaply: one process imports the package
once (about 10 s on a 2-core machine) and forks every run from there.

:class:`Forker` starts that process (this file run as a script) and sends it one run at a
time: ``speculators-peagle ARGS`` in a forked child, in a session of its own, its output in
a log file, and the whole session killed with SIGKILL ``kill_after`` seconds after the fork
(None: run to its end). The forking process imports modules and never computes, so no
thread pool exists in it to be broken by the fork.

Example::

    with Forker() as forker:
        whole = forker.run(["train", ...], log)           # {"rc": 0, "seconds": 4.1, ...}
        forker.run(["train", ...], log, kill_after=1.7)  # {"rc": -9, "killed": True, ...}
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

# what the commands import on their first call, imported before any fork
PRELOAD = (
    "speculators_peagle_plugin.cli", "speculators_peagle_plugin.training.loop",
    "speculators_peagle_plugin.engine.reference", "speculators", "speculators.train.data",
    "transformers", "datasets", "safetensors.torch", "transformers.models.llama",
    "matplotlib.pyplot",
)
LIMIT_S = 300.0  # a run that has not ended by then is killed (and reported as killed)


# A later run can end sooner than the timed one (warm caches, a quieter machine): points stop
# short of its end, so that most kills land while the command still runs.
LATEST = 0.75


def kill_times(seed: int, n: int, seconds: float) -> list[float]:
    """``n`` points of time in ``(0, LATEST * seconds)``, drawn uniformly by
    ``random.Random(seed)``."""
    rng = random.Random(seed)
    return [rng.uniform(0.0, LATEST * seconds) for _ in range(n)]


def seconds_until(path: Path, run: dict, ended: float) -> float:
    """How long into ``run`` (a :meth:`Forker.run` outcome, returned at ``time.time()``
    ``ended``) ``path`` was last written."""
    return max(0.0, run["seconds"] - (ended - path.stat().st_mtime))


class Forker:
    """The forking process; :meth:`run` one command in a child of it."""

    def __init__(self, env: dict | None = None):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
               "TOKENIZERS_PARALLELISM": "false", **(env or {})}
        self.proc = subprocess.Popen(
            [sys.executable, "-u", __file__], env=env, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True,
        )
        assert self.proc.stdout.readline().strip() == "ready"

    def run(self, args: list[str], log: Path, kill_after: float | None = None,
            setup: tuple[str, ...] = (), once: Path | None = None) -> dict:
        """``{"rc", "killed", "seconds"}`` of ``speculators-peagle ARGS`` (rc -9: killed).

        ``setup``: ``("module:function", *args)`` that the child calls first (a module
        under ``tests/``), e.g. to put tiny stand-ins in place. ``once``: ``kill_after``
        counts from when this path exists (e.g. a first checkpoint), not from the fork.
        """
        request = {"args": [str(a) for a in args], "log": str(log), "kill_after": kill_after,
                   "setup": [str(a) for a in setup], "once": str(once) if once else None}
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(60)

    def __enter__(self) -> Forker:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _child(request: dict) -> None:
    """Run the command in this (forked) process and exit with its exit code."""
    os.setsid()
    fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    from speculators_peagle_plugin.cli import main

    if request["setup"]:
        import importlib

        name, *args = request["setup"]
        module, function = name.split(":")
        getattr(importlib.import_module(module), function)(*args)

    code = 0
    try:
        main.main(args=request["args"], prog_name="speculators-peagle", standalone_mode=True)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _alive_in_group(pgid: int) -> list[int]:
    """The processes of group ``pgid`` that have not exited (a zombie has closed its files)."""
    alive = []
    for entry in Path("/proc").iterdir():
        try:
            # /proc/PID/stat: "pid (comm) state ppid pgrp ...", comm may hold spaces
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # not a process, or gone
        if int(fields[2]) == pgid and fields[0] != "Z":
            alive.append(int(entry.name))
    return alive


def _wait_until_dead(pgid: int, limit_s: float = 30.0) -> None:
    """Until every process of the killed group has exited: a worker the run forked dies a
    moment after the run, and until then holds what it inherited (the run's lock)."""
    ends = time.monotonic() + limit_s
    while _alive_in_group(pgid) and time.monotonic() < ends:
        time.sleep(0.005)


def _serve() -> None:
    """Read one JSON request a line, fork and run it, write its outcome as a line."""
    import importlib

    sys.path.insert(0, str(Path(__file__).parent.parent))  # tests/: its helpers
    for name in PRELOAD:
        importlib.import_module(name)
    print("ready", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        began = time.monotonic()
        pid = os.fork()
        if pid == 0:
            _child(request)
        killed, status = False, None
        limit = began + LIMIT_S
        waits = request["once"] is not None and request["kill_after"] is not None
        deadline = limit if request["kill_after"] is None or waits else (
            began + request["kill_after"])
        while status is None:
            done, raw = os.waitpid(pid, os.WNOHANG)
            if waits and os.path.exists(request["once"]):
                deadline, waits = time.monotonic() + request["kill_after"], False
            if done:
                status = raw
            elif time.monotonic() >= min(deadline, limit):
                try:
                    os.killpg(pid, signal.SIGKILL)
                    killed = True
                except ProcessLookupError:  # it has just ended
                    pass
                status = os.waitpid(pid, 0)[1]
                _wait_until_dead(pid)
            else:
                time.sleep(0.005)
        rc = os.waitstatus_to_exitcode(status)
        print(json.dumps({"rc": rc, "killed": killed, "seconds": time.monotonic() - began}),
              flush=True)


if __name__ == "__main__":
    _serve()
