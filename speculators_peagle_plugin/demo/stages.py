"""The run directory's record of finished stages (``stages.json``): skip, redo or refuse."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path

from ..common.errors import UserError
from ..common.files import atomic_write_json, atomic_write_text

__all__ = ["SPENT_FILE", "STATE_FILE", "Stages"]

STATE_FILE = "stages.json"
# Seconds spent so far by stages not yet finished, per stage with its inputs: a resumed stage's
# recorded time is that of every attempt, not only the last. Written every ``tick_s`` while a
# stage runs (a process killed outright loses at most that much) and when it stops unfinished.
SPENT_FILE = "stages-unfinished.json"


class Stages:
    """The run directory's record of finished stages (``stages.json``).

    ``run(name, inputs, work, exists)`` returns the stage's outputs: the recorded ones if
    the stage finished with the same ``inputs`` and ``exists(outputs)`` still holds, else
    those of ``work()``, recorded with its wall time, earlier interrupted attempts with the
    same inputs included. A stage recorded with other inputs raises ``ValueError``: its
    results belong to another configuration.
    """

    def __init__(self, run_dir: Path, echo: Callable[[str], None] = print,
                 tick_s: float = 60.0):
        self.run_dir, self.echo, self.tick_s = run_dir, echo, tick_s
        self.path = run_dir / STATE_FILE
        self.records = json.loads(self.path.read_text()) if self.path.exists() else {}
        self.ran: dict[str, float] = {}  # stages this invocation finished: their seconds

    def run(self, name: str, inputs: dict, work: Callable[[], dict],
            exists: Callable[[dict], bool]) -> dict:
        record = self.records.get(name)
        if record is not None and record["inputs"] != inputs:
            changed = sorted(
                k for k in inputs.keys() | record["inputs"].keys()
                if inputs.get(k) != record["inputs"].get(k)
            )
            raise UserError(
                f"{self.run_dir} holds a '{name}' stage made with other settings "
                f"({', '.join(changed)}); use another --run-dir, or delete {self.run_dir} "
                "to start over."
            )
        if record is not None and exists(record["outputs"]):
            self.echo(f"[{name}] finished earlier in {record['seconds']:.0f} s; skipped.")
            return record["outputs"]
        self.echo(f"[{name}] ...")
        outputs, seconds = self._timed(name, inputs, work)
        self.records[name] = {"inputs": inputs, "outputs": outputs, "seconds": seconds}
        self.ran[name] = seconds
        atomic_write_text(self.path, json.dumps(self.records, indent=1) + "\n")
        self.echo(f"[{name}] done in {seconds:.0f} s.")
        return outputs

    def _timed(self, name: str, inputs: dict, work: Callable[[], dict]) -> tuple[dict, float]:
        """``work()`` and the stage's seconds: this attempt's plus those of earlier attempts
        with the same inputs, kept in ``SPENT_FILE`` until the stage finishes."""
        path = self.run_dir / SPENT_FILE
        spent = json.loads(path.read_text()) if path.exists() else {}
        earlier = spent.get(name, {})
        before = earlier.get("seconds", 0.0) if earlier.get("inputs") == inputs else 0.0
        began, stop = time.perf_counter(), threading.Event()

        def save() -> None:
            seconds = before + time.perf_counter() - began
            atomic_write_json(path, {**spent, name: {"inputs": inputs, "seconds": seconds}})

        def tick() -> None:
            while not stop.wait(self.tick_s):
                save()

        ticker = threading.Thread(target=tick, daemon=True)
        ticker.start()
        finished = False
        try:
            outputs = work()
            finished = True
        finally:
            stop.set()
            ticker.join()
            if not finished:  # a failure, Ctrl-C or SystemExit: the next attempt adds on
                save()
        spent.pop(name, None)
        if spent:
            atomic_write_json(path, spent)
        else:
            path.unlink(missing_ok=True)
        return outputs, before + time.perf_counter() - began

    def seconds(self) -> dict[str, float]:
        return {name: r["seconds"] for name, r in self.records.items()}
