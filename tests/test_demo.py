"""The demo's resumable stage pipeline (demo/pipeline.py and the stages, artifacts and
summary it runs).

The pipeline's stage logic runs with the ``speculators-peagle`` commands replaced by fakes
that write what each command writes, and the SmolLM2 target replaced by a stand-in
(its own tests are in test_smollm2.py).
"""

import json
import os
from pathlib import Path

import pytest
from yaml import safe_dump

from speculators_peagle_plugin.demo import pipeline as demo
from speculators_peagle_plugin.model.model_card import CARD_FILE, read_card, write_model_card

# ----------------------------------------------------------------- pipeline.py stages


def test_training_prompts_are_the_demos_and_held_out_sets_are_disjoint(tmp_path):
    from speculators_peagle_plugin.data.prompts import load_prompt_set, load_prompts

    config = demo.DemoConfig(run_dir=str(tmp_path))
    path = tmp_path / "p.jsonl"
    assert demo.write_prompts(config.train_prompts, config.sweep.prompt_sets, path) == 220
    rows = load_prompts(path)  # what generate-data reads
    assert rows[0] == load_prompt_set("humaneval[0:1]").conversations[0]
    assert rows[120] == load_prompt_set("chat[0:1]").conversations[0]
    assert len(load_prompt_set("humaneval[120:164]")) == 44
    with pytest.raises(ValueError, match=r"eval set 'humaneval\[100:130\]'.*held out"):
        demo.write_prompts(config.train_prompts, ("humaneval[100:130]",), path)


def test_link_draft_keeps_only_the_servable_files(tmp_path):
    ckpt = tmp_path / "checkpoint-7"
    ckpt.mkdir()
    for name in ("config.json", "model.safetensors", "training_state.pt"):
        (ckpt / name).write_bytes(os.urandom(16))
    demo.link_draft(ckpt, tmp_path / "draft")
    demo.link_draft(ckpt, tmp_path / "draft")  # replacing it is fine
    assert sorted(p.name for p in (tmp_path / "draft").iterdir()) == [
        "config.json", "model.safetensors",
    ]
    assert (tmp_path / "draft" / "model.safetensors").read_bytes() == (
        ckpt / "model.safetensors"
    ).read_bytes()
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())


def test_the_linked_draft_keeps_its_model_card_naming_itself(tmp_path):
    ckpt = tmp_path / "checkpoint-7"
    ckpt.mkdir()
    config = {"speculators_config": {"verifier": {"name_or_path": "/t"},
                                     "proposal_methods": [{"speculative_tokens": 4}]}}
    (ckpt / "config.json").write_text(json.dumps(config))
    write_model_card(ckpt, {"steps": 7})
    demo.link_draft(ckpt, tmp_path / "draft")
    front, body = read_card(tmp_path / "draft")
    assert front["peagle"]["speculative_tokens"] == 4 and "7 optimizer steps" in body
    assert '"model": "draft"' in body and str(tmp_path) not in body  # no local path
    assert '"model": "checkpoint-7"' in (ckpt / CARD_FILE).read_text()  # not rewritten


def test_a_failing_command_names_its_stage(monkeypatch):
    shown = []

    class Done:
        returncode = 3

    monkeypatch.setattr(demo.subprocess, "run", lambda args, env: Done())
    with pytest.raises(demo.DemoError, match=r"stage 'train' failed \(exit code 3"):
        demo._command(["train", "--config", "c y.yaml"], shown.append, "train")
    assert shown == ["$ speculators-peagle train --config 'c y.yaml'"]


