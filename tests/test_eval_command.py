"""The eval command's refusals and warnings (reference backend, no engine), and the prompt
sets it reads: built-in sets, held-out slices, JSONL row formats, the chat template."""

import json
import shutil

import pytest
from click.testing import CliRunner
from safetensors.torch import load_file, save_file
from tiny import tiny_target
from tiny_vllm import trained_target_and_draft
from transformers import AutoTokenizer

from speculators_peagle_plugin.cli import main
from speculators_peagle_plugin.data.prompts import load_prompt_set, render_prompts
from speculators_peagle_plugin.model.model_card import read_card, write_model_card

K = 3


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A random target and a draft trained for a few steps on the target's own replies."""
    return trained_target_and_draft(tmp_path_factory.getbasetemp() / f"trained-k{K}", K)


def test_draft_without_mask_hidden_fails_with_the_linter_sentence(trained, tmp_path):
    target, draft, _ = trained
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in draft.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    weights = load_file(str(broken / "model.safetensors"))
    del weights["mask_hidden"]
    save_file(weights, str(broken / "model.safetensors"))
    result = CliRunner().invoke(
        main, ["eval", "--target", str(target), "--draft", str(broken), "--out", str(tmp_path)]
    )
    assert result.exit_code == 1
    assert "[mask-hidden] the weights have no mask_hidden" in result.output
    assert "Traceback" not in result.output and not (tmp_path / "record.json").exists()


def test_k_past_the_trained_depth_warns_and_the_reference_backend_runs(trained, tmp_path):
    target, trained_draft, _ = trained
    draft = shutil.copytree(trained_draft, tmp_path / "draft")
    write_model_card(draft, {"steps": 60})
    argv = [
        "eval", "--target", str(target), "--draft", str(draft), "--prompts", "chat[:2]",
        "-k", str(K + 1), "--max-new-tokens", "8", "--backend", "reference",
        "--concurrency", "1", "--out", str(tmp_path / "run"),
    ]
    result = CliRunner().invoke(main, argv)
    assert result.exit_code == 0, result.output
    assert "warning [depth]" in result.output and f"position {K + 1}" in result.output
    record = json.loads((tmp_path / "run" / "record.json").read_text())
    assert [r["k"] for r in record["runs"]] == [0, K + 1]
    assert record["runs"][1]["backend"] == "reference"
    (entry,) = read_card(draft)[0]["peagle_eval"]  # the draft's card holds what eval measured
    assert entry["prompts"] == "chat[:2]" and entry["prompt_count"] == 2
    assert entry["settings"] == {"k": K + 1, "concurrency": 1, "max_new_tokens": 8,
                                 "enforce_eager": False, "backend": "reference",
                                 "ignore_eos": False, "dtype": "float32"}
    assert entry["acceptance_length"] == pytest.approx(record["runs"][1]["acceptance_length"],
                                                       abs=1e-4)
    card = (draft / "README.md").read_text()
    assert str(tmp_path) not in card and str(target) not in card


@pytest.mark.parametrize(
    ("case", "sentence"),
    [
        ("missing target", "is not a local model directory"),
        ("missing draft", "is not a directory"),
        ("empty slice", "is empty"),
        ("empty file", "is empty"),
        ("unknown prompts", "nor an existing .jsonl file"),
        ("hidden and vocab", "has hidden size 64, but the draft was trained on hidden size 128"),
        ("bad K", "every K must be an integer >= 1"),
        ("bad concurrency", "every concurrency must be an integer >= 1"),
    ],
)
def test_bad_input_is_one_sentence_and_a_nonzero_exit(trained, tmp_path, case, sentence):
    target, draft, _ = trained
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    args = {
        "missing target": ["--target", str(tmp_path / "nope"), "--draft", str(draft)],
        "missing draft": ["--target", str(target), "--draft", str(tmp_path / "nope")],
        "empty slice": ["--target", str(target), "--draft", str(draft), "--prompts", "chat[5:5]"],
        "empty file": ["--target", str(target), "--draft", str(draft), "--prompts", str(empty)],
        "unknown prompts": ["--target", str(target), "--draft", str(draft), "--prompts", "x.txt"],
        "hidden and vocab": ["--target", tiny_target(tmp_path / "other"), "--draft", str(draft)],
        "bad K": ["--target", str(target), "--draft", str(draft), "-k", "0"],
        "bad concurrency": ["--target", str(target), "--draft", str(draft), "--concurrency", "0"],
    }[case]
    result = CliRunner().invoke(
        main, ["eval", *args, "--backend", "reference", "--out", str(tmp_path / "run")]
    )
    assert result.exit_code == 1
    assert sentence in result.output and "Traceback" not in result.output
    assert not (tmp_path / "run" / "record.json").exists()


# ------------------------------------------------------------------ prompt sets


def test_builtin_prompt_sets_and_held_out_slices():
    humaneval, held_out = load_prompt_set("humaneval"), load_prompt_set("humaneval[120:164]")
    assert len(humaneval) == 164 and len(held_out) == 44
    assert held_out.conversations == humaneval.conversations[120:]
    assert "def " in held_out.conversations[0][0]["content"]
    chat = load_prompt_set("chat")
    assert len(chat) >= 150 and len(load_prompt_set("chat[100:]")) == len(chat) - 100
    assert len({json.dumps(c) for c in chat.conversations}) == len(chat)  # all distinct
    assert all(c[-1]["role"] == "user" for c in chat.conversations)
    hashes = {p.sha256 for p in (humaneval, held_out, chat, load_prompt_set("chat[:100]"))}
    assert len(hashes) == 4 and load_prompt_set("chat[:100]").sha256 == (
        load_prompt_set("chat[0:100]").sha256
    )


def test_jsonl_prompt_formats(tmp_path):
    rows = [
        "a plain string",
        {"prompt": "a prompt"},
        {"instruction": "do this", "input": "with that"},
        {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                      {"role": "assistant", "content": "dropped"}]},
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "x"}]},
    ]
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    got = load_prompt_set(str(path)).conversations
    assert got == [
        [{"role": "user", "content": "a plain string"}],
        [{"role": "user", "content": "a prompt"}],
        [{"role": "user", "content": "do this\n\nwith that"}],
        [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
        [{"role": "user", "content": "hi"}],
    ]
    assert len(load_prompt_set(f"{path}[-2:]")) == 2
    load_prompt_set(f"{path}[3:]").write_jsonl(tmp_path / "again.jsonl")
    assert load_prompt_set(str(tmp_path / "again.jsonl")).conversations == got[3:]
    path.write_text(json.dumps({"messages": [{"role": "assistant", "content": "x"}]}) + "\n")
    with pytest.raises(ValueError, match=r"p.jsonl:1: the conversation has no user turn"):
        load_prompt_set(str(path))
    path.write_text("{not json\n")
    with pytest.raises(ValueError, match=r"p.jsonl:1 is not valid JSON"):
        load_prompt_set(str(path))


def test_chat_template_is_applied(trained):
    target, _, _ = trained
    (ids,) = render_prompts(AutoTokenizer.from_pretrained(target), load_prompt_set("chat[3:4]"))
    text = AutoTokenizer.from_pretrained(target).decode(ids)
    assert text.startswith("<|im_start|>user\n") and text.endswith("<|im_start|>assistant\n")
