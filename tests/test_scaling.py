"""eval/scaling.py: prefix data, one real run on the checkpoint plan, resuming, the record,
plot and tables, and its one-sentence refusals, on the tiny work directory (no vLLM:
commands are faked)."""

import hashlib
import json
import shutil
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers.scaling import checkpoints_of_loop  # noqa: E402

from eval import scaling  # noqa: E402

TINY_YAML = {
    "algorithm": "peagle", "draft_vocab_size": 40, "num_depths": 3, "total_seq_len": 96,
    "lr": 0.01, "checkpoint_freq": 0.5, "early_stop_patience": 2, "dtype": "float32",
}


@pytest.fixture(scope="module")
def run_dir(tiny_workdir_once, tmp_path_factory):
    """A long-recipe run directory over the tiny work directory: its 16 prompts, its data
    (also standing in for the validation data) and its target, in ``stages.json``."""
    root = tmp_path_factory.mktemp("run") / "long"
    root.mkdir()
    shutil.copy(tiny_workdir_once / "prompts.jsonl", root / "train_prompts.jsonl")
    (root / "data").symlink_to(tiny_workdir_once / "data")
    (root / "validation-data").symlink_to(tiny_workdir_once / "data")
    sha = hashlib.sha256((root / "train_prompts.jsonl").read_bytes()).hexdigest()
    stages = {
        "target": {"outputs": {"path": str(tiny_workdir_once / "target")}},
        "prompts": {"outputs": {"count": 16, "sha256": sha}},
        "data": {"inputs": {"prompts": sha, "dtype": "float32"}},
        "validation data": {"inputs": {"prompts": "other"}},
    }
    (root / "stages.json").write_text(json.dumps(stages))
    (root.parent / "tiny.yaml").write_text(yaml.safe_dump(TINY_YAML))
    return root


def rows_of(data):
    from datasets import load_from_disk

    return load_from_disk(str(data)).with_format(None)


def test_rows_map_to_the_prompts_they_answer(run_dir):
    rows = [[1, 2, 9], [3, 4, 8], [3, 4, 7], [5, 6]]
    assert scaling.prompt_of_rows(rows, [[1, 2], [0], [3, 4], [5]]) == [0, 2, 2, 3]
    with pytest.raises(ValueError, match="data row 3 begins with none of prompts 1 to 2"):
        scaling.prompt_of_rows(rows, [[1, 2], [3, 4], [7]])
    # generate-data's own output: one row per prompt, in prompt order
    inputs = scaling.run_inputs(run_dir)
    prompts = scaling.rendered_prompts(inputs["prompts"], inputs["target"])
    ids = rows_of(inputs["data"])["input_ids"]
    assert len(prompts) == len(ids) == 16
    assert scaling.prompt_of_rows(ids, prompts) == list(range(16))
    # a prompt with no row (as one the contamination guard drops) is skipped
    assert scaling.prompt_of_rows(ids, prompts[:3] + [[0, 0]] + prompts[3:]) == [
        *range(3),
        *range(4, 17),
    ]


def test_a_prefix_is_the_first_rows_with_linked_states_and_its_own_vocabulary(run_dir, tmp_path):
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    from speculators_peagle_plugin.data import open_training_data

    full = run_dir / "data"
    out = scaling.prefix_data(full, 5, tmp_path / "p5", 40)
    prefix, whole = open_training_data(out), open_training_data(full)
    assert prefix.num_samples == 5 and prefix.lengths == whole.lengths[:5]
    links = sorted((out / "hidden_states").iterdir())
    assert [p.name for p in links] == sorted(f"hs_{i}.safetensors" for i in range(5))
    for link in links:
        assert link.is_symlink()
        assert link.resolve() == (full / "hidden_states" / link.name).resolve()
    for i in range(5):
        mine, theirs = prefix.dataset[i], whole.dataset[i]
        assert mine.keys() == theirs.keys()
        assert all(torch.equal(mine[k], theirs[k]) for k in mine)
    # the vocabulary of these 5 rows alone, as generate-data and train count and build it
    freq = Counter()
    for row in rows_of(full).select(range(5)):
        freq.update(t for t, m in zip(row["input_ids"], row["loss_mask"], strict=True) if m)
    assert torch.load(out / "token_freq.pt") == dict(freq)
    assert freq != Counter(torch.load(full / "token_freq.pt"))
    d2t, t2d = build_vocab_mappings_from_distribution(dict(freq), 40, 96)
    got = prefix.vocab_mapping(40)
    assert torch.equal(got[0], d2t) and torch.equal(got[1], t2d)
    marker = (out / "prefix.json").stat().st_mtime_ns
    scaling.prefix_data(full, 5, out, 40)  # kept, not rebuilt
    assert (out / "prefix.json").stat().st_mtime_ns == marker


