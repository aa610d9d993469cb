"""A setting's role is metadata on the setting, and what reads the role reads the metadata:
the resumption's comparison (``resumable``, ``path``, ``prompts``), the model card's recipe
(``card``), generate-data's record, eval's refusal of engine settings beside ``--server``
(``engine``)."""

from dataclasses import MISSING

import pytest

from speculators_peagle_plugin.common.settings import keys_with, leaves
from speculators_peagle_plugin.datagen.datagen_config import DataGenConfig
from speculators_peagle_plugin.evaluation.eval_config import EvalConfig
from speculators_peagle_plugin.training.checkpoint import changed_settings
from speculators_peagle_plugin.training.train_config import TrainConfig

# What a resumption could change before the roles were metadata (training/checkpoint.py's
# RESUMABLE_CHANGES), and what it compared resolved (PATH_FIELDS, the "prompts" case).
RESUMABLE_BEFORE = {
    "max_steps", "epochs", "resume", "no_resume_from_checkpoint", "log_freq", "checkpoint_freq",
    "device", "keep_checkpoints", "save_path", "early_stop_patience", "vllm_endpoint",
    "on_generate", "request_timeout", "max_retries", "generation_validation_retries",
    "max_consecutive_generation_failures",
}
# The recipe a card listed (serving/model_card.py's RECIPE_KEYS).
CARD_BEFORE = {
    "num_layers", "num_depths", "down_sample_ratio", "down_sample_ratio_min", "total_seq_len",
    "sequence_partitions", "optimizer", "lr", "muon_lr", "epochs", "max_steps", "draft_init",
    "autocast", "seed",
}


def defaults() -> dict:
    """Each setting as a checkpoint that does not record it had it: its ``unrecorded``
    value (the optimizer: adamw, from before the key existed), else its default."""
    return {leaf.key: leaf.field.metadata.get("unrecorded", leaf.default)
            for leaf in leaves(TrainConfig) if leaf.default is not MISSING}


def test_the_roles_mark_the_settings_the_key_lists_named():
    assert set(keys_with(TrainConfig, "resumable")) == RESUMABLE_BEFORE
    assert keys_with(TrainConfig, "path") == ("verifier_name_or_path", "data_path",
                                              "from_pretrained")
    assert keys_with(TrainConfig, "prompts") == ("prompts",)
    assert set(keys_with(TrainConfig, "card")) == CARD_BEFORE
    # generate-data's record leaves these out (datagen's old list), a running server has these
    assert set(keys_with(DataGenConfig, "resumable")) == {
        "output", "batch_size", "draft_vocab_size", "device", "kv_cache_gb", "data_parallel_size"
    }
    assert set(keys_with(EvalConfig, "engine")) == {
        "drafts", "ks", "ks_at_max_concurrency", "backend", "baseline", "dtype", "max_model_len",
        "kv_cache_gb", "in_process", "enforce_eager", "interleave",
    }


@pytest.mark.parametrize("key", sorted(RESUMABLE_BEFORE))
def test_a_setting_marked_resumable_may_change_on_resume(key):
    recorded = defaults()
    assert changed_settings(TrainConfig, {key: "another value"}, recorded) == []


def test_a_setting_not_marked_resumable_is_refused_when_it_changed():
    unmarked = [leaf.key for leaf in leaves(TrainConfig)
                if not leaf.field.metadata.get("resumable") and leaf.default is not MISSING]
    assert {"lr", "num_depths", "total_seq_len", "optimizer", "seed"} <= set(unmarked)
    for key in unmarked:
        assert changed_settings(TrainConfig, {key: "another value"}, defaults()) == [key]


def test_paths_and_prompt_specs_are_compared_resolved(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    (tmp_path / "p.jsonl").write_text('{"prompt": "hi"}\n')
    current = {**defaults(), "data_path": str(tmp_path / "data"),
               "prompts": str(tmp_path / "p.jsonl") + "[0:3]", "verifier_name_or_path": "target"}
    recorded = {"data_path": "./data/../data", "prompts": "p.jsonl[0:3]",
                "verifier_name_or_path": str(tmp_path / "target")}
    assert changed_settings(TrainConfig, recorded, current) == []
    assert changed_settings(TrainConfig, {**recorded, "data_path": "other"}, current) == [
        "data_path"
    ]
    assert changed_settings(TrainConfig, {**recorded, "prompts": "p.jsonl[0:4]"}, current) == [
        "prompts"
    ]


def test_an_old_checkpoint_without_a_younger_key_had_its_default():
    # every run before --optimizer existed was AdamW's, though muon is the default now
    assert defaults()["optimizer"] == "adamw"
    assert next(leaf.default for leaf in leaves(TrainConfig) if leaf.key == "optimizer") == "muon"
    current = {**defaults(), "optimizer": "muon"}
    assert changed_settings(TrainConfig, {}, current) == ["optimizer"]
    assert changed_settings(TrainConfig, {}, defaults()) == []
    assert changed_settings(TrainConfig, {"gone_key": None}, defaults()) == []
    assert changed_settings(TrainConfig, {"gone_key": 3}, defaults()) == ["gone_key"]
