"""Online training: the target computes the hidden states inside training.

The oracle is the offline path on the same rows: ``generate-data`` wrote the tiny target's
states to disk, and an online step over token ids alone must give the same batch, loss and
gradients.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.training import (
    DRAFT_VOCAB,
    config_for,
    reference_step,
    refusal,
    run_cli,
    train_args,
)
from safetensors.torch import load_file
from tiny import tiny_workdir

from speculators_peagle_plugin.datagen import build_data
from speculators_peagle_plugin.datagen.online_states import CACHE_DIR, CACHE_KEY_FILE
from speculators_peagle_plugin.training.checkpoint import checkpoint_dirs
from speculators_peagle_plugin.training.loop import build_training
from speculators_peagle_plugin.training.online import REPLIES_DIR
from speculators_peagle_plugin.training.progress import METRICS_FILE
from speculators_peagle_plugin.training.step import train_step

ONLINE = {"online": True, "target_layer_ids": (1, 2, 3)}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """The tiny target, its offline data, and ``tokens/``: the same rows without states."""
    root = tiny_workdir(tmp_path_factory.mktemp("online"), DRAFT_VOCAB)
    shutil.copytree(root / "data", root / "tokens", ignore=shutil.ignore_patterns("hidden_states"))
    return root


def online_config(workdir, save, **kw):
    return config_for(workdir, save, data_path=str(workdir / "tokens"), **(ONLINE | kw))


def one_step(setup, epoch=0, index=0):
    """``(batch, loss, {name: grad})`` of one step of ``setup`` (no optimizer step)."""
    batch = setup.batches.batch(epoch, index)
    step = epoch * len(setup.batches) + index
    setup.optimizers.zero_grad(set_to_none=True)
    stats = train_step(setup.wrapped, setup.module, batch, setup.config, setup.world, step)
    grads = {n: p.grad.clone() for n, p in setup.draft.named_parameters() if p.grad is not None}
    return batch, float(stats["loss_sum"] / stats["total_den"]), grads


@pytest.mark.parametrize(
    ("seed", "seq_len", "partitions", "layer_ids"),
    [(0, 96, 1, (1, 2, 3)), (1, 160, 2, (1, 2, 3)), (2, 64, 3, (1, 2, 3)), (3, 96, 1, (2, 4))],
)
def test_an_online_step_equals_the_offline_step_on_the_same_rows(
    workdir, tmp_path, seed, seq_len, partitions, layer_ids
):
    """Loss and every gradient agree: the states are the offline capture's, per document.
    Aux id 4 of the 4-layer target is the state after the last layer, before the final
    norm: offline reads it from each sample's last slot, online captures it."""
    kw = {"seed": seed, "total_seq_len": seq_len, "sequence_partitions": partitions,
          "target_layer_ids": layer_ids}
    offline = build_training(config_for(workdir, tmp_path / "off", **kw))
    online = build_training(online_config(workdir, tmp_path / "on", **kw))
    assert online.batches.data.online is not None and offline.batches.data.online is None
    # the rows of most and fewest documents (ragged lengths, padding)
    docs = [len(offline.batches.step_samples(0, i)) for i in range(len(offline.batches))]
    rows = {docs.index(max(docs)), docs.index(min(docs))}
    assert max(docs) > 1
    for index in rows:
        off_batch, off_loss, off_grads = one_step(offline, 0, index)
        on_batch, on_loss, on_grads = one_step(online, 0, index)
        assert off_batch.keys() == on_batch.keys()
        for key, value in off_batch.items():
            # the same function of the same tokens: equal up to float32 rounding at most
            torch.testing.assert_close(on_batch[key], value, rtol=1e-6, atol=1e-6, msg=key)
        assert on_loss == pytest.approx(off_loss, rel=1e-6)
        assert on_grads.keys() == off_grads.keys() and len(on_grads) > 3
        for name, grad in off_grads.items():
            torch.testing.assert_close(on_grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def epoch_batches(setup, epoch):
    return [setup.batches.batch(epoch, i) for i in range(len(setup.batches))]


def test_the_ram_cache_serves_the_second_epoch_exactly(workdir, tmp_path):
    plain = build_training(online_config(workdir, tmp_path / "plain"))
    # a cap that holds some samples, not all: 64 hidden x 4 slots x 4 bytes per token
    cached = build_training(online_config(workdir, tmp_path / "ram", online_cache="ram",
                                          online_cache_gib=300 * 1024 / 2**30))
    states = cached.batches.data.online
    cache, n = states.cache, cached.batches.data.num_samples
    assert 0 < cache.rows < n and cache.bytes <= 300 * 1024
    epoch_batches(cached, 0)
    assert (states.computed, cache.hits) == (n, 0)
    second = epoch_batches(cached, 1)
    assert (states.computed, cache.hits) == (2 * n - cache.rows, cache.rows)
    for got, want in zip(second, epoch_batches(plain, 1), strict=True):
        assert torch.equal(got["hidden_states"], want["hidden_states"])
        assert torch.equal(got["verifier_last_hidden_states"], want["verifier_last_hidden_states"])
    assert one_step(cached, 1, 0)[1] == one_step(plain, 1, 0)[1]
    assert not (tmp_path / "ram" / CACHE_DIR).exists()


def test_the_disk_cache_is_bfloat16_capped_and_the_same_in_every_epoch(workdir, tmp_path):
    save = tmp_path / "disk"
    cap = 150 * 1024  # bytes: 64 x 4 slots x 2 bytes + 8 per token -> some samples
    config = online_config(workdir, save, online_cache="disk", online_cache_gib=cap / 2**30)
    first = build_training(config)
    states, n = first.batches.data.online, first.batches.data.num_samples
    cache = states.cache
    assert 0 < cache.rows < n
    epoch0 = epoch_batches(first, 0)
    files = sorted((save / CACHE_DIR).glob("hs_*.safetensors"))
    assert len(files) == cache.rows
    assert sum(f.stat().st_size for f in files) <= cap + len(files) * 256  # + headers
    stored = load_file(files[0])
    assert stored["hidden_states"].dtype == torch.bfloat16
    epoch1 = epoch_batches(first, 1)
    assert cache.hits == cache.rows and states.computed == 2 * n - cache.rows
    # A cached sample trains on its bfloat16 states from the start: a new process that
    # reads the files (a resume) sees exactly the batches the first one computed.
    again = build_training(config)
    assert all(
        torch.equal(a["hidden_states"], b["hidden_states"])
        for a, b in zip(epoch_batches(again, 0), epoch0, strict=True)
    )
    assert again.batches.data.online.computed == n - cache.rows
    # ... and within bfloat16 rounding of the uncached run, loss included
    plain = build_training(online_config(workdir, tmp_path / "plain"))
    for got, want in zip(epoch1, epoch_batches(plain, 1), strict=True):
        torch.testing.assert_close(got["hidden_states"], want["hidden_states"],
                                   rtol=1e-2, atol=1e-2)
    assert one_step(first, 1, 0)[1] == pytest.approx(one_step(plain, 1, 0)[1], rel=1e-2)
    # states of other settings are not reused
    key = json.loads((save / CACHE_DIR / CACHE_KEY_FILE).read_text())
    assert key["target_dtype"] == "float32" and key["layer_ids"] == [1, 2, 3]
    other = build_training(config.replace(target_layer_ids=(0, 1, 3)))
    epoch_batches(other, 0)
    assert other.batches.data.online.cache.hits == 0
    assert json.loads((save / CACHE_DIR / CACHE_KEY_FILE).read_text())["layer_ids"] == [0, 1, 3]


def online_args(workdir, save, *extra):
    """``train --online`` on the token-only rows of the tiny data."""
    args = train_args(workdir, save, "--online", "--target-layer-ids", "1,2,3", *extra)
    args[args.index("--data-path") + 1] = str(workdir / "tokens")
    return args


@pytest.mark.slow
def test_an_online_run_stopped_by_sigterm_resumes_to_the_same_weights(
    workdir, tmp_path, monkeypatch
):
    """The batch is a pure function of (epoch, step), disk cache included: SIGTERM after
    step 3, then the same command again, gives the uninterrupted run's weights (the run
    crosses an epoch boundary, so the second epoch reads the cache)."""
    from speculators_peagle_plugin.training import loop

    def record_then_sigterm(path, record, append=loop.append_record):
        append(path, record)
        if record["step"] == 3 and "cut" in str(path):
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(loop, "append_record", record_then_sigterm)
    per_epoch = len(build_training(online_config(workdir, tmp_path / "n", total_seq_len=256))
                    .batches)
    cap = str(150 * 1024 / 2**30)
    args = ("--max-steps", str(per_epoch + 2), "--online-cache", "disk", "--online-cache-gib",
            cap, "--sequence-partitions", "2", "--total-seq-len", "256")
    code, out = run_cli(online_args(workdir, tmp_path / "straight", *args))
    assert code == 0, out
    code, out = run_cli(online_args(workdir, tmp_path / "cut", *args))
    assert code == 128 + signal.SIGTERM, out
    assert checkpoint_dirs(tmp_path / "cut")[-1].name == "checkpoint-4"
    code, out = run_cli(online_args(workdir, tmp_path / "cut", *args))
    assert code == 0, out
    a = load_file(checkpoint_dirs(tmp_path / "straight")[-1] / "model.safetensors")
    b = load_file(checkpoint_dirs(tmp_path / "cut")[-1] / "model.safetensors")
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_online_from_prompts_writes_no_hidden_states_and_generates_the_replies_once(
    workdir, tmp_path, monkeypatch
):
    save = tmp_path / "save"
    args = online_args(workdir, save, "--max-steps", "2", "--max-new-tokens", "24",
                       "--temperature", "1.0")
    i = args.index("--data-path")
    args[i : i + 2] = ["--prompts", f"{workdir / 'prompts.jsonl'}[:6]"]
    code, out = run_cli(args)
    assert code == 0, out
    written = [p.relative_to(save) for p in save.rglob("*") if p.is_file()]
    assert not [p for p in written if "hidden_states" in str(p)]
    tensors = [p for p in written if p.suffix == ".safetensors"]
    assert all(p.parts[0].startswith("checkpoint-") for p in tensors), tensors
    replies = save / REPLIES_DIR
    assert (replies / "state.json").exists() and not (replies / "hidden_states").exists()
    records = [json.loads(x) for x in (save / METRICS_FILE).read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert all(0 < r["target_share"] < 1 for r in records)

    def no_generation(*a, **k):
        raise AssertionError("the replies were generated again")

    monkeypatch.setattr(build_data, "generate_responses", no_generation)
    args[args.index("--max-steps") + 1] = "3"
    code, out = run_cli(args)
    assert code == 0, out
    assert [p.name for p in checkpoint_dirs(save)][-1] == "checkpoint-3"


@pytest.mark.slow
def test_two_ranks_online_equal_one_offline_process_on_the_global_batch(workdir, tmp_path):
    """torchrun, 2 ranks, each running its own target on its own rows: one optimizer step
    equals the offline single-process step over both rows."""
    save = tmp_path / "ddp"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
        "--master_port", "29531", "-m", "speculators_peagle_plugin",
        *online_args(workdir, save, "--max-steps", "1", "--sequence-partitions", "2"),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    ddp = load_file(checkpoint_dirs(save)[-1] / "model.safetensors")
    ref = reference_step(workdir, tmp_path / "ref", 2)
    initial = build_training(config_for(workdir, tmp_path / "init")).draft.state_dict()
    changed = 0
    for key, value in ddp.items():
        torch.testing.assert_close(value, ref[key], rtol=1e-5, atol=1e-5, msg=key)
        changed += not torch.equal(value, initial[key])
    assert changed >= 3
    assert not list(Path(save).rglob("hs_*"))


# ------------------------------------------------------------------ bad input (docs/bad_input.md)


def token_only_data(path: Path, rows: dict) -> Path:
    from datasets import Dataset

    Dataset.from_dict(rows).save_to_disk(str(path))
    return path


@pytest.mark.parametrize(
    ("extra", "drop", "sentence"),
    [
        (["--prompts", "chat"], (), "--prompts needs --online"),
        (["--online", "--prompts", "chat"], (), "Pass one of --data-path or --prompts, not both."),
        (["--online", "--prompts", "/nonexistent.jsonl"], ("--data-path",),
         "--prompts /nonexistent.jsonl does not exist."),
        (["--online"], ("--data-path",), "--prompts can stand in for it"),
        (["--online"], ("--verifier-name-or-path",), "(--online runs the target inside training)"),
        (["--online-cache", "ram"], (), "--online-cache is used only with --online"),
        (["--online", "--temperature", "0.7"], (), "--temperature is used only with --prompts"),
        (["--online", "--online-cache-gib", "0"], (), "online_cache_gib"),
    ],
)
def test_online_settings_that_cannot_work_are_one_sentence(workdir, tmp_path, extra, drop,
                                                            sentence):
    args = train_args(workdir, tmp_path / "save", "--max-steps", "1", *extra)
    for flag in drop:
        i = args.index(flag)
        del args[i : i + 2]
    line = refusal(*run_cli(args))
    assert sentence in line, line
    assert not (tmp_path / "save").exists()


def test_online_data_without_token_ids_or_with_another_vocabulary_is_one_sentence(
    workdir, tmp_path
):
    no_ids = token_only_data(tmp_path / "no_ids", {"loss_mask": [[0, 1]], "seq_len": [2]})
    other = token_only_data(
        tmp_path / "other", {"input_ids": [[3, 500]], "loss_mask": [[0, 1]], "seq_len": [2]}
    )
    for data, sentence in (
        (no_ids, "lacks the column(s) ['input_ids']"),
        (other, "holds token id 500, outside the target's vocabulary of 96"),
    ):
        args = train_args(workdir, tmp_path / "save", "--online", "--target-layer-ids", "1,2,3")
        args[args.index("--data-path") + 1] = str(data)
        line = refusal(*run_cli(args))
        assert str(data) in line and sentence in line, line
        assert not (tmp_path / "save").exists() or not any((tmp_path / "save").iterdir())


def test_offline_training_on_token_ids_alone_points_to_online(workdir, tmp_path):
    tokens = tmp_path / "tokens"
    shutil.copytree(workdir / "data", tokens, ignore=shutil.ignore_patterns("hidden_states"))
    args = train_args(workdir, tmp_path / "save", "--max-steps", "1")
    args[args.index("--data-path") + 1] = str(tokens)
    line = refusal(*run_cli(args))
    assert "holds token ids but no hidden states" in line and "--online" in line, line
