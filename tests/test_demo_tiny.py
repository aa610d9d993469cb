"""The demo end to end on the tiny target (``helpers.tiny_demo``): every stage's command runs
in this process, eval on the reference backend."""

import json
from pathlib import Path

import pytest

from speculators_peagle_plugin.demo import pipeline as demo
from speculators_peagle_plugin.model.model_card import read_card


@pytest.mark.slow
def test_the_demo_on_a_target_smaller_than_its_draft_vocabulary_finishes(
    target, tmp_path, monkeypatch
):
    """The tiny target (272 tokens) under a training YAML that leaves the draft vocabulary at
    its default (8192 tokens)."""
    from helpers import tiny_demo

    tiny_demo.install(target, monkeypatch)
    path = tiny_demo.recipe(tmp_path, draft_vocab_size=None)
    config = demo.DemoConfig.from_recipe(path, run_dir=str(tmp_path / "run"))
    demo.run_demo(config, echo=lambda line: None)
    vocab = json.loads((Path(target) / "config.json").read_text())["vocab_size"]
    for draft in ("trained-draft", "untrained-draft"):
        saved = json.loads((tmp_path / "run" / draft / "config.json").read_text())
        assert saved["draft_vocab_size"] == vocab, draft
    assert (tmp_path / "run" / "data" / f"d2t-{vocab}.npy").is_file()
    assert read_card(tmp_path / "run" / "trained-draft")[0]["base_model"] == (
        "HuggingFaceTB/SmolLM2-135M-Instruct"
    )
