"""generate-data at cluster scale: ``--shard I/N`` with ``join-data``, ``--data-parallel-size``.

Oracle: one generate-data process over all the prompts. Its parts joined, and its replicas,
must make its files byte for byte (greedy replies, the transformers backend); the prompts share
a long system turn, so rows on both sides of a part boundary start alike.
"""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from datasets import load_from_disk
from helpers.chat_target import LAYER_IDS, MAX_NEW
from helpers.stops import stopped_at_call

from speculators_peagle_plugin.cli import main
from speculators_peagle_plugin.common.files import TMP_MARK
from speculators_peagle_plugin.datagen import capture as capture_mod
from speculators_peagle_plugin.datagen import generation as gen_mod
from speculators_peagle_plugin.datagen import join as join_mod
from speculators_peagle_plugin.datagen import replicas as replicas_mod
from speculators_peagle_plugin.datagen.build_data import generate_data
from speculators_peagle_plugin.datagen.capture import MIN_SHARED_PREFIX
from speculators_peagle_plugin.datagen.datagen_config import DataGenConfig
from speculators_peagle_plugin.datagen.join import JoinConfig, join_data
from speculators_peagle_plugin.datagen.shard_plan import Shard, piece_size

SYSTEM = {"role": "system",
          "content": "You answer every question kindly, briefly and in plain words."}


def _chat(*users: str) -> dict:
    turns = [SYSTEM]
    for user in users:
        turns += [{"role": "user", "content": user}, {"role": "assistant", "content": "x"}]
    return {"messages": turns[:-1]}


# 7 conversations (one of two turns) in batches of 2: parts 0/2 = [0, 4), 1/2 = [4, 7)
PROMPTS = [
    _chat("hello world"), {"prompt": "fox, how are you?"}, _chat("how are you", "the quick fox"),
    _chat("quick brown"), _chat("are you the fox"), _chat("hello fox"), _chat("brown world"),
]
BATCH = 2


def gen_args(target, prompts, output, *extra):
    return [
        "generate-data", "--target", target, "--prompts", prompts, "--output", output,
        "--max-new-tokens", MAX_NEW, "--batch-size", BATCH,
        "--target-layer-ids", ",".join(map(str, LAYER_IDS)), "--draft-vocab-size", 40, *extra,
    ]


def run(*argv):
    return CliRunner().invoke(main, [str(a) for a in argv])


def files(path) -> dict[str, bytes]:
    """Every file of a data directory by its path in it (the lock and logs aside)."""
    return {
        str(p.relative_to(path)): p.read_bytes()
        for p in sorted(Path(path).rglob("*"))
        if p.is_file() and p.name != ".lock" and not p.name.endswith(".log")
    }


def assert_same_files(got: Path, expected: Path) -> None:
    mine, theirs = files(got), files(expected)
    assert sorted(mine) == sorted(theirs)
    assert [name for name in theirs if mine[name] != theirs[name]] == []


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in PROMPTS) + "\n")
    return path


@pytest.fixture(scope="module")
def made(tmp_path_factory, target_dir, prompts):
    """One run over all the prompts (``one``), and parts 0/2, 1/2 and 0/3 of it."""
    root = tmp_path_factory.mktemp("made")
    for name, extra in {
        "one": [], "part0": ["--shard", "0/2"], "part1": ["--shard", "1/2"],
        "third0": ["--shard", "0/3"],
    }.items():
        result = run(*gen_args(target_dir, prompts, root / name, *extra))
        assert result.exit_code == 0, result.output
    return root


def test_parts_cut_at_piece_boundaries_tile_the_conversations_and_replicas_compose():
    assert piece_size(8, 3) == 24 and piece_size(4, 2) == 4 and piece_size(3, 1) == 3
    assert Shard.parse("1/2").span(10, 3) == (6, 10)
    assert Shard(1, 2).replica(1, 2) == Shard(3, 4) and Shard(3, 4).span(10, 3) == (9, 10)
    for conversations in range(1, 24):
        for batch in range(1, 5):
            for count in range(1, 6):
                spans = [Shard(i, count).span(conversations, batch) for i in range(count)]
                assert spans[0][0] == 0 and spans[-1][1] == conversations
                assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))
                assert all(start % batch == 0 for start, _ in spans)
                for i, (start, stop) in enumerate(spans):
                    for replicas in (2, 3):
                        parts = [Shard(i, count).replica(r, replicas).span(conversations, batch)
                                 for r in range(replicas)]
                        assert parts[0][0] == start and parts[-1][1] == stop
                        assert all(a[1] == b[0] for a, b in zip(parts, parts[1:], strict=False))


