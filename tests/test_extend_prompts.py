"""tools/extend_prompts.py: a larger spec's prompts after a run's own, less its validation
prompts; the oracle is the prompt set itself."""

import hashlib
import json
import sys
from pathlib import Path

import pytest
from helpers.every_turn import turn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from speculators_peagle_plugin.data.prompts import load_prompt_set  # noqa: E402
from speculators_peagle_plugin.demo.artifacts import write_prompts  # noqa: E402
from tools.extend_prompts import extend_prompts  # noqa: E402

HELD_OUT = ("humaneval[120:164]",)


def long_run(tmp_path: Path, spec: str, validation: dict) -> Path:
    """A run directory as the long recipe leaves it: ``spec``'s training prompts, the one
    validation conversation ``validation`` and the stages record extend_prompts reads."""
    run = tmp_path / "long"
    run.mkdir()
    write_prompts((spec,), HELD_OUT, run / "train_prompts.jsonl")
    (run / "validation_prompts.jsonl").write_text(json.dumps({"messages": validation}) + "\n")
    sha = hashlib.sha256((run / "train_prompts.jsonl").read_bytes()).hexdigest()
    replies = {"prompts": sha, "dtype": "float32", "max_new_tokens": 8, "num_samples": 1,
               "temperature": 0.7, "backend": "vllm"}
    (run / "stages.json").write_text(json.dumps({
        "target": {"outputs": {"path": str(tmp_path / "target")}},
        "prompts": {"inputs": {"specs": [spec], "eval": list(HELD_OUT)}},
        "data": {"inputs": replies}, "validation data": {"inputs": {}},
    }))
    return run


def test_the_prompts_after_the_runs_own_less_its_validation_prompts(tmp_path, capsys):
    chat = load_prompt_set("chat[0:8]").conversations
    run = long_run(tmp_path, "chat[0:4]", chat[6])
    out = tmp_path / "ext" / "train_prompts.jsonl"
    assert extend_prompts(run, "chat[0:8]", out) == 3
    rows = [json.loads(line)["messages"] for line in out.read_text().splitlines()]
    assert rows == [chat[4], chat[5], chat[7]]
    said = capsys.readouterr().out
    assert f"3 prompts after the run's 4 -> {out} (1 left out: validation prompts)" in said
    assert f"--prompts {out} --output {out.parent / 'data'} --max-new-tokens 8" in said
    with pytest.raises(SystemExit) as err:
        extend_prompts(run, "chat[1:8]", out)
    assert str(err.value) == (
        f"--prompts 'chat[1:8]' does not begin with the 4 training prompts of {run}; give a "
        "spec that extends the run's (chat[0:4])."
    )
    with pytest.raises(SystemExit) as err:
        extend_prompts(run, "chat[0:8]+humaneval[120:121]", out)
    assert str(err.value) == (
        "--prompts 'chat[0:8]+humaneval[120:121]': 1 conversation(s) of the eval set "
        "'humaneval[120:164]' are also training prompts; eval prompts must be held out."
    )
    assert len(out.read_text().splitlines()) == 3  # the file written before is untouched


def test_a_second_extension_continues_the_first(tmp_path, capsys):
    chat = load_prompt_set("chat[0:9]").conversations
    run = long_run(tmp_path, "chat[0:3]", chat[4])
    first, second = tmp_path / "ext" / "p.jsonl", tmp_path / "ext2" / "p.jsonl"
    assert extend_prompts(run, "chat[0:6]", first) == 2  # 3 and 5 (4 is validation)
    assert extend_prompts(run, "chat[0:9]", second, after=(first,)) == 3
    rows = [json.loads(line)["messages"] for line in second.read_text().splitlines()]
    assert rows == chat[6:9]
    assert f"3 prompts after the run's 5 -> {second} (1 left out" in capsys.readouterr().out
    with pytest.raises(SystemExit) as err:  # skips the first extension's prompt 3
        extend_prompts(run, "chat[0:3]+chat[5:9]", second, after=(first,))
    assert str(err.value) == (
        f"--prompts 'chat[0:3]+chat[5:9]' does not continue with the 2 prompts of {first}; "
        "give a spec that extends theirs."
    )
    missing = tmp_path / "nowhere.jsonl"
    with pytest.raises(SystemExit) as err:
        extend_prompts(run, "chat[0:9]", second, after=(first, missing))
    assert str(err.value) == (
        f"--after {missing} is not a file; give the prompts files of earlier extensions."
    )
    assert len(second.read_text().splitlines()) == 3  # the file written before is untouched


def test_an_extension_leaves_out_a_conversation_that_opens_as_a_validation_prompt(
    tmp_path, fake_sharegpt
):
    fake_sharegpt([{"conversations": [turn("human", f"question {i} here"), turn("gpt", "a"),
                                      turn("human", f"more on {i}")]} for i in range(5)])
    turns = load_prompt_set("sharegpt_turns").conversations
    opening = load_prompt_set("sharegpt[3:4]").conversations[0]  # sharegpt_turns[3]'s first
    run = long_run(tmp_path, "sharegpt_turns[0:2]", opening)
    out = tmp_path / "ext" / "train_prompts.jsonl"
    assert extend_prompts(run, "sharegpt_turns", out) == 2
    rows = [json.loads(line)["messages"] for line in out.read_text().splitlines()]
    assert rows == [turns[2], turns[4]]
