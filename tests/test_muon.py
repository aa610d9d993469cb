"""``--optimizer muon`` as speculators 0.9.0 has it: its split of the weights (against its own
``split_named_params_for_muon``), two steps against ``torch.optim.Muon`` and AdamW run
directly, the schedule over both, checkpoints that resume exactly (after SIGKILL too, and
under FSDP2), the refusal to resume with the other optimizer, and speculators' own run.yaml."""

import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch
import yaml
from helpers.kills import Forker, kill_times, seconds_until
from helpers.training import DRAFT_VOCAB, config_for, refusal, run_cli, train_args
from safetensors.torch import load_file
from speculators.train.config.artifacts import dump_yaml
from speculators.train.config.schema import TrainConfig as SpeculatorsConfig
from speculators.train.optimizers import split_named_params_for_muon

from speculators_peagle_plugin.common import devices
from speculators_peagle_plugin.common.reading import load_plain_torch
from speculators_peagle_plugin.training.checkpoint import STATE_FILE, checkpoint_dirs
from speculators_peagle_plugin.training.loop import build_training
from speculators_peagle_plugin.training.optim import OptimizerConfig, muon_split, newton_schulz
from speculators_peagle_plugin.training.train_config import TrainConfig

MUON_KEYS = ("optimizer", "muon_lr", "muon_momentum", "muon_weight_decay", "muon_ns_steps",
             "muon_adjust_lr_fn")


@pytest.fixture(scope="module")
def workdir(tiny_workdir_once, tmp_path_factory):
    return shutil.copytree(tiny_workdir_once, tmp_path_factory.mktemp("muon") / "workdir")


def names(pairs) -> list[str]:
    return [name for name, _ in pairs]


@pytest.mark.parametrize("embed", [False, True])
def test_the_split_is_speculators_own_on_our_draft(workdir, tmp_path, embed):
    config = config_for(workdir, tmp_path, optimizer="muon", num_layers=2, max_steps=1,
                        embed_requires_grad=embed)
    setup = build_training(config)
    for model in (setup.draft, setup.wrapped):  # bare, and inside the trainer's wrapper
        ours, theirs = muon_split(model.named_parameters()), split_named_params_for_muon(model)
        assert (names(ours[0]), names(ours[1])) == (names(theirs[0]), names(theirs[1]))
    muon, adamw = (set(names(part)) for part in muon_split(setup.draft.named_parameters()))
    assert {"fc.weight", "layers.1.mlp.down_proj.weight"} <= muon
    assert {"mask_hidden", "norm.weight"} <= adamw and "lm_head.weight" not in muon | adamw
    assert ("embed_tokens.weight" in adamw) is embed  # a 2-D weight Muon leaves to AdamW
    # the optimizers hold exactly these weights, Muon first as in speculators
    theirs = split_named_params_for_muon(setup.wrapped)
    held = [[id(p) for group in o.param_groups for p in group["params"]] for o in setup.optimizers]
    assert [type(o).__name__ for o in setup.optimizers] == ["Muon", "AdamW"]
    assert held == [[id(p) for _, p in part] for part in theirs]


def test_two_steps_are_torch_muon_on_the_matrices_and_adamw_on_the_rest(workdir, tmp_path):
    mine = {"optimizer": "muon", "lr": 0.01, "weight_decay": 0.02, "muon_lr": 0.05,
            "muon_momentum": 0.9, "muon_weight_decay": 0.2, "muon_ns_steps": 3,
            "muon_adjust_lr_fn": "original"}
    setup = build_training(config_for(workdir, tmp_path, max_steps=2, **mine))
    setup.optimizers[0].ns_dtype = torch.bfloat16  # torch's, whatever this CPU would pick
    params = dict(setup.draft.named_parameters())
    muon_names, adamw_names = (names(p) for p in split_named_params_for_muon(setup.draft))
    copies = {n: torch.nn.Parameter(p.detach().clone()) for n, p in params.items()}
    initial = {n: p.detach().clone() for n, p in params.items()}
    oracle = [
        torch.optim.Muon([copies[n] for n in muon_names], lr=0.05, momentum=0.9,
                         weight_decay=0.2, ns_steps=3, adjust_lr_fn="original"),
        torch.optim.AdamW([copies[n] for n in adamw_names], lr=0.01, weight_decay=0.02),
    ]
    gen = torch.Generator().manual_seed(0)
    for step in range(2):
        for name in muon_names + adamw_names:
            params[name].grad = torch.randn(params[name].shape, generator=gen)
            copies[name].grad = params[name].grad.clone()
        setup.optimizers.step()
        for o in oracle:
            o.step()
        setup.schedulers.step()
        # a linear schedule over 2 steps: each optimizer at half its own rate for step 2
        assert setup.optimizers.learning_rates() == pytest.approx(
            {"muon_lr": 0.05 * (1 - (step + 1) / 2), "lr": 0.01 * (1 - (step + 1) / 2)}
        )
        for o, base in zip(oracle, (0.05, 0.01), strict=True):
            o.param_groups[0]["lr"] = base * (1 - (step + 1) / 2)
    for name in muon_names + adamw_names:
        moved = params[name].detach()
        assert not torch.equal(moved, initial[name]), name
        torch.testing.assert_close(moved, copies[name].detach(), msg=name)


COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # torch.optim.Muon's default


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_newton_schulz_in_bfloat16_is_torchs_and_in_float32_the_float64_iteration(seed):
    from torch.optim._muon import _zeropower_via_newtonschulz

    gen = torch.Generator().manual_seed(seed)
    for shape in [(37, 11), (11, 37), (24, 24)]:  # tall, wide, square
        grad = torch.randn(shape, generator=gen)
        kept = grad.clone()
        theirs = _zeropower_via_newtonschulz(grad, COEFFICIENTS, 5, 1e-7)
        assert torch.equal(newton_schulz(grad, COEFFICIENTS, 5, 1e-7), theirs)
        single = newton_schulz(grad, COEFFICIENTS, 5, 1e-7, torch.float32)
        double = newton_schulz(grad.double(), COEFFICIENTS, 5, 1e-7, torch.float64)
        assert single.dtype == torch.float32 and single.shape == shape
        torch.testing.assert_close(single.double(), double, rtol=1e-4, atol=1e-5)
        # orthogonalized: singular values near 1 (the quintic leaves them in about 0.5-1.5)
        values = torch.linalg.svdvals(double)
        assert values.min() > 0.3 and values.max() < 1.5, values
        assert torch.equal(grad, kept)  # the momentum buffer it reads stays as it was


@pytest.mark.parametrize("native", [True, False])
def test_muon_iterates_in_float32_on_a_cpu_that_emulates_bfloat16(workdir, tmp_path,
                                                                  monkeypatch, native):
    monkeypatch.setattr(devices, "cpu_has_bfloat16", lambda: native)
    setup = build_training(config_for(workdir, tmp_path, optimizer="muon", max_steps=1))
    want = torch.bfloat16 if native else torch.float32
    assert setup.optimizers[0].ns_dtype == want
    assert devices.low_precision_dtype(torch.device("cpu")) == want
    assert devices.low_precision_dtype(torch.device("meta")) == torch.bfloat16  # not a CPU


def test_muon_lr_falls_back_to_lr(workdir, tmp_path):
    setup = build_training(config_for(workdir, tmp_path, optimizer="muon", lr=0.003, max_steps=1))
    assert setup.optimizers.learning_rates() == {"muon_lr": 0.003, "lr": 0.003}
    group = setup.optimizers[0].param_groups[0]
    theirs = SpeculatorsConfig.from_flat({"speculator_type": "peagle"}).optimizer
    assert (group["momentum"], group["weight_decay"], group["ns_steps"], group["adjust_lr_fn"]) == (
        theirs.muon_momentum, theirs.muon_weight_decay, theirs.muon_ns_steps,
        theirs.muon_adjust_lr_fn,
    )
    adamw = build_training(config_for(workdir, tmp_path / "a", optimizer="adamw",
                                      max_steps=1)).optimizers
    assert [type(o).__name__ for o in adamw] == ["AdamW"] and adamw[0].defaults["fused"]


def test_the_default_optimizer_is_speculators_muon():
    theirs = SpeculatorsConfig.from_flat({"speculator_type": "peagle"}).optimizer
    ours = OptimizerConfig()
    assert ours.optimizer == theirs.optimizer == "muon"
    assert (ours.lr, ours.resolved_muon_lr) == (theirs.lr, theirs.lr)  # muon_lr unset: lr


def muon_args(workdir, save, *extra):
    return train_args(workdir, save, "--optimizer", "muon", "--muon-lr", "0.02", *extra)


