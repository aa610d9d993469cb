"""The scaling curve: served acceptance against training prompts, optimizer steps and depth.

Usage (after the long recipe,
``speculators-peagle demo --recipe configs/recipes/long_smollm2.yaml``, whose target,
training data and validation data every cell shares)::

    .venv/bin/python -m eval.scaling --run-dir runs/long --prompts 220,1000,4430 \\
        --steps 500,1000,2000,4000 --num-layers 1,2 --seeds 42 [--more-data DIR] \\
        [--config configs/long_smollm2_train.yaml] [--out runs/scaling] [--report eval/scaling]

A cell is N prompts, a draft of L layers and a seed. ``--more-data`` adds prompts beyond the
run's: a generate-data output of further prompts made with the run data's settings (for
example the same mix with more ShareGPT, its first prompts the run's, left out), read after
the run's own rows.

- data: ``OUT/data/prompts-<N>``, the rows of the run's first N training prompts
  (``train_prompts.jsonl``: the demo's 220, then MBPP, then ShareGPT), hidden states
  linked, not copied; ``token_freq.pt`` and ``d2t``/``t2d`` are counted again from those
  rows alone, with the functions generate-data and train use, so the draft vocabulary is
  the one N prompts give (:func:`prefix_data`);
- train: one ``speculators-peagle train`` run of max(steps) optimizer steps with the
  recipe's YAML, fixed steps (no early stop), a checkpoint on every requested step
  (:func:`checkpoint_plan`); the checkpoints between them are deleted when it ends. A
  checkpoint at step S shares the longest run's learning-rate schedule (1 % warmup, then
  linear decay to 0 at max(steps)): it is that run seen at S, not an S-step run of its own,
  whose rate would have decayed to 0 at S;
- points, one per requested step: served acceptance (``speculators-peagle eval``: K 4,
  greedy, 16 requests in flight x 5, that is HumanEval[120:164] and all 80 MT-Bench first
  turns, compiled engines as ``vllm serve`` runs them, in the dtype the run's data was made
  in), and the estimated acceptance on the run's validation data
  (:func:`~speculators_peagle_plugin.training.heldout.heldout_metrics`), so the curve can
  be read from both.

Resumable: a prefix, a finished training run and a finished point are kept
(``OUT/cells/p<N>-l<L>-s<seed>/{plan.json,train/,step-<S>/point.json}``); an interrupted
run resumes from its newest checkpoint, and an eval whose ``record.json`` is there for the
same checkpoint and settings is not run again. A cell trained with other steps or another
YAML is refused. OUT (git-ignored ``runs/scaling`` by default) holds the bulk: prefix data
and checkpoints. ``REPORT/scaling.json`` holds every point under OUT (so a second
invocation, three seeds at the adopted points, adds to the first), ``REPORT/scaling.png``
draws them (REPORT: ``eval/scaling``, beside eval/RESULTS.md), and
the markdown tables (rows prompts x layers, columns steps; mean ± sample std over seeds
where there are several) are printed for eval/RESULTS.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import yaml

from eval.demo_run import run_command
from speculators_peagle_plugin.common.files import (
    METRICS_FILE,
    atomic_directory,
    atomic_write,
    atomic_write_text,
)
from speculators_peagle_plugin.demo.artifacts import RunLayout
from speculators_peagle_plugin.demo.stages import STATE_FILE

# What every point is served with (the long recipe's held-out sets, at its larger K).
EVAL_SETS = ("humaneval[120:164]", "mt_bench")
EVAL_K = 4
EVAL_CONCURRENCY = 16
EVAL_PROMPTS_PER_SLOT = 5  # 16 x 5 = all 80 MT-Bench questions and HumanEval's 44
EVAL_MAX_NEW_TOKENS = 128
EVAL_KV_CACHE_GB = 4
ESTIMATE = "held-out estimate"
# checkpoints one run holds at once (every gcd(steps) steps up to max(steps))
MAX_CHECKPOINTS = 32
PREFIX_FILE, PLAN_FILE, POINT_FILE = "prefix.json", "plan.json", "point.json"

Runner = Callable[[list[str]], None]


def _cli(args: list[str]) -> None:
    """``speculators-peagle ARGS`` in a child process (exits with one line if it fails)."""
    run_command([sys.executable, "-m", "speculators_peagle_plugin", *args])


def _echo(text: str) -> None:
    print(f"[scaling] {text}", file=sys.stderr, flush=True)


def _sha256(data: bytes) -> str:
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
    prompts_sha256 = _sha256(layout.prompts.read_bytes())
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
    from speculators_peagle_plugin.datagen.build_data import _IDENTITY_KEYS

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
        for key in (k for k in _IDENTITY_KEYS if k != "prompts"):
            if mine.get(key) != run.get(key):
                raise SystemExit(
                    f"--more-data {name} was made with {key} {mine.get(key)!r}, the run's data "
                    f"with {run.get(key)!r}; generate it with the run's settings."
                )
        shared = keys(mine["prompts"]) & seen
        if shared:
            raise SystemExit(
                f"--more-data {name}: {len(shared)} of its prompts are already the run's "
                "training or validation prompts; give it only new prompts."
            )
        seen |= keys(mine["prompts"])
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
    ``keep_checkpoints`` max / g keeps them all until it ends.
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
    settings = yaml.safe_load(config.read_text())
    settings.pop("early_stop_patience", None)
    settings.pop("validation_data_path", None)
    if not native_bf16:
        settings["autocast"] = "none"
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, yaml.safe_dump(settings, sort_keys=False))
    return path


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
    last = save / f"{CHECKPOINT_PREFIX}{plan['max_steps']}"
    if last not in checkpoint_dirs(save):
        runner([
            "train", *train_args, "--save-path", str(save),
            "--max-steps", str(plan["max_steps"]), "--epochs", str(plan["epochs"]),
            "--checkpoint-freq", repr(plan["checkpoint_freq"]),
            "--keep-checkpoints", str(plan["keep_checkpoints"]), "--log-freq", "1",
        ])
    for checkpoint in checkpoint_dirs(save):
        if int(checkpoint.name[len(CHECKPOINT_PREFIX) :]) not in steps:
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


# ------------------------------------------------------------------------------ points


def eval_settings(dtype: str) -> dict:
    """What every point is served with, as ``record.json``'s ``config`` holds it."""
    return {
        "prompt_sets": list(EVAL_SETS), "ks": [EVAL_K], "concurrency": [EVAL_CONCURRENCY],
        "prompts_per_slot": EVAL_PROMPTS_PER_SLOT, "max_new_tokens": EVAL_MAX_NEW_TOKENS,
        "baseline": False, "dtype": dtype, "kv_cache_gb": EVAL_KV_CACHE_GB,
        "enforce_eager": False,
    }