def test_two_parts_joined_are_one_run_byte_for_byte(made, tmp_path):
    records = [json.loads((made / p / "generation_settings.json").read_text())["shard"]
               for p in ("part0", "part1")]
    assert [r["conversations"] for r in records] == [[0, 4], [4, 7]]
    # the rows on both sides of the boundary share a prefix that the capture would reuse
    rows = load_from_disk(str(made / "one")).with_format(None)["input_ids"]
    prompt = json.loads((made / "one" / "row_prompts.json").read_text())
    k = prompt.index(4)
    before, after = rows[k - 1], rows[k]
    shared = next(i for i, (a, b) in enumerate(zip(before, after, strict=False)) if a != b)
    assert shared >= MIN_SHARED_PREFIX

    out = tmp_path / "joined"
    result = run("join-data", made / "part1", made / "part0", "--output", out,
                 "--draft-vocab-size", 40)
    assert result.exit_code == 0, result.output
    assert_same_files(out, made / "one")
    assert any(name.startswith("d2t-40") for name in files(out))


def test_parts_of_sampled_replies_joined_are_one_run_byte_for_byte(target_dir, prompts, tmp_path):
    """Two replies per prompt, batches of 3: parts cut at every 6 conversations (3 prompts),
    so a prompt's samples, which share its prefix's forward, stay in one part."""
    sampled = ("--num-samples", 2, "--temperature", 0.9, "--batch-size", 3)
    parts = {"one": [], "part0": ["--shard", "0/2"], "part1": ["--shard", "1/2"]}
    for name, extra in parts.items():
        result = run(*gen_args(target_dir, prompts, tmp_path / name, *sampled, *extra))
        assert result.exit_code == 0, result.output
    record = json.loads((tmp_path / "part1" / "generation_settings.json").read_text())["shard"]
    assert record["conversations"] == [6, 14]
    result = run("join-data", tmp_path / "part0", tmp_path / "part1", "--output",
                 tmp_path / "joined", "--draft-vocab-size", 40)
    assert result.exit_code == 0, result.output
    assert_same_files(tmp_path / "joined", tmp_path / "one")


def test_join_refuses_overlaps_gaps_other_settings_and_unfinished_parts(
    made, target_dir, prompts, tmp_path
):
    other = tmp_path / "other1"
    result = run(*gen_args(target_dir, prompts, other, "--shard", "1/2", "--max-new-tokens", 5))
    assert result.exit_code == 0, result.output
    unfinished = tmp_path / "unfinished1"
    shutil.copytree(made / "part1", unfinished)
    (unfinished / "hidden_states" / "hs_0.safetensors").unlink()
    part0, part1, third0 = (f"part {n} ({made / d})" for n, d in
                            (("0/2", "part0"), ("1/2", "part1"), ("0/3", "third0")))
    cases = {
        "overlap": ([made / "part0", made / "third0", made / "part1"],
                    f"{part0} makes conversations [0, 4), which {third0} makes too"),
        "twice": ([made / "part0", made / "part0", made / "part1"],
                  f"{part0} makes conversations [0, 4), which {part0} makes too"),
        "gap after": ([made / "part0"],
                      f"No part makes conversations [4, 7) of the 7 (they come after {part0})"),
        "gap between": ([made / "third0", made / "part1"],
                        f"No part makes conversations [2, 4) of the 7 (they come before {part1})"),
        "other settings": ([made / "part0", other],
                           f"part 1/2 ({other}) was made with other settings than {part0} "
                           "(max_new_tokens: 5 there, 6 in"),
        "unfinished": ([made / "part0", unfinished],
                       f"part 1/2 ({unfinished}) is not complete"),
        "not a part": ([made / "one"], f"{made / 'one'} holds all of its data"),
    }
    for name, (parts, message) in cases.items():
        out = tmp_path / f"joined-{name.replace(' ', '-')}"
        result = run("join-data", *parts, "--output", out)
        assert result.exit_code != 0, name
        assert message in " ".join(result.output.split()), (name, result.output)
        assert not out.exists(), name


