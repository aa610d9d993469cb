"""The training loop end to end on a tiny local target: the CLI, checkpoints vLLM and
speculators accept, resume after a signal, DDP/FSDP against one process, refusals."""

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers.training import config_for, reference_step, refused, run_cli, train_args
from safetensors.torch import load_file
from tiny import tiny_tokenizer

from speculators_peagle_plugin.model.model_card import portable_path, read_card
from speculators_peagle_plugin.serving.check import check_checkpoint
from speculators_peagle_plugin.training.checkpoint import CHECKPOINT_PREFIX, checkpoint_dirs
from speculators_peagle_plugin.training.loop import build_training
from speculators_peagle_plugin.training.progress import METRICS_FILE


@pytest.fixture(scope="module")
def workdir(tiny_workdir_once, tmp_path_factory):
    """A tiny target (with tokenizer and chat template) and 16 generated samples."""
    return shutil.copytree(tiny_workdir_once, tmp_path_factory.mktemp("loop") / "workdir")


def test_train_writes_a_checkpoint_speculators_and_vllm_accept(workdir, tmp_path):
    from speculators.model import SpeculatorModel
    from speculators.models.peagle import PEagleDraftModel as SpeculatorsPEagle

    code, out = run_cli(
        train_args(workdir, tmp_path, "--max-steps", "5", "--sequence-partitions", "2")
    )
    assert code == 0, out
    final = tmp_path / f"{CHECKPOINT_PREFIX}5"
    assert f"final checkpoint: {final}" in out
    config = json.loads((final / "config.json").read_text())
    assert "model_type" not in config  # vLLM: only speculators_model_type at the top
    assert config["speculators_model_type"] == "peagle"
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert config["mask_token_id"] == len(tiny_tokenizer())  # first row past the tokenizer
    weights = load_file(final / "model.safetensors")
    assert "mask_hidden" in weights and not any(k.startswith("model.") for k in weights)
    loaded = SpeculatorModel.from_pretrained(final, verifier=str(workdir / "target"))
    assert type(loaded) is SpeculatorsPEagle
    assert torch.equal(loaded.mask_hidden.detach(), weights["mask_hidden"])
    front, body = read_card(final)  # the model card: this config, this data, these steps
    assert front["peagle"]["speculative_tokens"] == 3 and "5 optimizer steps" in body
    settings = json.loads((workdir / "data" / "generation_settings.json").read_text())
    assert f"`{portable_path(settings['prompts'])}`" in body  # the card names no local path
    assert f'"model": "{final.name}"' in body and str(tmp_path.parent) not in body
    assert "model-card" not in {f.code for f in check_checkpoint(final, workdir / "target")}
    records = [json.loads(x) for x in (tmp_path / METRICS_FILE).read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    for r in records:
        assert len(r["accuracy_per_depth"]) == 3 and r["tokens"] > 0 and r["loss"] > 0
        assert 0 <= r["data_share"] < 1  # the part of the step waiting for its row
        acc = r["accuracy_per_depth"]  # the estimate: 1 + sum over d of prod(acc[:d + 1])
        want = 1 + sum(math.prod(acc[: d + 1]) for d in range(3))
        assert r["acceptance_length"] == pytest.approx(want, rel=1e-6)


def test_training_lowers_the_loss(workdir, tmp_path):
    code, out = run_cli(train_args(workdir, tmp_path, "--max-steps", "30", "--epochs", "100"))
    assert code == 0, out
    losses = [json.loads(x)["loss"] for x in (tmp_path / METRICS_FILE).read_text().splitlines()]
    assert sum(losses[-5:]) < 0.8 * sum(losses[:5])


def run_subprocess(args, **kw):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "speculators_peagle_plugin", *args],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw,
    )


def final_weights(save):
    return load_file(checkpoint_dirs(Path(save))[-1] / "model.safetensors")


KILLED_RUN = ["--max-steps", "40", "--epochs", "100", "--sequence-partitions", "2"]


@pytest.fixture(scope="module")
def uninterrupted(workdir, tmp_path_factory):
    """The final weights of the run the killed ones resume to, run once for every signal."""
    save = tmp_path_factory.mktemp("straight")
    straight = run_subprocess(train_args(workdir, save, *KILLED_RUN))
    out, _ = straight.communicate(timeout=600)
    assert straight.returncode == 0, out
    return final_weights(save)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_killed_and_resumed_equals_uninterrupted(workdir, uninterrupted, tmp_path, sig):
    killed = run_subprocess(train_args(workdir, tmp_path / "killed", *KILLED_RUN))
    metrics = tmp_path / "killed" / METRICS_FILE
    deadline = time.time() + 300
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        assert killed.poll() is None and time.time() < deadline, killed.stdout.read()
        time.sleep(0.01)
    killed.send_signal(sig)
    out, _ = killed.communicate(timeout=300)
    assert killed.returncode == 128 + sig, out
    assert "run the same command again to resume" in out
    (interrupted,) = checkpoint_dirs(tmp_path / "killed")
    assert 3 <= int(interrupted.name[len(CHECKPOINT_PREFIX) :]) < 40

    resumed = run_subprocess(train_args(workdir, tmp_path / "killed", *KILLED_RUN))
    out, _ = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, out
    a, b = uninterrupted, final_weights(tmp_path / "killed")
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    steps = [json.loads(x)["step"] for x in metrics.read_text().splitlines()]
    assert steps == list(range(1, 41))