def eval_args(target: str, checkpoint: Path, dtype: str, out: Path) -> list[str]:
    """``speculators-peagle eval`` of one checkpoint with :func:`eval_settings`."""
    args = ["eval", "--target", target, "--draft", str(checkpoint), "-k", str(EVAL_K),
            "--concurrency", str(EVAL_CONCURRENCY),
            "--prompts-per-slot", str(EVAL_PROMPTS_PER_SLOT), "--no-baseline",
            "--max-new-tokens", str(EVAL_MAX_NEW_TOKENS), "--dtype", dtype,
            "--kv-cache-gb", str(EVAL_KV_CACHE_GB), "--out", str(out)]
    for spec in EVAL_SETS:
        args += ["--prompts", spec]
    return args


def finished_eval(record_path: Path, checkpoint: Path, sha256: str, dtype: str) -> bool:
    """Whether ``record_path`` is an eval of this checkpoint (same weights) with
    :func:`eval_settings`."""
    if not record_path.is_file():
        return False
    record = json.loads(record_path.read_text())
    drafts = [(d["path"], d["sha256"]) for d in record["drafts"]]
    settings = eval_settings(dtype)
    return drafts == [(str(checkpoint.resolve()), sha256)] and all(
        record["config"].get(k) == v for k, v in settings.items()
    )


def served_figures(record: dict, checkpoint: Path) -> dict:
    """``{prompt set: {acceptance_length, per_position}}`` of the checkpoint at K 4."""
    return {
        r["prompt_set"]: {"acceptance_length": r["acceptance_length"],
                          "per_position": r["per_position"]}
        for r in record["runs"]
        if r["draft"] == str(checkpoint.resolve()) and r["k"] == EVAL_K
    }


