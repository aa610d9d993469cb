"""Where one vLLM decode step goes, with and without the draft, at one request in flight.

Runs vLLM's engine core in this process and times, per engine step, the parts of vLLM's
own model runner (class-level wrappers, installed before the engine is built):

- ``target forward``: ``GPUModelRunner._model_forward`` (the target over the scheduled
  tokens: 1 per step without a draft, K + 1 with one);
- ``draft forward``: the draft model's ``forward`` inside the proposer (one parallel pass);
- ``drafting, rest``: the proposer's input preparation and draft sampling
  (``SpecDecodeBaseProposer.propose`` minus the draft's forward);
- ``rejection sampling``: ``RejectionSampler.forward``; ``sampling``: ``GPUModelRunner._sample``
  without it (the plain step's sampler);
- ``runner, rest``: the rest of ``execute_model`` + ``sample_tokens`` (input preparation,
  attention metadata, bookkeeping);
- ``scheduler + outputs``: the engine step's wall time minus the model runner's.

The step is ``LLMEngine.step``; figures are milliseconds per step (mean over all steps
after the first ``--warmup`` requests) and per output token. The engines compile the models
as ``vllm serve`` does, unless ``--enforce-eager``.

    .venv/bin/python -m eval.profile_step --target DIR --draft runs/demo/trained-draft -k 2,4
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

TIMES: dict[str, float] = defaultdict(float)
PARTS = (
    "target forward", "draft forward", "drafting, rest", "rejection sampling", "sampling",
    "runner, rest", "scheduler + outputs",
)


@contextmanager
def _timed(name: str):
    start = time.perf_counter()
    try:
        yield
    finally:
        TIMES[name] += time.perf_counter() - start


def _wrap(cls, method: str, name: str) -> None:
    original = getattr(cls, method)

    def timed(self, *args, **kwargs):
        with _timed(name):
            return original(self, *args, **kwargs)

    setattr(cls, method, timed)


def _install_timers() -> None:
    """Wrap vLLM's runner, proposer and samplers (before any engine exists)."""
    from vllm.v1.sample.rejection_sampler import RejectionSampler
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    _wrap(GPUModelRunner, "_model_forward", "target forward")
    _wrap(GPUModelRunner, "_sample", "sampling (with rejection)")
    _wrap(GPUModelRunner, "execute_model", "runner")
    _wrap(GPUModelRunner, "sample_tokens", "runner")
    _wrap(RejectionSampler, "forward", "rejection sampling")
    _wrap(SpecDecodeBaseProposer, "propose", "drafting")
    load_model = SpecDecodeBaseProposer.load_model

    def load_and_time_forward(self, *args, **kwargs):
        load_model(self, *args, **kwargs)
        forward = self.model.forward

        def timed_forward(*a, **kw):
            with _timed("draft forward"):
                return forward(*a, **kw)

        self.model.forward = timed_forward

    SpecDecodeBaseProposer.load_model = load_and_time_forward