class FakeCli:
    """Stands in for ``speculators-peagle``: records each command, writes its outputs."""

    def __init__(self, acceptance=2.3):
        self.commands = []
        self.acceptance = acceptance
        self.fail_on = None

    @staticmethod
    def _opt(args, flag, all_=False):
        values = [args[i + 1] for i, a in enumerate(args) if a == flag]
        return values if all_ else values[-1]

    def __call__(self, args, echo, stage):
        if args[0] == self.fail_on:
            raise demo.DemoError(f"stage '{stage}' failed")
        self.commands.append(args)
        if args[0] == "generate-data":
            out = Path(self._opt(args, "--output"))
            out.mkdir(parents=True)
            (out / "state.json").write_text("{}")
        elif args[0] == "train":
            ckpt = Path(self._opt(args, "--save-path")) / "checkpoint-5"
            ckpt.mkdir(parents=True)
            for name in ("config.json", "model.safetensors", "training_state.pt"):
                (ckpt / name).write_text(name)
            if "--validation-data-path" in args:  # the best checkpoint, as train keeps it
                best = ckpt.with_name("best")
                best.mkdir()
                for name in ("config.json", "model.safetensors"):
                    (best / name).write_text(f"best {name}")
        elif args[0] == "eval":
            out = Path(self._opt(args, "--out"))
            out.mkdir(parents=True)
            runs = []
            for spec in self._opt(args, "--prompts", all_=True):
                for c in map(int, self._opt(args, "--concurrency").split(",")):
                    runs.append(self._run(spec, "no draft", 0, c, None))
                    for k in map(int, self._opt(args, "-k").split(",")):
                        runs.append(self._run(spec, "trained-draft", k, c, self.acceptance))
            recommendation = [
                {
                    "draft": "d",
                    "label": "trained-draft",
                    "concurrency": 1,
                    "k": 2,
                    "speedup": 1.4,
                    "speculative_config": {"method": "eagle3"},
                }
            ]
            (out / "record.json").write_text(
                json.dumps({"runs": runs, "recommendation": recommendation})
            )
            (out / "acceptance.png").write_bytes(b"png")

    @staticmethod
    def _run(spec, label, k, c, acceptance):
        per_pos = None if acceptance is None else [acceptance - 1] + [0] * (k - 1)
        return {
            "prompt_set": spec, "label": label, "k": k, "concurrency": c,
            "acceptance_length": acceptance, "per_position": per_pos,
            "counters": {"num_drafts": 10} if k else None, "tokens_per_s": 50.0, "speedup": None,
        }


@pytest.fixture
def fake_pipeline(monkeypatch, tmp_path):
    """The demo with fake commands, a fake target and a fake untrained-draft builder."""
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 49152}))
    (target / "model.safetensors").write_text("w")
    monkeypatch.setattr(demo, "materialise_smollm2", lambda: target)
    built = []

    def untrained(train_config, output):
        built.append(train_config)
        output.mkdir()
        (output / "config.json").write_text("{}")
        (output / "model.safetensors").write_text("w")

    monkeypatch.setattr(demo, "save_untrained_draft", untrained)
    cli = FakeCli()
    monkeypatch.setattr(demo, "_command", cli)
    yaml = tmp_path / "demo.yaml"
    yaml.write_text(Path(demo.DemoConfig.train_config).read_text())
    return cli, built, yaml, target


def test_pipeline_runs_every_stage_once_in_order(fake_pipeline, tmp_path):
    cli, built, yaml, target = fake_pipeline
    run_dir = tmp_path / "run"
    config = demo.quick_config(run_dir=str(run_dir), train_config=str(yaml))
    lines = []
    summary = demo.run_demo(config, echo=lines.append)
    assert [c[0] for c in cli.commands] == ["generate-data", "train", "check", "eval"]
    gen, train, check, evaluate = cli.commands
    assert FakeCli._opt(gen, "--target") == str(target)
    assert FakeCli._opt(gen, "--max-new-tokens") == str(config.replies.max_new_tokens)
    assert FakeCli._opt(train, "--config") == str(yaml)
    assert FakeCli._opt(train, "--max-steps") == "2"
    assert FakeCli._opt(train, "--data-path") == FakeCli._opt(gen, "--output")
    assert check[1] == str(run_dir / "trained-draft") and FakeCli._opt(check, "-k") == "4"
    assert FakeCli._opt(evaluate, "--draft", all_=True) == [str(run_dir / "trained-draft")]
    assert FakeCli._opt(evaluate, "--prompts", all_=True) == list(config.sweep.prompt_sets)
    assert FakeCli._opt(evaluate, "-k") == "2" and FakeCli._opt(evaluate, "--concurrency") == "1,2"
    assert FakeCli._opt(evaluate, "--prompts-per-slot") == "1"
    assert "--enforce-eager" in evaluate  # the quick demo's engines skip compiling
    assert FakeCli._opt(evaluate, "--base-model") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert FakeCli._opt(gen, "--draft-vocab-size") == FakeCli._opt(train, "--draft-vocab-size")
    assert FakeCli._opt(gen, "--draft-vocab-size") == "8192"  # the training YAML's
    # The untrained draft is built from the very config the train command used.
    assert built[0].data.data_path == FakeCli._opt(train, "--data-path")
    assert built[0].peagle.cod.num_depths == 4 and built[0].trainer.schedule.max_steps == 2
    assert (run_dir / "trained-draft" / "model.safetensors").read_text() == "model.safetensors"
    assert not (run_dir / "trained-draft" / "training_state.pt").exists()
    assert summary["acceptance"]["humaneval[120:122]"]["K=2"]["acceptance_length"] == 2.3
    assert summary["acceptance"]["humaneval[120:122]"]["K=2"]["concurrency"] == 2
    assert json.loads((run_dir / demo.SUMMARY_FILE).read_text())["record"].endswith("record.json")
    assert any(line.startswith("run directory: ") for line in lines)
    # A rerun skips every stage.
    lines.clear()
    demo.run_demo(config, echo=lines.append)
    assert len(cli.commands) == 4 and len(built) == 1
    assert sum("skipped" in line for line in lines) == 7


