"""A draft's model card: written from config.json, checked against it, refreshed by eval.

A card is shared, so no absolute path of this machine may appear in it
(:func:`assert_portable`); eval merges its figures into the card's entries, and a smaller
eval never displaces a larger one of the same prompt set and settings.
"""

import json
import re
import shlex
from pathlib import Path

import pytest
from tiny_vllm import tiny_vllm_draft

from speculators_peagle_plugin.evaluation.card import update_model_cards
from speculators_peagle_plugin.evaluation.eval_config import EvalConfig
from speculators_peagle_plugin.model.model_card import (
    CARD_FILE,
    card_facts,
    read_card,
    write_eval_section,
    write_model_card,
)
from speculators_peagle_plugin.serving.check import check_checkpoint
from speculators_peagle_plugin.serving.export import export_checkpoint

SETTINGS = {  # a generate-data generation_settings.json, as much of it as the card reads
    "prompts": "runs/x/train_prompts.jsonl", "num_samples": 5, "temperature": 0.7,
    "max_new_tokens": 200, "backend": "vllm", "dtype": "bfloat16",
    "contamination": {"held_out": ["humaneval[120:164]", "mt_bench (every turn)"], "dropped": 3},
}
RECIPE = {"num_layers": 1, "num_depths": 4, "lr": 0.001, "total_seq_len": 512}
TRAINING = {"steps": 1234, "samples": 1100, "data": SETTINGS, "recipe": RECIPE}


@pytest.fixture
def draft(target, tmp_path):
    path = tmp_path / "draft"
    tiny_vllm_draft(target, 3, seed=0).save_pretrained(path)
    return path


def front_and_config(path):
    return read_card(path)[0], json.loads((path / "config.json").read_text())


# A "/"-rooted path: not inside a URL ("https://"), an id ("owner/name"), a fraction ("0.5 / 0.2").
ABSOLUTE = re.compile(r"(?<![\w/:.\]])/[\w.-]+/")


def assert_portable(card: Path, *paths) -> str:
    """The card's text, checked to name no absolute path (of ``paths`` or any other)."""
    text = card.read_text()
    for path in (*paths, Path.cwd()):
        assert str(path) not in text, path
    assert not ABSOLUTE.findall(text), ABSOLUTE.findall(text)
    return text


def serve_spec(text):
    serve = re.search(r"^vllm serve .*$", text, re.M).group(0)
    args = shlex.split(serve)
    return args[2], json.loads(args[args.index("--speculative-config") + 1])


def test_the_card_states_the_checkpoint_and_how_it_was_made(draft, target, tmp_path):
    training = {**TRAINING, "data_path": str(tmp_path / "data")}
    write_model_card(draft, training)
    front, config = front_and_config(draft)
    assert "base_model" not in front  # the target is a local directory that names no id
    assert front["peagle"] == card_facts(config) and front["peagle"]["speculative_tokens"] == 3
    text = assert_portable(draft / CARD_FILE, target, tmp_path)
    served, spec = serve_spec(text)
    assert served == "TARGET"
    assert f"`TARGET` is the target it drafts for, `{Path(target).name}`" in text
    assert spec == {"method": "eagle3", "model": "draft", "parallel_drafting": True,
                    "num_speculative_tokens": 3}
    facts = ("1100 samples", "runs/x/train_prompts.jsonl", "5 per prompt", "temperature 0.7",
             "3 prompts dropped", "num_depths=4", "lr=0.001", "1234 optimizer steps")
    for fact in facts:
        assert fact in text, fact
    assert "Not evaluated yet" in text
    assert check_checkpoint(draft, target) == []