def _profile(worker, job_cls, args, prompts, draft: str | None, k: int | None) -> dict:
    """Decode ``prompts`` one at a time; the per-step breakdown after the warm-up."""
    job = job_cls(
        target=args.target, prompts=prompts[: args.warmup], max_tokens=args.max_new_tokens,
        batch_size=1, draft=draft, num_speculative_tokens=k, dtype=args.dtype,
        enforce_eager=args.enforce_eager,
    )
    worker.run(job)  # builds the engine and warms it up
    engine = worker.llm.llm_engine
    steps, step_s = 0, 0.0
    original_step = engine.step

    def counted_step():
        nonlocal steps, step_s
        start = time.perf_counter()
        try:
            return original_step()
        finally:
            steps += 1
            step_s += time.perf_counter() - start

    TIMES.clear()
    engine.step = counted_step
    try:
        result = worker.run(dataclasses.replace(job, prompts=prompts[args.warmup :]))
    finally:
        engine.step = original_step
    t = dict(TIMES)
    parts = {
        "target forward": t.get("target forward", 0.0),
        "draft forward": t.get("draft forward", 0.0),
        "drafting, rest": t.get("drafting", 0.0) - t.get("draft forward", 0.0),
        "rejection sampling": t.get("rejection sampling", 0.0),
        "sampling": t.get("sampling (with rejection)", 0.0) - t.get("rejection sampling", 0.0),
    }
    parts["runner, rest"] = t.get("runner", 0.0) - sum(parts.values())
    parts["scheduler + outputs"] = step_s - t.get("runner", 0.0)
    tokens = result["output_tokens"]
    counters = result["counters"]
    return {
        "draft": draft,
        "k": k,
        "steps": steps,
        "output_tokens": tokens,
        "tokens_per_step": tokens / steps,
        "acceptance_length": None if counters is None else _acceptance(counters),
        "step_ms": 1e3 * step_s / steps,
        "ms_per_step": {name: 1e3 * parts[name] / steps for name in PARTS},
        "ms_per_token": 1e3 * step_s / tokens,
    }


def _acceptance(counters: dict) -> float:
    return 1 + counters["num_accepted_tokens"] / max(counters["num_drafts"], 1)


def _table(rows: list[dict]) -> str:
    head = ["draft", "K", "tokens/step", "step ms", *PARTS, "ms/token"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [
            "no draft" if r["draft"] is None else Path(r["draft"]).name,
            "-" if r["k"] is None else str(r["k"]),
            f"{r['tokens_per_step']:.3f}",
            f"{r['step_ms']:.1f}",
            *(f"{r['ms_per_step'][p]:.1f}" for p in PARTS),
            f"{r['ms_per_token']:.1f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True, help="Local target model directory.")
    parser.add_argument("--draft", required=True, help="P-EAGLE checkpoint directory.")
    parser.add_argument("-k", default="2,4", help="Comma-separated K values. [2,4]")
    parser.add_argument("--prompts", default="humaneval[120:136]", help="Prompt set spec.")
    parser.add_argument("--warmup", type=int, default=2, help="Untimed first requests. [2]")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--kv-cache-gb", type=int, default=4)
    parser.add_argument(
        "--enforce-eager",
        action="store_true",
        help="Uncompiled engines (vLLM serves compiled ones by default).",
    )
    parser.add_argument("--out", default="runs/profile-step", help="Output directory.")
    args = parser.parse_args()
    args.ks = [int(k) for k in args.k.split(",")]
    return args


def main() -> None:
    args = _parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.kv_cache_gb))
    import vllm  # noqa: F401 - vLLM first, so that it imports torch on its own terms
    from transformers import AutoTokenizer

    from speculators_peagle_plugin.data.prompts import load_prompt_set, render_prompts
    from speculators_peagle_plugin.engine.vllm_client import VllmJob
    from speculators_peagle_plugin.engine.vllm_worker import Worker
    from speculators_peagle_plugin.evaluation.report import provenance

    _install_timers()
    args.target = str(Path(args.target).expanduser().resolve())
    draft = str(Path(args.draft).expanduser().resolve())
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    prompts = render_prompts(tokenizer, load_prompt_set(args.prompts))
    if len(prompts) <= args.warmup:
        raise SystemExit(f"--prompts {args.prompts} has {len(prompts)} prompts; it needs "
                         f"more than --warmup {args.warmup}.")
    worker = Worker(emit=lambda message: None)
    rows = []
    try:
        for d, k in [(None, None), *((draft, k) for k in args.ks)]:
            rows.append(_profile(worker, VllmJob, args, prompts, d, k))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    finally:
        worker.shutdown()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {"provenance": provenance(), "args": vars(args), "rows": rows}
    (out / "profile.json").write_text(json.dumps(record, indent=1) + "\n")
    print(_table(rows))


if __name__ == "__main__":
    main()