def measure_point(cell: dict, checkpoint: Path, step: int, inputs: dict, config,
                  runner: Runner) -> dict:
    """One point: the checkpoint at ``step`` served and scored on held-out data
    (``step-<S>/point.json``, kept while the checkpoint's weights are the same)."""
    from speculators_peagle_plugin.evaluation.report import checkpoint_hash
    from speculators_peagle_plugin.training.heldout import heldout_metrics

    point_dir = Path(cell["dir"]) / f"step-{step}"
    done, record_path = point_dir / POINT_FILE, point_dir / "eval" / "record.json"
    sha256 = checkpoint_hash(checkpoint)
    if done.is_file():
        point = json.loads(done.read_text())
        if point["checkpoint_sha256"] == sha256:
            return point
    eval_s = None
    if not finished_eval(record_path, checkpoint, sha256, inputs["dtype"]):
        began = time.perf_counter()
        runner(eval_args(inputs["target"], checkpoint, inputs["dtype"], record_path.parent))
        eval_s = time.perf_counter() - began
    served = served_figures(json.loads(record_path.read_text()), checkpoint)
    began = time.perf_counter()
    held = heldout_metrics(checkpoint, config, inputs["validation_data"])
    point = {
        **{k: cell[k] for k in ("prompts", "rows", "layers", "seed")},
        "step": step,
        **trained_until(checkpoint.parent, step),
        "checkpoint": str(checkpoint),
        "checkpoint_sha256": sha256,
        "eval_s": eval_s,  # None: the eval ran in an earlier invocation
        "heldout_s": time.perf_counter() - began,
        "served": served,
        "heldout": {k: held[k] for k in ("acceptance_length", "accuracy_per_depth", "loss")},
        "eval_record": str(record_path),
    }
    atomic_write_text(done, json.dumps(point, indent=1) + "\n")
    return point


# ----------------------------------------------------------------------------- results


def figures(point: dict) -> dict[str, float]:
    """A point's acceptance lengths by where they come from."""
    out = {f"served {s}": v["acceptance_length"] for s, v in point["served"].items()}
    out[ESTIMATE] = point["heldout"]["acceptance_length"]
    return out


def summarise(points: list[dict]) -> dict[tuple[int, int, int], dict[str, dict]]:
    """Per (prompts, layers, step) and figure: mean, sample std (0 for one seed), count."""
    groups: dict[tuple[int, int, int], list[dict]] = {}
    for p in points:
        groups.setdefault((p["prompts"], p["layers"], p["step"]), []).append(figures(p))
    out = {}
    for key, rows in sorted(groups.items()):
        names = [n for n in rows[0] if all(r.get(n) is not None for r in rows)]
        values = {n: [r[n] for r in rows] for n in names}
        out[key] = {n: {"mean": statistics.fmean(v),
                        "std": statistics.stdev(v) if len(v) > 1 else 0.0, "n": len(v)}
                    for n, v in values.items()}
    return out


def _figure_names(summary: dict) -> list[str]:
    names = {n for figs in summary.values() for n in figs}
    return sorted(names - {ESTIMATE}) + [ESTIMATE]


def tables(summary: dict) -> str:
    """Markdown, one table per figure: a row per prompts x layers, a column per step;
    ``mean ± std (n)`` where several seeds were measured."""
    steps = sorted({s for _, _, s in summary})
    rows = sorted({(n, layers) for n, layers, _ in summary})
    text = []
    for name in _figure_names(summary):
        text += [f"**{name}** (acceptance length, K={EVAL_K})", "",
                 "| prompts × layers | " + " | ".join(map(str, steps)) + " |",
                 "|---|" + "---:|" * len(steps)]
        for n, layers in rows:
            cells = []
            for step in steps:
                s = summary.get((n, layers, step), {}).get(name)
                if s is None:
                    cells.append("-")
                elif s["n"] > 1:
                    cells.append(f"{s['mean']:.3f} ± {s['std']:.3f} ({s['n']})")
                else:
                    cells.append(f"{s['mean']:.3f}")
            text.append(f"| {n} × {layers} | " + " | ".join(cells) + " |")
        text.append("")
    return "\n".join(text)