def test_base_model_is_a_model_id_given_or_named_by_the_targets_config(draft, target, tmp_path):
    named = tmp_path / "cache" / "smol"  # a local target whose config names its hub id
    named.mkdir(parents=True)
    (named / "config.json").write_text(json.dumps({"_name_or_path": "HuggingFaceTB/Smol"}))
    config = json.loads((draft / "config.json").read_text())
    config["speculators_config"]["verifier"]["name_or_path"] = str(named)
    (draft / "config.json").write_text(json.dumps(config))
    write_model_card(draft, TRAINING)
    assert read_card(draft)[0]["base_model"] == "HuggingFaceTB/Smol"
    text = assert_portable(draft / CARD_FILE, named)
    assert serve_spec(text)[0] == "HuggingFaceTB/Smol"
    write_model_card(draft, base_model="org/given")  # given wins, and later rewrites keep it
    write_model_card(draft, location=tmp_path / "elsewhere")
    assert read_card(draft)[0]["base_model"] == "org/given"
    assert serve_spec(assert_portable(draft / CARD_FILE))[1]["model"] == "elsewhere"
    with pytest.raises(ValueError, match="--base-model must be a hub model id"):
        EvalConfig(target=target, base_model=str(named))


def test_a_card_that_contradicts_config_json_is_found_and_exported_away(draft, target, tmp_path):
    write_model_card(draft, TRAINING)
    card = draft / CARD_FILE
    card.write_text(card.read_text().replace("speculative_tokens: 3", "speculative_tokens: 5"))
    found = check_checkpoint(draft, target)
    assert [(f.code, f.severity) for f in found] == [("model-card", "warning")]
    assert "speculative_tokens: 5" in found[0].message and "3" in found[0].message
    fixed, remaining = export_checkpoint(draft, tmp_path / "out", target)
    assert remaining == []
    front, config = front_and_config(tmp_path / "out")
    assert front["peagle"]["speculative_tokens"] == 3
    text = assert_portable(tmp_path / "out" / CARD_FILE, tmp_path)
    assert serve_spec(text)[1]["model"] == "out"
    assert "1234 optimizer steps" in text  # kept


def test_export_gives_the_copys_card_the_base_model_it_is_given(draft, target, tmp_path):
    from click.testing import CliRunner

    from speculators_peagle_plugin.cli import main

    write_model_card(draft, TRAINING)
    out = tmp_path / "out"
    done = CliRunner().invoke(main, ["export", str(draft), str(out), "--target", target,
                                     "--base-model", "org/target"])
    assert done.exit_code == 0, done.output
    assert read_card(out)[0]["base_model"] == "org/target"
    assert serve_spec(assert_portable(out / CARD_FILE, tmp_path))[0] == "org/target"
    assert "base_model" not in read_card(draft)[0]  # the source is left as it was
    refused = CliRunner().invoke(main, ["export", str(draft), str(tmp_path / "out2"),
                                        "--target", target, "--base-model", str(target)])
    assert refused.exit_code == 1 and not (tmp_path / "out2").exists()
    assert "Error: --base-model must be a hub model id" in refused.output


def test_someone_elses_readme_is_left_alone(draft, target):
    card = draft / CARD_FILE
    card.write_text("# my notes\n")
    assert read_card(draft) is None
    assert check_checkpoint(draft, target) == []
    assert write_eval_section(draft, "table", []) is False
    update_model_cards(fake_record(draft, 44), lambda line: None)
    assert card.read_text() == "# my notes\n"


def fake_record(draft, prompts, *, prompt_set="humaneval[120:164]", max_new_tokens=128,
                accept=1.734, base_model=None, ks=(2,)):
    """An eval record of ``draft`` at ``ks`` and another draft at K=2 on ``prompts`` prompts."""
    def run(path, k, accept):
        return {"prompt_set": prompt_set, "draft": path, "label": "trained" if k else
                "no draft", "k": k, "concurrency": 1, "acceptance_length": accept,
                "per_position": [0.5, 0.2] if k else None, "counters": {"num_drafts": 9} if k
                else None, "tokens_per_s": 30.0 if k else 20.0, "tpot_s": None,
                "speedup": 1.5 if k else None, "outputs": ["x"] * prompts}

    other = str(draft.parent / "other")
    return {
        "provenance": {
            "created_utc": f"2026-11-27T03:00:{prompts % 60:02d}+00:00",
            "argv": [str(Path.cwd() / ".venv/bin/speculators-peagle"), "eval", "--draft",
                     str(draft), f"--target={draft.parent / 'target'}", "--max-new-tokens",
                     str(max_new_tokens)],
            "versions": {"vllm": "0.32.0", "torch": None},
            "hardware": {"cpu": "Some CPU", "gpu": None},
        },
        "config": {"dtype": "float32", "max_new_tokens": max_new_tokens, "ignore_eos": False,
                   "enforce_eager": False, "backend": "vllm", "base_model": base_model,
                   "target": str(draft.parent / "target")},
        "drafts": [{"path": str(draft)}, {"path": other}],
        "runs": [run(None, None, None), *(run(str(draft), k, accept) for k in ks),
                 run(other, 2, 1.111)],
        "recommendation": [],
    }


