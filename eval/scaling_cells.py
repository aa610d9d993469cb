"""The scaling curve's cells (``eval/scaling.py``): the long run's inputs, a cell's prefix data
and its one training run with a checkpoint on every requested step."""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import yaml

from speculators_peagle_plugin.common.devices import cpu_train_settings
from speculators_peagle_plugin.common.files import METRICS_FILE, atomic_directory, atomic_write_text
from speculators_peagle_plugin.demo.artifacts import RunLayout
from speculators_peagle_plugin.demo.stages import STATE_FILE
from speculators_peagle_plugin.options import config_argv, file_with
from speculators_peagle_plugin.training.train_config import TrainConfig

PREFIX_FILE, PLAN_FILE = "prefix.json", "plan.json"

Runner = Callable[[list[str]], None]


def echo(text: str) -> None:
    print(f"[scaling] {text}", file=sys.stderr, flush=True)


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ------------------------------------------------------------------------------ inputs


def run_inputs(run_dir: Path) -> dict:
    """The long run's target, data, validation data and prompts, from its ``stages.json``."""
    layout = RunLayout(run_dir)
    path = run_dir / STATE_FILE
    stages = json.loads(path.read_text()) if path.is_file() else {}
    missing = [s for s in ("target", "prompts", "data", "validation data") if s not in stages]
    if missing:
        raise SystemExit(
            f"{run_dir} holds no finished {' / '.join(missing)} stage in {STATE_FILE}; run "
            "`speculators-peagle demo --recipe configs/recipes/long_smollm2.yaml` first (or pass "
            "--run-dir)."
        )
    prompts_sha256 = digest(layout.prompts.read_bytes())
    if stages["data"]["inputs"]["prompts"] != prompts_sha256:
        raise SystemExit(
            f"{layout.prompts} is not the file {layout.data} was generated from (its sha256 "
            f"differs from the one {path} records)."
        )
    return {
        "target": stages["target"]["outputs"]["path"],
        "prompts": str(layout.prompts.resolve()),
        "prompts_sha256": prompts_sha256,
        # stages.json holds paths relative to where the demo ran: take them from the layout
        "data": str(layout.data.resolve()),
        "validation_data": str(layout.validation_data.resolve()),
        # served in the dtype the target wrote the data in, as the demo serves its draft
        # (bfloat16 where the CPU has it natively, else float32)
        "dtype": stages["data"]["inputs"].get("dtype", "float32"),
    }


def more_data_inputs(run_dir: Path, inputs: dict, dirs: Sequence[str]) -> list[dict]:
    """Each ``--more-data`` directory's data and prompts: a generate-data output of further
    training prompts, made with the run data's settings, whose prompts are neither the run's
    training nor its validation prompts (a larger cell reads the run's rows, then theirs)."""
    from speculators_peagle_plugin.data.layout import SETTINGS_FILE
    from speculators_peagle_plugin.data.prompts import read_training_prompts
    from speculators_peagle_plugin.datagen.output import IDENTITY_KEYS

    def settings(data: Path) -> dict:
        path = data / SETTINGS_FILE
        if not path.is_file():
            raise SystemExit(f"--more-data {data} holds no {SETTINGS_FILE}; give a "
                             "generate-data output directory.")
        return json.loads(path.read_text())

    def keys(prompts: str) -> set[str]:
        conversations, _ = read_training_prompts(prompts, guard=False)
        return {json.dumps(c, sort_keys=True) for c in conversations}

    run = settings(Path(inputs["data"]))
    validation = RunLayout(run_dir).validation_prompts
    seen = keys(inputs["prompts"]) | (keys(str(validation)) if validation.is_file() else set())
    more = []
    for name in dirs:
        data = Path(name).resolve()
        mine = settings(data)
        for key in (k for k in IDENTITY_KEYS if k != "prompts"):
            if mine.get(key) != run.get(key):
                raise SystemExit(
                    f"--more-data {name} was made with {key} {mine.get(key)!r}, the run's data "
                    f"with {run.get(key)!r}; generate it with the run's settings."
                )
        prompts = keys(mine["prompts"])
        shared = prompts & seen
        if shared:
            raise SystemExit(
                f"--more-data {name}: {len(shared)} of its prompts are already the run's "
                "training or validation prompts; give it only new prompts."
            )
        seen |= prompts
        more.append({"data": str(data), "prompts": mine["prompts"]})
    return more


def rendered_prompts(prompts: str, target: str) -> list[list[int]]:
    """The token ids generate-data's first request of each training prompt begins with:
    its system and first user turn in the target's chat template."""
    from transformers import AutoTokenizer

    from speculators_peagle_plugin.data.prompts import read_training_prompts, render_conversation

    tokenizer = AutoTokenizer.from_pretrained(target)
    conversations, _ = read_training_prompts(prompts, guard=False)
    firsts = [c[: next(i for i, m in enumerate(c) if m["role"] == "user") + 1]
              for c in conversations]
    return [render_conversation(tokenizer, turns) for turns in firsts]


