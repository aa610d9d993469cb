"""A draft's model card: written from config.json, checked against it, refreshed by eval."""

import json
import re
import shlex

import pytest
import yaml
from tiny_vllm import tiny_vllm_draft

from speculators_peagle_plugin.evaluation.card import eval_section, update_model_cards
from speculators_peagle_plugin.serving.check import check_checkpoint
from speculators_peagle_plugin.serving.export import export_checkpoint
from speculators_peagle_plugin.serving.model_card import (
    CARD_FILE,
    card_facts,
    read_card,
    write_eval_section,
    write_model_card,
)

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


def test_the_card_states_the_checkpoint_and_how_it_was_made(draft, target):
    write_model_card(draft, TRAINING)
    front, config = front_and_config(draft)
    stated = card_facts(config)
    assert front["base_model"] == stated.pop("base_model") == target
    assert front["peagle"] == stated and stated["speculative_tokens"] == 3
    text = (draft / CARD_FILE).read_text()
    serve = re.search(r"^vllm serve .*$", text, re.M).group(0)
    args = shlex.split(serve)
    spec = json.loads(args[args.index("--speculative-config") + 1])
    assert args[2] == target
    assert spec == {"method": "eagle3", "model": str(draft.resolve()), "parallel_drafting": True,
                    "num_speculative_tokens": 3}
    facts = ("1100 samples", "runs/x/train_prompts.jsonl", "5 per prompt", "temperature 0.7",
             "3 prompts dropped", "num_depths=4", "lr=0.001", "1234 optimizer steps")
    for fact in facts:
        assert fact in text, fact
    assert "Not evaluated yet" in text
    assert check_checkpoint(draft, target) == []


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
    assert str((tmp_path / "out").resolve()) in (tmp_path / "out" / CARD_FILE).read_text()
    assert "1234 optimizer steps" in (tmp_path / "out" / CARD_FILE).read_text()  # kept


def test_someone_elses_readme_is_left_alone(draft, target):
    card = draft / CARD_FILE
    card.write_text("# my notes\n")
    assert read_card(draft) is None
    assert check_checkpoint(draft, target) == []
    assert write_eval_section(draft, "table") is False
    assert card.read_text() == "# my notes\n"


def fake_record(draft):
    def run(path, k, accept):
        return {"prompt_set": "humaneval[120:164]", "draft": path, "label": "trained" if k else
                "no draft", "k": k, "concurrency": 1, "acceptance_length": accept,
                "per_position": [0.5, 0.2] if k else None, "counters": {"num_drafts": 9} if k
                else None, "tokens_per_s": 30.0 if k else 20.0, "tpot_s": None,
                "speedup": 1.5 if k else None}

    other = str(draft.parent / "other")
    return {
        "provenance": {
            "created_utc": "2026-11-27T03:00:00+00:00",
            "argv": ["speculators-peagle", "eval", "--draft", str(draft)],
            "versions": {"vllm": "0.32.0", "torch": None},
            "hardware": {"cpu": "Some CPU", "gpu": None},
        },
        "config": {"dtype": "float32"},
        "drafts": [{"path": str(draft)}, {"path": other}],
        "runs": [run(None, None, None), run(str(draft), 2, 1.734), run(other, 2, 1.111)],
        "recommendation": [],
    }


def test_eval_writes_its_table_into_the_card_and_train_keeps_it(draft):
    write_model_card(draft, TRAINING)
    record = fake_record(draft)
    said = []
    update_model_cards(record, said.append)
    text = (draft / CARD_FILE).read_text()
    assert "1.734" in text and "1.111" not in text  # this draft's rows, not the other's
    assert "no draft" in text and "Not evaluated yet" not in text
    assert "speculators-peagle eval --draft" in text and "Some CPU" in text
    assert "vllm 0.32.0" in text and "torch" not in text.split("Measured")[1].split("\n")[0]
    assert said == [f"model card: {draft / CARD_FILE} (acceptance and speed)"]
    write_model_card(draft)  # a rewrite (export) keeps the measured section and the recipe
    again = (draft / CARD_FILE).read_text()
    assert eval_section(record, str(draft)) in again and "1234 optimizer steps" in again
    assert yaml.safe_load(again.split("---\n")[1])["peagle"]["speculative_tokens"] == 3