def test_one_run_keeps_exactly_the_requested_steps_on_one_schedule(run_dir, tmp_path):
    """A real tiny training run with the plan's flags: checkpoints at 4 and 12 only, the
    learning rate decayed to 0 at 12 (one schedule), tokens and seconds from its log."""
    from helpers.training import run_cli

    yaml_path = scaling.train_yaml(run_dir.parent / "tiny.yaml", tmp_path / "t.yaml", True)
    assert "early_stop_patience" not in yaml.safe_load(yaml_path.read_text())
    data = scaling.prefix_data(run_dir / "data", 16, tmp_path / "p16", 40)
    per_epoch = scaling.steps_per_epoch(data, 96)
    assert per_epoch < 12  # the run crosses an epoch
    plan = scaling.checkpoint_plan([4, 12], per_epoch)

    def runner(args):
        code, output = run_cli(args)
        assert code == 0, output

    target = scaling.run_inputs(run_dir)["target"]
    args = ["--config", str(yaml_path), "--verifier-name-or-path", target,
            "--data-path", str(data), "--seed", "1"]
    save = scaling.train_cell(tmp_path / "cell", plan, args, [4, 12], runner)
    assert sorted(p.name for p in save.glob("checkpoint-*")) == ["checkpoint-12", "checkpoint-4"]
    records = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 13)) and records[-1]["lr"] == 0.0
    got = scaling.trained_until(save, 4)
    assert got["tokens_trained"] == sum(r["tokens"] for r in records[:4]) and got["train_s"] > 0


class FakeCli:
    """Stands in for ``speculators-peagle train`` and ``eval``: records each command and
    writes what it would (checkpoints by training/loop.py's rule, a metrics log, record.json
    with the settings the flags ask for)."""

    def __init__(self):
        self.commands = []

    @staticmethod
    def _opt(args, flag, all_=False):
        values = [args[i + 1] for i, a in enumerate(args) if a == flag]
        return values if all_ else values[-1]

    def __call__(self, args):
        self.commands.append(args)
        if args[0] == "train":
            self._train(args)
        elif args[0] == "eval":
            self._eval(args)

    def _train(self, args):
        save = Path(self._opt(args, "--save-path"))
        per_epoch = scaling.steps_per_epoch(Path(self._opt(args, "--data-path")), 96)
        plan = {"epochs": int(self._opt(args, "--epochs")), "steps_per_epoch": per_epoch,
                "max_steps": int(self._opt(args, "--max-steps")),
                "checkpoint_freq": float(self._opt(args, "--checkpoint-freq")),
                "keep_checkpoints": int(self._opt(args, "--keep-checkpoints"))}
        total, kept = checkpoints_of_loop(plan)
        for step in kept:
            ckpt = save / f"checkpoint-{step}"
            ckpt.mkdir(parents=True)
            for name in ("config.json", "model.safetensors", "training_state.pt"):
                (ckpt / name).write_text(f"{save} {step} {name}")
        (save / "metrics.jsonl").write_text("".join(
            json.dumps({"step": s, "tokens": 90.0, "tokens_per_s": 900.0}) + "\n"
            for s in range(1, total + 1)
        ))

    def _eval(self, args):
        out, draft = Path(self._opt(args, "--out")), Path(self._opt(args, "--draft"))
        from speculators_peagle_plugin.evaluation.report import checkpoint_hash

        step = int(draft.name.split("-")[1])
        layers = int(draft.parents[1].name.split("-l")[1].split("-")[0])
        sets = self._opt(args, "--prompts", all_=True)
        record = {
            "config": {
                "prompt_sets": sets, "ks": [int(self._opt(args, "-k"))],
                "concurrency": [int(self._opt(args, "--concurrency"))],
                "prompts_per_slot": int(self._opt(args, "--prompts-per-slot")),
                "max_new_tokens": int(self._opt(args, "--max-new-tokens")),
                "baseline": "--no-baseline" not in args, "dtype": self._opt(args, "--dtype"),
                "kv_cache_gb": int(self._opt(args, "--kv-cache-gb")),
                "enforce_eager": "--enforce-eager" in args,
            },
            "drafts": [{"path": str(draft.resolve()), "sha256": checkpoint_hash(draft)}],
            "runs": [{"prompt_set": s, "draft": str(draft.resolve()), "k": 4, "concurrency": 16,
                      "acceptance_length": 1 + step / 10 + layers / 100 + i / 1000,
                      "per_position": [0.5, 0.3, 0.2, 0.1]}
                     for i, s in enumerate(sets)],
        }
        out.mkdir(parents=True, exist_ok=True)
        (out / "record.json").write_text(json.dumps(record))