def rows(draft):
    """The card's table rows as ``{column: cell}``."""
    section = (draft / CARD_FILE).read_text().split("## Acceptance and speed")[1]
    head, _, *lines = [x for x in section.splitlines() if x.startswith("|")]

    def cells(line):
        return [c.strip() for c in line.strip("|").split("|")]

    return [dict(zip(cells(head), cells(x), strict=True)) for x in lines]


def test_eval_writes_its_table_into_the_card_and_train_keeps_it(draft, target):
    write_model_card(draft, TRAINING)
    said = []
    update_model_cards(fake_record(draft, 44), said.append)
    text = assert_portable(draft / CARD_FILE, target)
    assert "1.734" in text and "1.111" not in text  # this draft's rows, not the other's
    assert "Not evaluated yet" not in text
    assert "Some CPU; vllm 0.32.0: `speculators-peagle eval --draft draft --target=target" in text
    ((row),) = rows(draft)
    assert row["n prompts"] == "44" and row["accept len"] == "1.734" and row["k"] == "2"
    assert row["tok/s"] == "30.0" and row["no-draft tok/s"] == "20.0" and row["speedup"] == "1.50x"
    assert said == [f"model card: {draft / CARD_FILE} (acceptance and speed)"]
    before = read_card(draft)[0]["peagle_eval"]
    write_model_card(draft)  # a rewrite (export) keeps the entries, the table and the recipe
    front, body = read_card(draft)
    assert front["peagle_eval"] == before and "1.734" in body and "1234 optimizer steps" in body
    assert front["peagle"]["speculative_tokens"] == 3


def test_a_smoke_eval_after_the_full_one_leaves_the_full_table(draft, target):
    write_model_card(draft, TRAINING)
    update_model_cards(fake_record(draft, 345, accept=1.739, ks=(2, 4)), print)
    # the smoke check: 2 prompts, 8 tokens; then 2 prompts at the full one's settings
    update_model_cards(fake_record(draft, 2, prompt_set="humaneval[:2]", max_new_tokens=8,
                                   accept=2.667), print)
    update_model_cards(fake_record(draft, 2, accept=2.5), print)
    found = {(r["prompts"], r["max_new_tokens"], r["k"]): r for r in rows(draft)}
    assert set(found) == {("humaneval[120:164]", "128", "2"), ("humaneval[120:164]", "128", "4"),
                          ("humaneval[:2]", "8", "2")}
    assert found["humaneval[120:164]", "128", "2"]["accept len"] == "1.739"
    assert found["humaneval[120:164]", "128", "2"]["n prompts"] == "345"
    assert found["humaneval[:2]", "8", "2"]["n prompts"] == "2"
    entries = read_card(draft)[0]["peagle_eval"]  # machine-readable, for the next merge
    assert [(e["prompts"], e["settings"]["k"], e["prompt_count"]) for e in entries] == [
        ("humaneval[120:164]", 2, 345), ("humaneval[120:164]", 4, 345), ("humaneval[:2]", 2, 2)]
    assert "&id" not in (draft / CARD_FILE).read_text()  # plain entries, no YAML aliases
    update_model_cards(fake_record(draft, 345, accept=1.8, base_model="org/target"), print)
    found = {(r["prompts"], r["max_new_tokens"], r["k"]): r for r in rows(draft)}
    assert found["humaneval[120:164]", "128", "2"]["accept len"] == "1.800"  # as large: newer
    assert found["humaneval[120:164]", "128", "4"]["accept len"] == "1.739"  # not measured
    assert read_card(draft)[0]["base_model"] == "org/target"
    assert_portable(draft / CARD_FILE, target)
