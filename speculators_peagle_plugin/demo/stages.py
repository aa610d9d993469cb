"""The run directory's record of finished stages (``stages.json``): skip, redo or refuse."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from ..common.files import atomic_write_text

__all__ = ["STATE_FILE", "Stages"]

STATE_FILE = "stages.json"


class Stages:
    """The run directory's record of finished stages (``stages.json``).

    ``run(name, inputs, work, exists)`` returns the stage's outputs: the recorded ones if
    the stage finished with the same ``inputs`` and ``exists(outputs)`` still holds, else
    those of ``work()``, recorded with its wall time. A stage recorded with other inputs
    raises ``ValueError``: its results belong to another configuration.
    """

    def __init__(self, run_dir: Path, echo: Callable[[str], None] = print):
        self.run_dir, self.echo = run_dir, echo
        self.path = run_dir / STATE_FILE
        self.records = json.loads(self.path.read_text()) if self.path.exists() else {}
        self.ran: dict[str, float] = {}  # stages this invocation ran: wall seconds

    def run(self, name: str, inputs: dict, work: Callable[[], dict],
            exists: Callable[[dict], bool]) -> dict:
        record = self.records.get(name)
        if record is not None and record["inputs"] != inputs:
            changed = sorted(
                k for k in inputs.keys() | record["inputs"].keys()
                if inputs.get(k) != record["inputs"].get(k)
            )
            raise ValueError(
                f"{self.run_dir} holds a '{name}' stage made with other settings "
                f"({', '.join(changed)}); use another --run-dir, or delete {self.run_dir} "
                "to start over."
            )
        if record is not None and exists(record["outputs"]):
            self.echo(f"[{name}] finished earlier in {record['seconds']:.0f} s; skipped.")
            return record["outputs"]
        self.echo(f"[{name}] ...")
        began = time.perf_counter()
        outputs = work()
        seconds = time.perf_counter() - began
        self.records[name] = {"inputs": inputs, "outputs": outputs, "seconds": seconds}
        self.ran[name] = seconds
        atomic_write_text(self.path, json.dumps(self.records, indent=1) + "\n")
        self.echo(f"[{name}] done in {seconds:.0f} s.")
        return outputs

    def seconds(self) -> dict[str, float]:
        return {name: r["seconds"] for name, r in self.records.items()}