@pytest.mark.slow
# every pair of values of the three settings, in four runs
@pytest.mark.parametrize(("partitions", "wrapper", "optimizer"), [
    (1, "ddp", "adamw"), (1, "fsdp", "muon"), (3, "ddp", "muon"), (3, "fsdp", "adamw"),
])
def test_two_ranks_equal_one_process_on_the_global_batch(
    workdir, tmp_path, partitions, wrapper, optimizer
):
    save = tmp_path / "ddp"
    port = 29500 + partitions + 10 * (wrapper == "fsdp") + 20 * (optimizer == "muon")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
        "--master_port", str(port), "-m", "speculators_peagle_plugin",
        *train_args(workdir, save, "--max-steps", "1", "--sequence-partitions", str(partitions)),
        *(["--fsdp"] if wrapper == "fsdp" else []), "--optimizer", optimizer,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    ddp = final_weights(save)
    ref = reference_step(workdir, tmp_path / "ref", partitions, optimizer=optimizer)
    initial = build_training(config_for(workdir, tmp_path / "init")).draft.state_dict()
    changed = 0
    for key, value in ddp.items():
        # AdamW's first step moves each weight by ~lr * g / (|g| + eps): where |g| is near
        # eps, float32 summation order (all-reduce vs one process) shows up to ~1% of lr.
        torch.testing.assert_close(
            value, ref[key], rtol=1e-5, atol=1e-5, msg=lambda m, key=key: f"{key}: {m}"
        )
        changed += not torch.equal(value, initial[key])
    assert changed >= 3  # fc, layer weights, mask_hidden... moved


LEAVES_ITS_GROUP = """
import json, os, sys
import torch.distributed as dist
from speculators_peagle_plugin.training.train_config import TrainConfig
from speculators_peagle_plugin.training.loop import train

config = TrainConfig.from_sources(**json.loads(sys.argv[1]))
save = config.trainer.checkpoints.save_path
# The caller's own group (its own store: a group re-made on the same store can read the
# last one's stale addresses): train() leaves it alone.
rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
store = f"file://{save}-store"
dist.init_process_group("gloo", init_method=store, rank=rank, world_size=size)
train(config.replace(save_path=save + "-given"), progress=False)
assert dist.is_initialized(), "train() destroyed the caller's group"
dist.destroy_process_group()
train(config.replace(fsdp=True, optimizer="muon"), progress=False)  # DTensors keep meshes
assert not dist.is_initialized(), "train() left the group it made alive"
# a gloo worker thread alive at interpreter exit can abort the rank (SIGABRT)
threads = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
assert not [t for t in threads if "gloo" in t], f"gloo threads outlive the run: {threads}"
open(f"{save}-rank{rank}-ok", "w").close()
"""


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads Linux's /proc")
def test_two_ranks_leave_the_process_group_they_made(workdir, tmp_path):
    # A rank exiting with its gloo group alive, or with its worker threads alive, can abort
    # at interpreter exit and fail a finished torchrun job: train() destroys what it made,
    # FSDP2's mesh included.
    script = tmp_path / "leave.py"
    script.write_text(LEAVES_ITS_GROUP)
    config = config_for(workdir, tmp_path / "made", max_steps=1).to_dict()
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
        "--master_port", "29541", str(script), json.dumps(config),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "made-rank0-ok").is_file() and (tmp_path / "made-rank1-ok").is_file()


@pytest.fixture
def spoil(workdir, tmp_path):
    """A copy of the data directory to damage."""
    copy = tmp_path / "data"
    shutil.copytree(workdir / "data", copy)
    return copy


def test_bad_inputs_fail_with_one_sentence_and_no_checkpoint(workdir, tmp_path, spoil):
    save = tmp_path / "out"
    assert "not an existing directory" in refused(workdir, save, tmp_path / "missing")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert str(empty) in refused(workdir, save, empty)
    hs = sorted((spoil / "hidden_states").glob("hs_*.safetensors"))[3]
    hs.write_bytes(hs.read_bytes()[:100])
    assert hs.name in refused(workdir, save, spoil)
    line = refused(workdir, save, workdir / "data", "--mask-token-id", "5")
    assert "mask_token_id 5" in line and "ordinary vocabulary token" in line


class _RunsAProgram:
    """A pickle that runs ``touch MARKER`` when unpickled with weights_only=False."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_crafted_training_state_is_refused_and_runs_nothing(workdir, tmp_path):
    save = tmp_path / "out"
    code, out = run_cli(train_args(workdir, save, "--max-steps", "2"))
    assert code == 0, out
    (checkpoint,) = checkpoint_dirs(save)
    marker = tmp_path / "pwned"
    torch.save({"step": _RunsAProgram(marker)}, checkpoint / "training_state.pt")
    for extra in ([], ["--resume", str(checkpoint)]):
        code, out = run_cli(train_args(workdir, save, "--max-steps", "4", *extra))
        assert code == 1, out
        assert not marker.exists(), "unpickling the training state ran a program"
        line = out.strip().splitlines()[-1]
        assert "training_state.pt is not a training state this program wrote" in line, out
    assert checkpoint_dirs(save) == [checkpoint]


def test_train_runs_a_third_party_algorithm_through_its_own_hooks(
    workdir, tmp_path, third_party_algorithm
):
    code, out = run_cli(
        train_args(workdir, tmp_path, "--max-steps", "2", "--algorithm", third_party_algorithm)
    )
    assert code == 0, out
    assert sys.modules["dummy_drafts"].CALLS == ["dummy"]
    assert len(checkpoint_dirs(tmp_path)) == 1