@pytest.fixture
def heldout(monkeypatch):
    calls = []

    def fake(checkpoint, config, data_path):
        calls.append((Path(checkpoint).name, config.draft.num_layers, config.seed, str(data_path)))
        return {"acceptance_length": 1.5, "accuracy_per_depth": [0.5, 0.2, 0.1], "loss": 2.0,
                "supervised": [1, 1, 1]}

    monkeypatch.setattr("speculators_peagle_plugin.training.heldout.heldout_metrics", fake)
    return calls


def grid_args(run_dir, out, *extra):
    return scaling.parse_args([
        "--run-dir", str(run_dir), "--prompts", "5,16", "--steps", "2,4", "--num-layers", "1,2",
        "--seeds", "0", "--config", str(run_dir.parent / "tiny.yaml"), "--out", str(out),
        "--report", str(out.parent / "report"), *extra,
    ])


def test_finished_cells_and_points_are_not_redone(run_dir, tmp_path, heldout, capsys):
    out = tmp_path / "scaling"
    cli = FakeCli()
    record = scaling.run_grid(grid_args(run_dir, out), cli)
    kinds = [c[0] for c in cli.commands]
    assert kinds == ["train", "eval", "eval"] * 4  # 2 prefixes x 2 depths, 2 steps each
    train = cli.commands[0]
    assert FakeCli._opt(train, "--max-steps") == "4" and FakeCli._opt(train, "--num-layers") == "1"
    assert "--validation-data-path" not in train and "--enforce-eager" not in cli.commands[1]
    assert len(record["points"]) == 8 and len(heldout) == 8
    report = tmp_path / "report"
    assert json.loads((report / "scaling.json").read_text())["points"] == record["points"]
    assert (report / "scaling.png").read_bytes()[:4] == b"\x89PNG"
    for cell in out.glob("cells/*/train"):  # the checkpoints between requested steps deleted
        assert sorted(p.name for p in cell.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    point = json.loads((out / "cells/p5-l2-s0/step-4/point.json").read_text())
    assert point["rows"] == 5 and point["tokens_trained"] == 360 and point["train_s"] == 0.4
    assert point["served"]["mt_bench"]["acceptance_length"] == pytest.approx(1 + 0.4 + 0.02 + 0.001)

    cli.commands.clear()
    scaling.run_grid(grid_args(run_dir, out), cli)
    assert cli.commands == [] and len(heldout) == 8  # everything finished: nothing runs
    (out / "cells/p16-l1-s0/step-2/point.json").unlink()
    scaling.run_grid(grid_args(run_dir, out), cli)
    assert cli.commands == [] and len(heldout) == 9  # its eval record is kept: scored only
    (out / "cells/p16-l1-s0/step-2/point.json").unlink()
    (out / "cells/p16-l1-s0/step-2/eval/record.json").unlink()
    scaling.run_grid(grid_args(run_dir, out), cli)
    assert [c[0] for c in cli.commands] == ["eval"] and len(heldout) == 10

    # three seeds at one point: the record holds the grid's points and the new ones
    cli.commands.clear()
    args = grid_args(run_dir, out)
    args.prompts, args.num_layers, args.seeds = [16], [1], [0, 1, 2]
    record = scaling.run_grid(args, cli)
    assert [c[0] for c in cli.commands] == ["train", "eval", "eval"] * 2
    assert len(record["points"]) == 12
    text = capsys.readouterr().out
    assert "| 16 × 1 | 1.210 ± 0.000 (3) | 1.410 ± 0.000 (3) |" in text
    with pytest.raises(SystemExit, match="was trained with other settings"):
        scaling.run_grid(grid_args(run_dir, out, "--steps", "1,4"), cli)
    # another seed on another schedule would be averaged with these: refused before any work
    with pytest.raises(SystemExit, match=r"p5-l1-s0 was trained for 4 steps .* --steps is 6:"):
        scaling.run_grid(grid_args(run_dir, out, "--steps", "2,6", "--seeds", "7"),
                         lambda a: pytest.fail(f"ran {a}"))


def test_record_plot_and_tables_from_points(tmp_path):
    def point(prompts, layers, seed, step, served):
        return {"prompts": prompts, "layers": layers, "seed": seed, "step": step,
                "served": {"humaneval[120:164]": {"acceptance_length": served},
                           "mt_bench": {"acceptance_length": served - 0.2}},
                "heldout": {"acceptance_length": served + 0.1}}

    points = [point(220, 1, 42, s, 1.5 + s / 1000) for s in (500, 1000)]
    points += [point(4430, 2, seed, 1000, 2.0 + seed / 100) for seed in (0, 1, 2)]
    summary = scaling.summarise(points)
    got = summary[(4430, 2, 1000)]["served mt_bench"]
    assert got["mean"] == pytest.approx(1.81) and got["std"] == pytest.approx(0.01)
    assert got["n"] == 3 and summary[(220, 1, 500)]["served mt_bench"]["std"] == 0.0
    text = scaling.tables(summary)
    names = [line for line in text.splitlines() if line.startswith("**")]
    figures = ("served humaneval[120:164]", "served mt_bench", "held-out estimate")
    assert names == [f"**{n}** (acceptance length, K=4)" for n in figures]
    assert "| prompts × layers | 500 | 1000 |" in text
    assert "| 220 × 1 | 1.800 | 2.300 |" in text  # mt_bench: served - 0.2
    assert "| 4430 × 2 | - | 2.010 ± 0.010 (3) |" in text
    path = scaling.plot(summary, tmp_path / "scaling.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_one_sentence_refusals(run_dir, tmp_path):
    def refused(args):
        with pytest.raises(SystemExit) as err:
            scaling.run_grid(scaling.parse_args(args), lambda a: pytest.fail(f"ran {a}"))
        return str(err.value)

    empty = tmp_path / "empty"
    empty.mkdir()
    assert refused(["--run-dir", str(empty)]) == (
        f"{empty} holds no finished target / prompts / data / validation data stage in "
        "stages.json; run `speculators-peagle demo --recipe "
        "configs/recipes/long_smollm2.yaml` first (or pass --run-dir)."
    )
    prompts, tiny = (run_dir / "train_prompts.jsonl").resolve(), run_dir.parent / "tiny.yaml"
    assert refused(["--run-dir", str(run_dir), "--prompts", "5,17", "--config", str(tiny)]) == (
        f"--prompts 17 is more than the 16 prompts of {prompts}."
    )
    missing = tmp_path / "no.yaml"
    assert refused(["--run-dir", str(run_dir), "--config", str(missing)]) == (
        f"--config {missing} is not a file; give the training YAML."
    )
    for bad in ("0,500", "500,x", ""):
        with pytest.raises(SystemExit) as err:
            scaling.parse_args(["--steps", bad])
        assert str(err.value) == f"--steps must be comma-separated positive integers, got {bad!r}."
    with pytest.raises(SystemExit, match="--seeds must be comma-separated integers >= 0"):
        scaling.parse_args(["--seeds", "-1"])


def test_more_data_continues_the_run_as_one_larger_generation_would(run_dir, tmp_path, heldout):
    """The run's first 10 prompts and rows as a run, the other 6 as a --more-data output:
    a 16-prompt cell reads the same rows, states and vocabulary as the whole data."""
    from datasets import load_from_disk

    full, lines = run_dir / "data", (run_dir / "train_prompts.jsonl").read_text().splitlines(True)
    short = tmp_path / "short"
    short.mkdir()
    shutil.copy(run_dir.parent / "tiny.yaml", tmp_path / "tiny.yaml")
    (short / "train_prompts.jsonl").write_text("".join(lines[:10]))
    scaling.prefix_data(full, 10, short / "data", 40)
    (short / "validation-data").symlink_to(full)
    stages = json.loads((run_dir / "stages.json").read_text())
    stages["data"]["inputs"]["prompts"] = hashlib.sha256(
        (short / "train_prompts.jsonl").read_bytes()).hexdigest()
    (short / "stages.json").write_text(json.dumps(stages))
    more = tmp_path / "more"
    load_from_disk(str(full)).select(range(10, 16)).save_to_disk(str(more))
    (more / "hidden_states").mkdir()
    for j in range(6):
        (more / f"hidden_states/hs_{j}.safetensors").symlink_to(
            full / f"hidden_states/hs_{10 + j}.safetensors")
    (more / "prompts.jsonl").write_text("".join(lines[10:]))
    settings = json.loads((full / "generation_settings.json").read_text())
    (more / "generation_settings.json").write_text(
        json.dumps({**settings, "prompts": str(more / "prompts.jsonl")}))

    out = tmp_path / "scaling"
    args = grid_args(short, out, "--more-data", str(more))
    args.prompts, args.num_layers, args.steps = [16], [1], [2]
    record = scaling.run_grid(args, FakeCli())
    assert record["run"]["more_data"] == [
        {"data": str(more), "prompts": str(more / "prompts.jsonl")}]
    cell = out / "data/prompts-16"
    assert rows_of(cell).to_dict() == rows_of(full).to_dict()
    for i in range(16):
        name = f"hidden_states/hs_{i}.safetensors"
        assert (cell / name).resolve() == (full / name).resolve()
    assert torch.load(cell / "token_freq.pt") == torch.load(full / "token_freq.pt")
    assert json.loads((out / "cells/p16-l1-s0/plan.json").read_text())["rows"] == 16

    def refused(*extra):
        with pytest.raises(SystemExit) as err:
            scaling.run_grid(grid_args(short, out, *extra), lambda a: pytest.fail(f"ran {a}"))
        return str(err.value)

    (more / "prompts.jsonl").write_text("".join(lines[8:]))  # two of the run's prompts again
    assert refused("--more-data", str(more)) == (
        f"--more-data {more}: 2 of its prompts are already the run's training or validation "
        "prompts; give it only new prompts.")
    (more / "generation_settings.json").write_text(
        json.dumps({**settings, "prompts": str(more / "prompts.jsonl"), "temperature": 0.5}))
    assert refused("--more-data", str(more)) == (
        f"--more-data {more} was made with temperature 0.5, the run's data with "
        f"{settings['temperature']!r}; generate it with the run's settings.")
    assert refused("--more-data", str(tmp_path)) == (
        f"--more-data {tmp_path} holds no generation_settings.json; give a generate-data "
        "output directory.")
