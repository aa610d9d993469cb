"""Finished cells kept across runs (``OUT/cells.jsonl``): a rerun measures only the missing.

A cell is one (prompt set, draft or no draft, K, concurrency) of the sweep. The harness
saves cells in units (:func:`resume_units`: the concurrency-1 cells of a prompt
set when the engines take turns, every other cell alone), one JSON line per unit, appended
as soon as the unit's last prompt is decoded::

    {"key": {"in_turns": ..., "cells": [cell key, ...]}, "results": [raw result, ...],
     "finished_utc": ...}

A raw result is what the record's run is built from: the counters, output tokens, wall
time, per-request times and histograms, outputs and the facts of an engine it started.
A rerun with the same ``--out`` reuses a unit whose key is there and measures the rest.

A cell's key (:func:`cell_key`) is everything its measurement depends on: the engine job
(target path, draft path, K, concurrency, the engine's ``max_num_seqs``, max new tokens,
ignore_eos, dtype, max_model_len, seed, enforce_eager, ...), the sha256 of the exact token
ids it decodes (so the prompt slice, prompts per slot and chat template), the prompt
set's spec and sha256, the target's config.json sha256, the draft's checkpoint sha256
(config.json and weights: a retrained draft is never mixed with old cells), the backend,
in-process engine core, the KV cache each engine gets, and the vLLM and torch versions.
Cells whose settings differ have other keys and are measured again, as an eval into a new
directory would: ``--out`` keeps meaning "write this run here"; the old lines stay, and a
rerun with the old settings reuses them. The package's own code is not in the key.

Each line goes out in one append and is fsynced; a last line cut short by a killed
process is dropped when the file is next opened, and its unit is measured again.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

from ..common.paths import writing
from ..engine.counters import SpecDecodeCounters
from ..engine.vllm_client import VllmJob

__all__ = ["CELLS_FILE", "FinishedCells", "cell_key"]

CELLS_FILE = "cells.jsonl"


def cell_key(job: VllmJob, setting: dict) -> dict:
    """The key of the cell ``job`` measures: ``job`` with its prompts replaced by their
    count and the sha256 of their token ids, merged with ``setting`` (what the job does not
    carry: input hashes, backend, KV cache, versions).

    Example: 2 prompts ``[[1, 2], [3]]`` -> ``{"prompts": 2, "prompts_sha256": sha256 of
    "[[1, 2], [3]]", "target": ..., "batch_size": ..., ...setting}``.
    """
    fields = job.to_json()
    prompts = fields.pop("prompts")
    digest = hashlib.sha256(json.dumps(prompts).encode()).hexdigest()
    return {**setting, **fields, "prompts": len(prompts), "prompts_sha256": digest}


def _canonical(key: dict) -> str:
    return json.dumps(key, sort_keys=True)


class FinishedCells:
    """The units ``path`` holds, by key: :meth:`get` one, :meth:`add` one.

    Opening drops a last line cut short (no newline at its end) from the file, so that the
    next append starts a line of its own; a line that is not JSON is skipped.
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        self.units: dict[str, list[dict]] = {}
        if not self.path.is_file():
            return
        data = self.path.read_bytes()
        complete = data[: data.rfind(b"\n") + 1]
        if len(complete) < len(data):
            with open(self.path, "r+b") as f:
                f.truncate(len(complete))
        for line in complete.decode("utf-8", errors="replace").splitlines():
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                continue
            self.units[_canonical(entry["key"])] = entry["results"]

    def get(self, key: dict) -> list[dict] | None:
        """The raw results of the unit ``key``, one per cell, or None if it is not here."""
        return self.units.get(_canonical(key))

    def add(self, key: dict, results: list[dict]) -> None:
        """Append the unit ``key`` with its cells' raw results, on disk before returning."""
        stamp = datetime.now(UTC).isoformat(timespec="seconds")
        line = json.dumps({"key": key, "results": results, "finished_utc": stamp}) + "\n"
        # a line cut short by a full disk is dropped on the next open, as a killed one is
        with writing(self.path, "a finished cell's line"), open(
            self.path, "a", encoding="utf-8"
        ) as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
        self.units[_canonical(key)] = results


def resume_units(jobs: Sequence, in_turns: bool) -> list[tuple[int, ...]]:
    """The groups of the harness's jobs (indices) that are saved and reused as one.

    Rule: when the engines take turns (:func:`~.harness.plan_turns`), the concurrency-1 jobs of one
    prompt set are one unit; every other job is a unit of its own. A speedup is a draft
    cell's tokens/s over the baseline's at the same concurrency; cells measured in turns
    owe that ratio to sharing the same minutes, whose drift cancels out of it, so a rerun
    reuses them all or measures them all again in turns, and never pairs a draft cell with
    a baseline measured in other turns. A job measured whole was paired across minutes
    from the start (one engine after another), so it stands alone.

    Example: no draft, K=1 and K=2 at c = 1, 4 on sets a, b, in turns -> units
    (a c=1: no draft, K=1, K=2), (b c=1: no draft, K=1, K=2), then each c=4 job alone.
    """
    units: dict[object, tuple[int, ...]] = {}
    for i, job in enumerate(jobs):
        together = in_turns and job.engine.batch_size == 1
        unit = ("turns", job.prompt_set) if together else i
        units[unit] = units.get(unit, ()) + (i,)
    return list(units.values())


def merge_pieces(pieces: Sequence[dict]) -> dict:
    """One cell's result from the results of its pieces, in prompt order: counts, tokens and
    decode time add up; per-request lists and outputs concatenate."""
    if len(pieces) == 1:
        return {**pieces[0], "pieces": 1}
    counters = None
    if pieces[0]["counters"] is not None:
        counters = sum((SpecDecodeCounters(**p["counters"]) for p in pieces), SpecDecodeCounters())
        counters = counters.to_dict()

    def joined(key: str) -> list | None:
        return None if pieces[0].get(key) is None else [v for p in pieces for v in p[key]]

    return {
        **pieces[0],
        "counters": counters,
        "output_tokens": sum(p["output_tokens"] for p in pieces),
        "wall_s": sum(p["wall_s"] for p in pieces),
        "time_per_output_token_s": joined("time_per_output_token_s"),
        "accepted_histograms": joined("accepted_histograms"),
        "outputs": joined("outputs"),
        "pieces": len(pieces),
    }