@pytest.mark.parametrize("native", [True, False])
def test_bfloat16_is_used_only_where_the_cpu_has_it_natively(
    fake_pipeline, tmp_path, monkeypatch, native
):
    cli, _, yaml, _ = fake_pipeline
    assert "autocast: bfloat16" in yaml.read_text()
    monkeypatch.setattr(demo, "cpu_has_bfloat16", lambda: native)
    config = demo.quick_config(run_dir=str(tmp_path / "run"), train_config=str(yaml))
    demo.run_demo(config, echo=lambda line: None)
    gen, train, _, evaluate = cli.commands
    assert ("--autocast" in train) is not native
    if not native:
        assert FakeCli._opt(train, "--autocast") == "none"
    # The target writes the data in the dtype it is then served in.
    dtype = "bfloat16" if native else "float32"
    assert FakeCli._opt(gen, "--dtype") == FakeCli._opt(evaluate, "--dtype") == dtype


def test_the_demo_measures_speed_on_compiled_engines(fake_pipeline, tmp_path):
    """The full demo's eval runs engines as `vllm serve` does, a setting of its eval stage."""
    cli, _, yaml, _ = fake_pipeline
    assert demo.DemoConfig().sweep.enforce_eager is False
    config = demo.quick_config(run_dir=str(tmp_path / "run"), train_config=str(yaml),
                               eval_enforce_eager=False)
    demo.run_demo(config, echo=lambda line: None)
    assert [c[0] for c in cli.commands] == ["generate-data", "train", "check", "eval"]
    assert "--enforce-eager" not in cli.commands[-1]
    eager = demo.quick_config(run_dir=str(tmp_path / "run"), train_config=str(yaml))
    with pytest.raises(ValueError, match=r"'eval' stage made with other settings"):
        demo.run_demo(eager, echo=lambda line: None)


@pytest.mark.parametrize(("ks", "concurrency", "given", "at_max"), [
    ((2, 4), (1, 16), None, (4,)), ((2,), (1, 2), None, None), ((2, 4), (16,), None, None),
    ((2, 3), (1, 16), None, None), ((2, 4), (1, 16), (2, 4), (2, 4)),
])
def test_at_the_largest_concurrency_the_demo_runs_its_trained_k_alone(
    fake_pipeline, tmp_path, ks, concurrency, given, at_max
):
    cli, _, yaml, _ = fake_pipeline
    config = demo.quick_config(run_dir=str(tmp_path / "run"), train_config=str(yaml), eval_ks=ks,
                               eval_concurrency=concurrency, eval_ks_at_max_concurrency=given)
    assert config.num_speculative_tokens == 4 and config.ks_at_max_concurrency() == at_max
    demo.run_demo(config, echo=lambda line: None)
    argv = cli.commands[-1]
    assert argv[0] == "eval" and ("--ks-at-max-concurrency" in argv) == bool(at_max)
    if at_max:
        assert FakeCli._opt(argv, "--ks-at-max-concurrency") == ",".join(map(str, at_max))


def test_a_target_with_fewer_tokens_than_the_draft_vocabulary_gets_all_of_them(
    fake_pipeline, tmp_path
):
    cli, built, yaml, target = fake_pipeline
    assert "draft_vocab_size: 8192" in yaml.read_text()
    (target / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 272}))
    lines = []
    demo.run_demo(demo.quick_config(run_dir=str(tmp_path / "run"), train_config=str(yaml)),
                  echo=lines.append)
    gen, train, _, _ = cli.commands
    assert FakeCli._opt(gen, "--draft-vocab-size") == FakeCli._opt(train, "--draft-vocab-size")
    assert FakeCli._opt(gen, "--draft-vocab-size") == "272"
    assert built[0].draft.draft_vocab_size == 272  # the untrained draft too
    assert any("272 tokens, the target's whole vocabulary" in line for line in lines)


def test_an_explicit_target_dtype_wins_and_a_new_one_redoes_the_data(fake_pipeline, tmp_path):
    cli, _, yaml, _ = fake_pipeline
    config = demo.quick_config(run_dir=str(tmp_path / "run"), train_config=str(yaml),
                               target_dtype="float32")
    demo.run_demo(config, echo=lambda line: None)
    assert [FakeCli._opt(c, "--dtype") for c in cli.commands if "--dtype" in c] == ["float32"] * 2
    other = demo.quick_config(run_dir=str(tmp_path / "run"), train_config=str(yaml),
                              target_dtype="bfloat16")
    with pytest.raises(ValueError, match=r"'data' stage made with other settings"):
        demo.run_demo(other, echo=lambda line: None)