def prompt_of_rows(rows: Sequence[Sequence[int]], prompts: Sequence[Sequence[int]]) -> list[int]:
    """The index of the prompt each data row answers.

    generate-data writes each prompt's rows in prompt order, and a row's ``input_ids`` begin
    with its prompt's tokens; a prompt may have no row (the contamination guard dropped it,
    or no reply token was supervised). So row r answers the first prompt, from row r-1's on,
    whose tokens begin it. Raises ``ValueError`` for a row no remaining prompt begins.
    Example: rows [[1, 2, 9], [3, 4, 8], [3, 4, 7], [5, 6]], prompts [[1, 2], [0], [3, 4],
    [5]] -> [0, 2, 2, 3] (prompt 1 has no row, prompt 2 two).
    """
    out, p = [], 0
    for r, ids in enumerate(rows):
        while p < len(prompts) and list(ids[: len(prompts[p])]) != list(prompts[p]):
            p += 1
        if p == len(prompts):
            start = out[-1] if out else 0
            raise ValueError(f"data row {r} begins with none of prompts {start} to {p - 1}")
        out.append(p)
    return out


# -------------------------------------------------------------------------------- data


def prefix_data(data: Path | Sequence[Path], rows: int, out: Path, draft_vocab_size: int) -> Path:
    """``out``: the first ``rows`` rows of the speculators data ``data``, ready for train.

    ``data``: one generate-data output, or several read one after another (the run's data,
    then ``--more-data``). The Arrow rows are copied (``select(range(rows))``,
    ``save_to_disk``); each ``hidden_states/hs_<i>.safetensors`` is a symbolic link to its
    source's file (row i of the second source is that source's row i - len(first));
    ``token_freq.pt`` is counted from these rows with speculators'
    ``save_token_frequency_distribution`` (what generate-data writes) and ``d2t``/``t2d``
    built from it (``TrainingData.vocab_mapping``, as train builds them). Kept while
    ``prefix.json`` names the same sources, rows and vocabulary size.
    Example: 4430 rows, rows 212 -> 212 Arrow rows, links hs_0 .. hs_211.
    """
    from datasets import concatenate_datasets, load_from_disk
    from speculators.train.vocab_mapping import save_token_frequency_distribution

    from speculators_peagle_plugin.data.dataset import open_training_data
    from speculators_peagle_plugin.data.layout import (
        HIDDEN_STATES_DIR,
        SETTINGS_FILE,
        TOKEN_FREQ_FILE,
        hs_path,
    )

    sources = [Path(data)] if isinstance(data, (str, Path)) else [Path(d) for d in data]
    names = [str(d.resolve()) for d in sources]
    marker = {"source": names[0] if len(names) == 1 else names, "rows": rows,
              "draft_vocab_size": draft_vocab_size}
    done = out / PREFIX_FILE
    if not (done.is_file() and json.loads(done.read_text()) == marker):
        with atomic_directory(out) as tmp:
            parts = [load_from_disk(str(d)) for d in sources]
            dataset = concatenate_datasets(parts).select(range(rows))
            dataset.save_to_disk(str(tmp))
            links = tmp / HIDDEN_STATES_DIR
            links.mkdir()
            i = 0
            for source, part in zip(sources, parts, strict=True):
                states = (source / HIDDEN_STATES_DIR).resolve()
                for j in range(min(len(part), rows - i)):
                    hs_path(links, i + j).symlink_to(hs_path(states, j))
                i += len(part)
            shutil.copy2(sources[0] / SETTINGS_FILE, tmp / SETTINGS_FILE)
            save_token_frequency_distribution(
                dataset.with_format("torch"), output_path=tmp / TOKEN_FREQ_FILE
            )
            open_training_data(tmp).vocab_mapping(draft_vocab_size)
            atomic_write_text(tmp / PREFIX_FILE, json.dumps(marker))
    open_training_data(out, draft_vocab_size=draft_vocab_size)  # opens as train opens it
    return out


def steps_per_epoch(data: Path, total_seq_len: int) -> int:
    """Optimizer steps of one epoch on one process: the packed rows (their count depends on
    the sample lengths alone, :func:`~speculators_peagle_plugin.data.packing.pack_rows`)."""
    from speculators_peagle_plugin.data.dataset import open_training_data
    from speculators_peagle_plugin.data.packing import pack_rows

    lengths = open_training_data(data).lengths
    return len(pack_rows(lengths, total_seq_len, list(range(len(lengths)))))


# ------------------------------------------------------------------------------- train


def checkpoint_count(steps: Sequence[int]) -> int:
    """Checkpoints one run holds: one every gcd(steps) steps up to max(steps)."""
    return max(steps) // math.gcd(*steps)