def test_a_part_resumes_on_its_own_and_keeps_its_part(made, target_dir, prompts, tmp_path,
                                                      monkeypatch):
    out = tmp_path / "part1"
    config = DataGenConfig.from_sources(
        target=str(target_dir), prompts=str(prompts), output=str(out), max_new_tokens=MAX_NEW,
        batch_size=BATCH, target_layer_ids=LAYER_IDS, draft_vocab_size=40, shard="1/2",
    )
    # killed in the second batch; a call's note: its conversations' global indices
    with stopped_at_call(monkeypatch, gen_mod, "_regenerate", 2, lambda *a: a[2]) as calls:
        generate_data(config)
    assert calls == [[4, 5], [6]]
    assert [p.name for p in (out / "responses").iterdir()] == ["000000004-000000005.json"]

    with stopped_at_call(monkeypatch, capture_mod, "save_safetensors", 2):  # after one file
        generate_data(config)
    assert [p.name for p in (out / "hidden_states").iterdir()] == ["hs_0.safetensors"]
    generate_data(config)
    assert_same_files(out, made / "part1")

    result = run(*gen_args(target_dir, prompts, out, "--shard", "0/2"))
    assert result.exit_code != 0
    assert "was made with different settings (shard: " in result.output


@pytest.mark.parametrize("text, message", [
    ("2/2", "--shard 2/2 names part 2 of 2; parts are counted from 0, so I must be in [0, 2)"),
    ("1of2", "--shard must be I/N (part I of N, counted from 0), got '1of2'"),
    ("0/5", "--shard 0/5 gets no prompts: 7 conversations in pieces of 2 (whole batches of "
            "--batch-size holding whole prompts) make 4 pieces for 5 parts"),
])
def test_a_bad_shard_is_one_sentence(target_dir, prompts, tmp_path, text, message):
    out = tmp_path / "data"
    result = run(*gen_args(target_dir, prompts, out, "--shard", text))
    assert result.exit_code != 0
    assert message in " ".join(result.output.split())
    assert not out.exists()