def weights_and_optimizer(checkpoint):
    """The checkpoint's weights and every tensor of its optimizers' state, read as resuming
    reads them (``weights_only``)."""
    state = load_plain_torch(checkpoint / STATE_FILE, "a training state")
    tensors = {}

    def walk(prefix, value):
        if isinstance(value, torch.Tensor):
            tensors[prefix] = value
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}/{k}", v)
        elif isinstance(value, list):
            for i, v in enumerate(value):
                walk(f"{prefix}/{i}", v)

    walk("optimizer", state["optimizer"])
    return load_file(checkpoint / "model.safetensors"), tensors, state


def assert_same(a: dict, b: dict):
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_a_resumed_muon_run_ends_with_the_uninterrupted_runs_weights_and_state(workdir, tmp_path):
    steps = ("--max-steps", "4", "--checkpoint-freq", "0.01", "--keep-checkpoints", "4")
    code, out = run_cli(muon_args(workdir, tmp_path / "whole", *steps))
    assert code == 0, out
    weights, optim, state = weights_and_optimizer(tmp_path / "whole" / "checkpoint-4")
    muon_state, adamw_state = state["optimizer"]  # both optimizers, Muon first
    assert muon_state["param_groups"][0]["ns_steps"] == 5 and len(state["scheduler"]) == 2
    assert all("momentum_buffer" in s for s in muon_state["state"].values())
    assert all("exp_avg_sq" in s for s in adamw_state["state"].values())
    log = (tmp_path / "whole" / "metrics.jsonl").read_text()
    records = [json.loads(x) for x in log.splitlines()]
    assert records[0]["muon_lr"] == pytest.approx(0.02 * 3 / 4)  # the schedule drives both
    assert records[0]["lr"] == pytest.approx(0.01 * 3 / 4)
    card = (tmp_path / "whole" / "checkpoint-4" / "README.md").read_text()
    assert "optimizer=muon, lr=0.01, muon_lr=0.02," in card  # the recipe the card states

    (tmp_path / "part").mkdir()
    shutil.copytree(tmp_path / "whole" / "checkpoint-2", tmp_path / "part" / "checkpoint-2")
    code, out = run_cli(muon_args(workdir, tmp_path / "part", *steps))
    assert code == 0, out
    resumed, resumed_optim, _ = weights_and_optimizer(tmp_path / "part" / "checkpoint-4")
    assert_same(resumed, weights)
    assert_same(resumed_optim, optim)


def test_resuming_with_the_other_optimizer_is_one_sentence(workdir, tmp_path):
    save = tmp_path / "muon"
    code, out = run_cli(muon_args(workdir, save, "--max-steps", "1"))
    assert code == 0, out
    line = refusal(*run_cli(train_args(workdir, save, "--max-steps", "2")))
    assert line == (
        f"Error: Cannot resume from {save / 'checkpoint-1'}: it was trained with different "
        "muon_lr, optimizer; to resume, run with the settings it was trained with (to start "
        "over instead, use a new --save-path)."
    )
    # an AdamW checkpoint of before --optimizer existed (its config lacks the keys)
    save = tmp_path / "adamw"
    code, out = run_cli(train_args(workdir, save, "--max-steps", "1"))
    assert code == 0, out
    path = save / "checkpoint-1" / STATE_FILE
    state = torch.load(path, weights_only=True)
    for key in MUON_KEYS:
        del state["config"][key]
    torch.save(state, path)
    line = refusal(*run_cli(train_args(workdir, save, "--max-steps", "2", "--optimizer", "muon")))
    assert "it was trained with different optimizer;" in line
    code, out = run_cli(train_args(workdir, save, "--max-steps", "2"))
    assert code == 0, out
    assert (save / "checkpoint-2").is_dir()