def checkpoint_plan(steps: Sequence[int], steps_per_epoch: int) -> dict:
    """train's settings that put a checkpoint on every step of ``steps`` in one run.

    train checkpoints every ``floor(checkpoint_freq * steps_per_epoch)`` steps and at its
    last one (training/loop.py). Every requested step is a multiple of their greatest common
    divisor g, so a checkpoint every g steps of a max(steps)-step run lands on each:
    ``checkpoint_freq`` (g + 1/2) / steps_per_epoch keeps the floor at g under any float
    rounding, ``epochs`` ceil(max / steps_per_epoch) lets ``max_steps`` end the run, and
    ``keep_checkpoints`` max / g keeps them all until it ends (:func:`train_cell` adds room
    for the checkpoints of stopped runs).
    Example: steps 500, 1000, 2000, 4000 at 170 steps an epoch -> a checkpoint every 500
    steps (checkpoint_freq 2.944...), 24 epochs, 8 checkpoints kept.
    """
    every, last = math.gcd(*steps), max(steps)
    return {
        "max_steps": last,
        "every": every,
        "steps_per_epoch": steps_per_epoch,
        "epochs": math.ceil(last / steps_per_epoch),
        "checkpoint_freq": (every + 0.5) / steps_per_epoch,
        "keep_checkpoints": last // every,
    }


def train_yaml(config: Path, path: Path, native_bf16: bool) -> Path:
    """The recipe's training YAML for fixed-step runs, written to ``path``: no early stop
    (every cell trains exactly its steps), and float32 matmuls where the CPU multiplies
    bfloat16 only by emulation, as the demo trains."""
    settings = file_with(TrainConfig, yaml.safe_load(config.read_text()),
                         cpu_train_settings(native_bf16),
                         drop=("early_stop_patience", "validation_data_path"))
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, yaml.safe_dump(settings, sort_keys=False))
    return path


def cell_name(prompts: int | str, layers: int | str, seed: int | str) -> str:
    """A cell's folder name under ``<out>/cells``: ``cell_name(8745, 2, 43)`` -> ``p8745-l2-s43``
    (``"*"`` for any part makes a glob)."""
    return f"p{prompts}-l{layers}-s{seed}"


def check_schedule(cells_dir: Path, prompts: int, layers: int, last: int) -> None:
    """Refuse seeds of one prompts x layers cell on different schedules: the report averages
    a cell's seeds at each step, and S steps of a run that decays to 0 at another last step
    is another point."""
    for plan_path in sorted(cells_dir.glob(f"{cell_name(prompts, layers, '*')}/{PLAN_FILE}")):
        other = json.loads(plan_path.read_text())["max_steps"]
        if other != last:
            raise SystemExit(
                f"{plan_path.parent.name} was trained for {other} steps and this grid's "
                f"largest --steps is {last}: seeds of one cell must share their largest step, "
                "or the report would average different schedules; use the same largest "
                "step or another --out."
            )


def train_cell(cell_dir: Path, plan: dict, train_args: list[str], steps: Sequence[int],
               runner: Runner) -> Path:
    """Train the cell (or resume it), then delete the checkpoints no step asked for; returns
    its save path. A cell trained under another plan is refused."""
    from speculators_peagle_plugin.training.checkpoint import CHECKPOINT_PREFIX, checkpoint_dirs

    plan_path, save = cell_dir / PLAN_FILE, cell_dir / "train"
    if plan_path.is_file() and json.loads(plan_path.read_text()) != plan:
        raise SystemExit(
            f"{cell_dir} was trained with other settings ({plan_path}); rerun with its "
            "--steps and --config, or use another --out."
        )
    cell_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(plan_path, json.dumps(plan, indent=1) + "\n")

    def step_of(checkpoint: Path) -> int:
        return int(checkpoint.name[len(CHECKPOINT_PREFIX) :])

    last = save / f"{CHECKPOINT_PREFIX}{plan['max_steps']}"
    if last not in checkpoint_dirs(save):
        # A stopped run saves where it stopped, off the grid, and train's rotation counts
        # those checkpoints too: room for each earlier one and for one more, or the
        # rotation would delete the earliest requested steps.
        stopped = sum(step_of(c) % plan["every"] != 0 for c in checkpoint_dirs(save))
        runner(["train", *train_args, *config_argv(TrainConfig, {
            "save_path": str(save), "max_steps": plan["max_steps"], "epochs": plan["epochs"],
            "checkpoint_freq": plan["checkpoint_freq"],
            "keep_checkpoints": plan["keep_checkpoints"] + stopped + 1, "log_freq": 1,
        })])
    for checkpoint in checkpoint_dirs(save):
        if step_of(checkpoint) not in steps:
            shutil.rmtree(checkpoint)
    return save


def trained_until(save: Path, step: int) -> dict:
    """Tokens and seconds of the optimizer steps up to ``step`` (the metrics log; a resumed
    run's log continues its own, start-up and checkpoint saving are not counted)."""
    records = [json.loads(line) for line in (save / METRICS_FILE).read_text().splitlines()]
    upto = [r for r in records if r["step"] <= step]
    return {
        "tokens_trained": int(sum(r["tokens"] for r in upto)),
        "train_s": sum(r["tokens"] / r["tokens_per_s"] for r in upto),
    }