@pytest.mark.slow
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="two replicas need two cores")
def test_two_cpu_replicas_make_the_files_of_one_process(target_dir, prompts, tmp_path):
    """Each replica computes on its half of the cores: the one process it must equal runs on
    as many threads (a float32 product's rounding may depend on the thread count, as on
    AVX2-only CPUs)."""
    cores = len(os.sched_getaffinity(0))
    if cores % 2:
        pytest.skip(f"{cores} cores: the two replicas would compute on different thread counts")
    threads = torch.get_num_threads()
    torch.set_num_threads(cores // 2)
    try:
        result = run(*gen_args(target_dir, prompts, tmp_path / "one"))
    finally:
        torch.set_num_threads(threads)
    assert result.exit_code == 0, result.output
    out = tmp_path / "replicated"
    result = run(*gen_args(target_dir, prompts, out, "--data-parallel-size", 2))
    assert result.exit_code == 0, result.output
    assert not (out / "replicas").exists()
    assert_same_files(out, tmp_path / "one")


def test_more_replicas_than_cores_is_one_sentence(target_dir, prompts, tmp_path):
    cores = len(os.sched_getaffinity(0))
    out = tmp_path / "data"
    result = run(*gen_args(target_dir, prompts, out, "--data-parallel-size", cores + 1))
    assert result.exit_code != 0
    assert (f"--data-parallel-size {cores + 1} with --tensor-parallel-size 1 needs {cores + 1} "
            f"CPU cores, one per rank, and this machine has {cores}") in " ".join(
                result.output.split())
    assert not out.exists()


def test_a_stopped_join_resumes_and_another_joins_output_is_refused(made, tmp_path, monkeypatch):
    out = tmp_path / "joined"
    config = JoinConfig(parts=(str(made / "part0"), str(made / "part1")), output=str(out),
                        draft_vocab_size=40)
    with stopped_at_call(monkeypatch, join_mod, "_link_or_copy", 3):  # at the third file
        join_data(config)
    assert len(list((out / "hidden_states").iterdir())) == 2

    def no_links(source, target):
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr(join_mod.os, "link", no_links)  # the rest is copied
    join_data(config)
    assert_same_files(out, made / "one")
    nlinks = [p.stat().st_nlink for p in (out / "hidden_states").iterdir()]
    assert sum(n == 1 for n in nlinks) == len(nlinks) - 2  # all copied but the 2 linked first

    others = []
    for name in ("part0", "part1"):  # the same parts, as if made with another seed
        other = shutil.copytree(made / name, tmp_path / name)
        settings = json.loads((other / "generation_settings.json").read_text())
        (other / "generation_settings.json").write_text(json.dumps({**settings, "seed": 5}))
        others.append(other)
    result = run("join-data", *others, "--output", out)
    assert result.exit_code != 0
    assert f"--output {out} holds other data than the join of these parts" in " ".join(
        result.output.split())


def test_a_join_killed_while_writing_its_settings_resumes(made, tmp_path):
    out = tmp_path / "joined"
    out.mkdir()
    (out / ".lock").write_text("999999\n")
    (out / f".generation_settings.json{TMP_MARK}999999").write_text('{"tar')
    result = run("join-data", made / "part0", made / "part1", "--output", out,
                 "--draft-vocab-size", 40)
    assert result.exit_code == 0, result.output
    assert_same_files(out, made / "one")


def in_process(config, parts, dirs, environments):
    """The replicas run one after the other in this process (the parent's logic under test)."""
    for part, directory, (_, cores) in zip(parts, dirs, environments, strict=True):
        values = replicas_mod._replica_config(config, part, directory, cores is not None)
        generate_data(DataGenConfig.from_sources(**values))


def test_replicas_stopped_midway_resume_each_on_its_own_into_one_runs_files(
    made, target_dir, prompts, tmp_path, monkeypatch
):
    out = tmp_path / "replicated"
    config = DataGenConfig.from_sources(
        target=str(target_dir), prompts=str(prompts), output=str(out), max_new_tokens=MAX_NEW,
        batch_size=BATCH, target_layer_ids=LAYER_IDS, draft_vocab_size=40, data_parallel_size=2,
    )
    real = gen_mod._regenerate

    def second_replica_killed(*args, **kwargs):
        if args[2][0] >= 4:  # a conversation of replica 1/2
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(replicas_mod, "_run_replicas", in_process)
    monkeypatch.setattr(gen_mod, "_regenerate", second_replica_killed)
    with pytest.raises(KeyboardInterrupt):
        generate_data(config)
    assert_same_files(out / "replicas" / "0-of-2", made / "part0")
    assert not (out / "state.json").exists()

    calls = []
    monkeypatch.setattr(gen_mod, "_regenerate", lambda *a, **k: calls.append(a[2]) or real(*a, **k))
    generate_data(config)
    assert calls == [[4, 5], [6]]  # replica 0/2 was complete: nothing of it generated again
    assert not (out / "replicas").exists()
    assert_same_files(out, made / "one")


def test_a_failed_replica_is_one_sentence_naming_it_and_its_log(
    target_dir, prompts, tmp_path, monkeypatch
):
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'loading...'\necho 'Error: the disk said no.' >&2\nexit 3\n")
    fake.chmod(0o755)
    monkeypatch.setattr(replicas_mod.sys, "executable", str(fake))
    out = tmp_path / "data"
    result = run(*gen_args(target_dir, prompts, out, "--data-parallel-size", 2))
    assert result.exit_code != 0
    log = out / "replicas" / "0-of-2.log"
    assert (f"Replica 0/2 of --data-parallel-size 2 failed (exit 3: Error: the disk said no); "
            f"its log is {log}; run the same command again to resume.") in " ".join(
                result.output.split())