def plot(summary: dict, path: Path) -> Path:
    """Acceptance length against steps: a panel per figure, a colour per prompts count, a
    line style per draft depth, error bars of the std over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = _figure_names(summary)
    counts = sorted({n for n, _, _ in summary})
    styles = ["-", "--", ":", "-."]
    fig, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 4), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        for n, layers in sorted({(n, layers) for n, layers, _ in summary}):
            line = [(s, f[name]) for (pn, pl, s), f in sorted(summary.items())
                    if (pn, pl) == (n, layers) and name in f]
            if not line:
                continue
            ax.errorbar([s for s, _ in line], [f["mean"] for _, f in line],
                        yerr=[f["std"] for _, f in line], marker="o", capsize=3,
                        color=f"C{counts.index(n)}", linestyle=styles[(layers - 1) % 4],
                        label=f"{n} prompts, {layers} layer{'s' * (layers > 1)}")
        ax.set_xscale("log", base=2)
        ax.set_title(name)
        ax.set_xlabel("optimizer steps")
        ax.set_ylabel(f"acceptance length (K={EVAL_K})")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=120, format="png"))
    plt.close(fig)
    return path


# -------------------------------------------------------------------------------- grid


def _ints(text: str, flag: str, low: int) -> list[int]:
    try:
        values = sorted({int(v) for v in text.split(",")})
    except ValueError:
        values = []
    if not values or values[0] < low:
        kind = "positive integers" if low == 1 else f"integers >= {low}"
        raise SystemExit(f"{flag} must be comma-separated {kind}, got {text!r}.")
    return values


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-dir", default="runs/long", help="A long-recipe run directory.")
    parser.add_argument("--prompts", default="220,1000,4430", help="Prefix sizes, in prompts.")
    parser.add_argument("--steps", default="500,1000,2000,4000",
                        help="Optimizer steps at which each cell is measured.")
    parser.add_argument("--seeds", action="append",
                        help="Comma-separated; repeatable [default: 42].")
    parser.add_argument("--num-layers", default="1,2", help="Draft depths.")
    parser.add_argument("--more-data", action="append", default=[],
                        help="A generate-data output of further training prompts, made with "
                        "the run data's settings; read after the run's (repeatable).")
    parser.add_argument("--config", default="configs/long_smollm2_train.yaml",
                        help="The training YAML.")
    parser.add_argument("--out", default="runs/scaling",
                        help="Prefix data, checkpoints and eval records.")
    parser.add_argument("--report", default="eval/scaling",
                        help="scaling.json and scaling.png, for eval/RESULTS.md.")
    args = parser.parse_args(argv)
    args.prompts = _ints(args.prompts, "--prompts", 1)
    args.steps = _ints(args.steps, "--steps", 1)
    args.seeds = _ints(",".join(args.seeds or ["42"]), "--seeds", 0)
    args.num_layers = _ints(args.num_layers, "--num-layers", 1)
    if checkpoint_count(args.steps) > MAX_CHECKPOINTS:
        raise SystemExit(
            f"--steps {','.join(map(str, args.steps))} need a checkpoint every "
            f"{math.gcd(*args.steps)} steps (their greatest common divisor), "
            f"{checkpoint_count(args.steps)} in one run; choose steps with a larger common "
            f"divisor (at most {MAX_CHECKPOINTS} checkpoints)."
        )
    return args


def run_grid(args: argparse.Namespace, runner: Runner = _cli) -> dict:
    """Every cell of the grid (prefix-major: the smallest first), then the record of every
    point under ``args.out``, the plot and the tables (``args.report``); returns the record."""
    from datasets import load_from_disk

    from speculators_peagle_plugin.demo.pipeline import _cpu_has_bfloat16
    from speculators_peagle_plugin.evaluation.report import provenance
    from speculators_peagle_plugin.training.train_config import TrainConfig

    run_dir, out = Path(args.run_dir), Path(args.out).resolve()
    inputs = run_inputs(run_dir)
    if not Path(args.config).is_file():
        raise SystemExit(f"--config {args.config} is not a file; give the training YAML.")
    inputs["more_data"] = more_data_inputs(run_dir, inputs, args.more_data)
    sources = [{"data": inputs["data"], "prompts": inputs["prompts"]}, *inputs["more_data"]]
    of_row, total = [], 0  # the prompt (counted over every source) each row answers
    for source in sources:
        _echo(f"mapping the rows of {source['data']} to {source['prompts']}")
        prompt_ids = rendered_prompts(source["prompts"], inputs["target"])
        rows = load_from_disk(source["data"]).with_format(None)["input_ids"]
        try:
            of_row += [total + p for p in prompt_of_rows(rows, prompt_ids)]
        except ValueError as err:
            msg = f"{source['data']} was not generated from {source['prompts']}: {err}."
            raise SystemExit(msg) from None
        total += len(prompt_ids)
    too_many = [n for n in args.prompts if n > total]
    if too_many:
        raise SystemExit(
            f"--prompts {too_many[0]} is more than the {total} prompts of "
            f"{' + '.join(s['prompts'] for s in sources)}."
        )
    native_bf16 = _cpu_has_bfloat16()
    yaml_path = train_yaml(Path(args.config), out / "train.yaml", native_bf16)
    yaml_sha256 = _sha256(yaml_path.read_bytes())

    def config_for(data: Path, save: Path, layers: int, seed: int) -> TrainConfig:
        return TrainConfig.from_sources(
            str(yaml_path), verifier_name_or_path=inputs["target"], data_path=str(data),
            save_path=str(save), num_layers=layers, seed=seed,
        )

    vocab = config_for(Path(inputs["data"]), out, 1, 0).draft.draft_vocab_size
    cells = [(n, layers, seed) for n in args.prompts for layers in args.num_layers
             for seed in args.seeds]
    for i, (n, layers, seed) in enumerate(cells):
        count = sum(p < n for p in of_row)  # rows come in prompt order
        if count == 0:
            raise SystemExit(f"the first {n} prompts of {inputs['prompts']} have no data row.")
        data = out / "data" / f"prompts-{n}"
        name = f"p{n}-l{layers}-s{seed}"
        _echo(f"[{i + 1}/{len(cells)}] {name}: data {data} ({count} rows)")
        prefix_data([Path(s["data"]) for s in sources], count, data, vocab)
        config = config_for(data, out / "cells" / name / "train", layers, seed)
        cell = {"dir": str(out / "cells" / name), "prompts": n, "rows": count,
                "layers": layers, "seed": seed}
        per_epoch = steps_per_epoch(data, config.data.total_seq_len)
        plan = {**{k: cell[k] for k in ("prompts", "rows", "layers", "seed")},
                "steps": args.steps, "config_sha256": yaml_sha256, "data": str(data),
                **checkpoint_plan(args.steps, per_epoch)}
        _echo(f"[{i + 1}/{len(cells)}] {name}: train {plan['max_steps']} steps, a checkpoint "
              f"every {plan['every']} ({plan['steps_per_epoch']} steps an epoch)")
        train_args = ["--config", str(yaml_path), "--verifier-name-or-path", inputs["target"],
                      "--data-path", str(data), "--num-layers", str(layers),
                      "--seed", str(seed)]
        save = train_cell(Path(cell["dir"]), plan, train_args, args.steps, runner)
        for step in args.steps:
            _echo(f"[{i + 1}/{len(cells)}] {name}: step {step}: eval + held-out estimate")
            measure_point(cell, save / f"checkpoint-{step}", step, inputs, config, runner)
    points = [json.loads(p.read_text()) for p in sorted(out.glob(f"cells/*/step-*/{POINT_FILE}"))]
    summary = summarise(points)
    record = {
        "provenance": provenance(["python", "-m", "eval.scaling", *sys.argv[1:]]),
        "native_bfloat16": native_bf16,
        "run": inputs,
        "train_yaml": str(yaml_path),
        "eval": eval_settings(inputs["dtype"]),
        "grid": {k: getattr(args, k) for k in ("prompts", "steps", "seeds", "num_layers")},
        "points": points,
        "summary": [
            {"prompts": n, "layers": layers, "step": s, **figs}
            for (n, layers, s), figs in summary.items()
        ],
    }
    report = Path(args.report)
    report.mkdir(parents=True, exist_ok=True)
    atomic_write_text(report / "scaling.json", json.dumps(record, indent=1) + "\n")
    if summary:
        plot(summary, report / "scaling.png")
    print(tables(summary))
    print(f"record: {report / 'scaling.json'}  plot: {report / 'scaling.png'}")
    return record


def main() -> None:
    run_grid(parse_args())


if __name__ == "__main__":
    main()