def test_pipeline_resumes_after_a_failed_stage_and_reports_acceptance_and_speed(
    fake_pipeline, tmp_path
):
    cli, built, yaml, _ = fake_pipeline
    config = demo.DemoConfig(run_dir=str(tmp_path / "run"), train_config=str(yaml))
    cli.fail_on = "eval"
    with pytest.raises(demo.DemoError, match="'eval' failed"):
        demo.run_demo(config, echo=lambda s: None)
    assert [c[0] for c in cli.commands] == ["generate-data", "train", "check"]
    cli.fail_on, cli.acceptance = None, 1.7
    lines = []
    summary = demo.run_demo(config, echo=lines.append)
    assert [c[0] for c in cli.commands] == ["generate-data", "train", "check", "eval"]
    evaluate = cli.commands[-1]
    assert FakeCli._opt(evaluate, "-k") == "2,4"
    assert FakeCli._opt(evaluate, "--concurrency") == "1,16"
    assert "mt_bench[::10]" in FakeCli._opt(evaluate, "--prompts", all_=True)
    assert summary["acceptance"]["humaneval[120:164]"]["K=4"] == {
        "concurrency": 16, "acceptance_length": 1.7,
        "per_position": [pytest.approx(0.7), 0, 0, 0], "per_category": None,
    }
    assert summary["recommendation"][0]["k"] == 2
    assert any("concurrency 1: K=2 (1.40x)" in line for line in lines)
    assert not any("goal" in line or "NOT met" in line for line in lines)
    # The same settings written flat (the golden flat form), with a comment: nothing reruns.
    grouped = yaml.read_text()
    flat = json.loads((Path(__file__).parent / "golden" / "flat_configs.json").read_text())
    yaml.write_text("# the same settings, flat\n" + safe_dump(flat["demo_smollm2.yaml"]))
    demo.run_demo(config, echo=lambda s: None)
    assert [c[0] for c in cli.commands] == ["generate-data", "train", "check", "eval"]
    # Editing the training YAML's settings after training is refused, not silently mixed.
    yaml.write_text(grouped + "seed: 7\n")
    with pytest.raises(ValueError, match=r"'train' stage made with other settings"):
        demo.run_demo(config, echo=lambda s: None)


# ----------------------------------------------------------------- recipes


RECIPE = Path(__file__).parents[1] / "configs" / "recipes" / "long_smollm2.yaml"


def test_the_long_recipe_generates_validation_data_and_serves_the_best_checkpoint(
    fake_pipeline, tmp_path
):
    cli, built, yaml, target = fake_pipeline
    run_dir = tmp_path / "run"
    config = demo.DemoConfig.from_recipe(
        RECIPE, run_dir=str(run_dir), train_prompts=("humaneval[0:3]+chat[0:3]",),
        validation_prompts=("chat[3:5]",), max_prompt_tokens=None,
    )
    demo.run_demo(config, echo=lambda s: None)
    assert [c[0] for c in cli.commands] == [
        "generate-data", "generate-data", "train", "check", "eval"
    ]
    data, validation, train = cli.commands[:3]
    assert FakeCli._opt(data, "--prompts") == str(run_dir / "train_prompts.jsonl")
    assert FakeCli._opt(validation, "--prompts") == str(run_dir / "validation_prompts.jsonl")
    assert FakeCli._opt(data, "--num-samples") == "1"
    assert len((run_dir / "validation_prompts.jsonl").read_text().splitlines()) == 2
    assert FakeCli._opt(train, "--validation-data-path") == FakeCli._opt(validation, "--output")
    assert FakeCli._opt(train, "--config") == str(RECIPE.parent / ".." / "long_smollm2_train.yaml")
    assert FakeCli._opt(train, "--early-stop-patience") == "2"
    served = run_dir / "trained-draft" / "model.safetensors"
    assert served.read_text() == "best model.safetensors"
    assert built[0].data.validation_data_path == FakeCli._opt(validation, "--output")
    assert built[0].trainer.validation.early_stop_patience == 2
    assert FakeCli._opt(cli.commands[-1], "--prompts", all_=True) == [
        "humaneval[120:164]", "mt_bench"
    ]


def test_a_prompt_filter_leaves_out_what_it_rejects(tmp_path):
    path = tmp_path / "p.jsonl"
    count = demo.write_prompts(("chat[0:6]",), (), path,
                               fit=lambda c: c if len(c[-1]["content"]) < 60 else None)
    rows = [json.loads(line)["messages"] for line in path.read_text().splitlines()]
    assert count == len(rows) and all(len(r[-1]["content"]) < 60 for r in rows)
    assert count < 6