def test_speculators_run_yaml_with_its_defaults_trains_with_muon(workdir, tmp_path):
    """The run.yaml ``speculators train --optimizer muon`` writes: speculators' defaults
    everywhere else (muon's included), the keys a user passes, the tiny work directory's
    data (made by generate-data, as the demo's is)."""
    cli = {"speculator_type": "peagle", "verifier_name_or_path": str(workdir / "target"),
           "data_path": str(workdir / "data"), "save_path": str(tmp_path / "save"),
           "draft_vocab_size": DRAFT_VOCAB, "max_steps": 3, "logger": ""}
    theirs = SpeculatorsConfig.from_sources(cli={**cli, "optimizer": "muon"}, argv=["train"])
    text = dump_yaml(theirs)
    assert "optimizer:\n    optimizer: muon\n" in text and "muon_lr" not in text
    path = tmp_path / "run.yaml"
    path.write_text(text)
    ours = TrainConfig.from_sources(path).optimizer
    want = theirs.optimizer
    assert (ours.optimizer, ours.lr, ours.weight_decay, ours.resolved_muon_lr) == (
        "muon", want.lr, want.weight_decay, want.muon_lr)
    assert (ours.muon_momentum, ours.muon_weight_decay, ours.muon_ns_steps,
            ours.muon_adjust_lr_fn) == (want.muon_momentum, want.muon_weight_decay,
                                        want.muon_ns_steps, want.muon_adjust_lr_fn)
    code, out = run_cli(["train", "--config", str(path)])
    assert code == 0, out
    checkpoint = checkpoint_dirs(tmp_path / "save")[-1]
    kinds = [set(s["param_groups"][0]) for s in weights_and_optimizer(checkpoint)[2]["optimizer"]]
    assert "ns_steps" in kinds[0] and "amsgrad" in kinds[1]
    # a file that leaves the optimizer out (speculators' default) gets ours, the same: muon
    plain = yaml.safe_load(dump_yaml(SpeculatorsConfig.from_sources(cli=cli, argv=["train"])))
    assert "optimizer" not in plain["train"]
    path.write_text(yaml.safe_dump(plain))
    assert TrainConfig.from_sources(path).optimizer.optimizer == "muon"


@pytest.mark.slow
def test_a_muon_run_killed_at_random_points_resumes_to_the_same_weights(workdir, tmp_path):
    """SIGKILL at seeded points of a run (a checkpoint every step, all kept); the same command then
    ends with the uninterrupted run's checkpoints, weights and optimizer state alike."""
    steps = ("--max-steps", "8", "--checkpoint-freq", "0.01", "--keep-checkpoints", "8")
    kills = 5
    with Forker() as forker:
        # the faster of two whole runs sets the clock (a first run on a loaded machine can
        # take many times longer); each kill falls a seeded time after the run's first
        # checkpoint appears, within its remaining run
        runs = []
        for name in ("whole", "again"):
            run = forker.run(muon_args(workdir, tmp_path / name, *steps), tmp_path / "w.log")
            assert run["rc"] == 0, (tmp_path / "w.log").read_text()[-3000:]
            first = seconds_until(checkpoint_dirs(tmp_path / name)[0], run, time.time())
            runs.append((run["seconds"], first))
        seconds, first = min(runs)
        want = weights_and_optimizer(tmp_path / "whole" / "checkpoint-8")[:2]
        resumed = 0
        for i, at in enumerate(kill_times(60, kills, seconds - first)):
            save, log = tmp_path / f"killed-{i}", tmp_path / f"{i}.log"
            killed = forker.run(muon_args(workdir, save, *steps), log, kill_after=at,
                                once=save / "checkpoint-1")["killed"]
            resumed += killed and bool(checkpoint_dirs(save))  # the rerun resumes mid-run
            rerun = forker.run(muon_args(workdir, save, *steps), log)
            assert rerun["rc"] == 0, log.read_text()[-3000:]
            got = weights_and_optimizer(save / "checkpoint-8")[:2]
            assert_same(got[0], want[0])
            assert_same(got[1], want[1])
    print(f"{resumed} of {kills} runs killed after a checkpoint ({first:.2f} s of {seconds:.2f} s)")
    assert resumed >= 1, f"no kill of {kills} came after a checkpoint and before the end"


@pytest.mark.slow
def test_fsdp2_muon_resumes_to_the_uninterrupted_runs_weights(workdir, tmp_path):
    """Two ranks under FSDP2 (gloo): Muon's state gathered into the checkpoint, and set back
    into the sharded optimizers on resumption, exactly."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    steps = ("--max-steps", "2", "--checkpoint-freq", "0.01", "--fsdp")

    def torchrun(save):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
               "--master_port", "29561", "-m", "speculators_peagle_plugin",
               *muon_args(workdir, save, *steps)]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout + done.stderr

    torchrun(tmp_path / "whole")
    (tmp_path / "part").mkdir()
    shutil.copytree(tmp_path / "whole" / "checkpoint-1", tmp_path / "part" / "checkpoint-1")
    torchrun(tmp_path / "part")
    want = weights_and_optimizer(tmp_path / "whole" / "checkpoint-2")
    got = weights_and_optimizer(tmp_path / "part" / "checkpoint-2")
    assert_same(got[0], want[0])
    assert_same(got[1], want[1])
    assert any("momentum_buffer" in k for k in want[1])  # Muon's state is in the checkpoint
