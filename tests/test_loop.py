"""The training loop end to end on a tiny local target: CLI, checkpoints, resume, DDP."""

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers.training import DRAFT_VOCAB, config_for, reference_step, run_cli, train_args
from safetensors.torch import load_file, save_file
from tiny import tiny_tokenizer, tiny_workdir
from torch.utils._python_dispatch import TorchDispatchMode

from speculators_peagle_plugin.training.checkpoint import CHECKPOINT_PREFIX, checkpoint_dirs
from speculators_peagle_plugin.training.loop import build_training
from speculators_peagle_plugin.training.progress import METRICS_FILE
from speculators_peagle_plugin.training.step import train_step

REPO = Path(__file__).parent.parent


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A tiny target (with tokenizer and chat template) and 16 generated samples."""
    return tiny_workdir(tmp_path_factory.mktemp("loop"), DRAFT_VOCAB)


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
    records = [json.loads(x) for x in (tmp_path / METRICS_FILE).read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    for r in records:
        assert len(r["accuracy_per_depth"]) == 3 and r["tokens"] > 0 and r["loss"] > 0
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
    )  # fmt: skip


def final_weights(save):
    return load_file(checkpoint_dirs(Path(save))[-1] / "model.safetensors")


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_killed_and_resumed_equals_uninterrupted(workdir, tmp_path, sig):
    args = ["--max-steps", "40", "--epochs", "100", "--sequence-partitions", "2"]
    straight = run_subprocess(train_args(workdir, tmp_path / "straight", *args))
    out, _ = straight.communicate(timeout=600)
    assert straight.returncode == 0, out

    killed = run_subprocess(train_args(workdir, tmp_path / "killed", *args))
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

    resumed = run_subprocess(train_args(workdir, tmp_path / "killed", *args))
    out, _ = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, out
    a, b = final_weights(tmp_path / "straight"), final_weights(tmp_path / "killed")
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    steps = [json.loads(x)["step"] for x in metrics.read_text().splitlines()]
    assert steps == list(range(1, 41))


@pytest.mark.slow
@pytest.mark.parametrize(("partitions", "wrapper"), [(1, "ddp"), (3, "ddp"), (3, "fsdp")])
def test_two_ranks_equal_one_process_on_the_global_batch(workdir, tmp_path, partitions, wrapper):
    save = tmp_path / "ddp"
    port = 29500 + partitions + 10 * (wrapper == "fsdp")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
        "--master_port", str(port), "-m", "speculators_peagle_plugin",
        *train_args(workdir, save, "--max-steps", "1", "--sequence-partitions", str(partitions)),
        *(["--fsdp"] if wrapper == "fsdp" else []),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    ddp = final_weights(save)
    ref = reference_step(workdir, tmp_path / "ref", partitions)
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


@pytest.fixture
def spoil(workdir, tmp_path):
    """A copy of the data directory to damage."""
    copy = tmp_path / "data"
    shutil.copytree(workdir / "data", copy)
    return copy


def refused(workdir, save, data, *extra):
    args = train_args(workdir, save, "--max-steps", "1", *extra)
    args[args.index("--data-path") + 1] = str(data)
    code, out = run_cli(args)
    assert code == 1, out
    assert not save.exists() or not any(save.iterdir()), "a partial checkpoint was left"
    return out.strip().splitlines()[-1]


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


class _MatmulDtypes(TorchDispatchMode):
    """Records the dtype of every aten matmul (after autocast has chosen it)."""

    NAMES = ("aten.mm", "aten.addmm", "aten.bmm")

    def __init__(self):
        super().__init__()
        self.seen = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if name in self.NAMES:
            self.seen.setdefault(name, set()).add(args[-2].dtype)
        return func(*args, **(kwargs or {}))


def one_step(workdir, save, **kw):
    """A partitioned step's loss and gradients, and the matmul dtypes it used."""
    config = config_for(workdir, save, sequence_partitions=2, **kw)
    setup = build_training(config)
    batch = setup.batches.batch(0, 0)
    with _MatmulDtypes() as seen:
        stats = train_step(setup.wrapped, setup.module, batch, config, setup.world, 0)
    grads = {n: p.grad for n, p in setup.draft.named_parameters() if p.grad is not None}
    assert all(p.dtype == torch.float32 for p in setup.draft.parameters())
    return float(stats["loss_sum"] / stats["total_den"]), grads, seen.seen


def test_autocast_bfloat16_keeps_float32_weights_and_tracks_the_float32_step(workdir, tmp_path):
    loss32, grads32, seen32 = one_step(workdir, tmp_path / "a")
    loss16, grads16, seen16 = one_step(workdir, tmp_path / "b", autocast="bfloat16")
    assert seen32 == {"aten.mm": {torch.float32}, "aten.bmm": {torch.float32}}, seen32
    # every projection, MLP and lm_head product in bfloat16; attention backward, norms float32
    assert seen16["aten.mm"] == {torch.bfloat16} and torch.float32 in seen16["aten.bmm"], seen16
    assert loss16 != loss32 and abs(loss16 - loss32) < 0.01 * loss32
    assert grads16.keys() == grads32.keys() and len(grads32) > 5
    for name, g in grads16.items():
        assert g.dtype == torch.float32, name
        cosine = torch.nn.functional.cosine_similarity(g.flatten(), grads32[name].flatten(), 0)
        assert cosine > 0.99, (name, float(cosine))
    with pytest.raises(ValueError, match="autocast bfloat16 keeps float32 weights"):
        config_for(workdir, tmp_path / "c", autocast="bfloat16", dtype="bfloat16")


def test_autocast_on_cpu_caps_onednn_primitive_cache_unless_set(workdir, tmp_path, monkeypatch):
    key = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"
    monkeypatch.delenv(key, raising=False)
    build_training(config_for(workdir, tmp_path / "a"))
    assert key not in os.environ  # float32: oneDNN's default
    build_training(config_for(workdir, tmp_path / "b", autocast="bfloat16"))
    assert os.environ[key] == "128"
    monkeypatch.setenv(key, "7")
    build_training(config_for(workdir, tmp_path / "c", autocast="bfloat16"))
    assert os.environ[key] == "7"


def test_num_key_value_heads_shapes_the_draft_and_speculators_loads_it(workdir, tmp_path):
    from speculators.model import SpeculatorModel

    code, out = run_cli(train_args(workdir, tmp_path, "--max-steps", "1",
                                   "--num-key-value-heads", "4"))  # fmt: skip
    assert code == 0, out
    final = tmp_path / f"{CHECKPOINT_PREFIX}1"
    layer = json.loads((final / "config.json").read_text())["transformer_layer_config"]
    assert layer["num_key_value_heads"] == 4 and layer["num_attention_heads"] == 4
    weights = load_file(final / "model.safetensors")
    k_proj = next(v for k, v in weights.items() if k.endswith("k_proj.weight"))
    assert k_proj.shape[0] == 4 * layer["head_dim"]  # the verifier has 2 kv heads
    loaded = SpeculatorModel.from_pretrained(final, verifier=str(workdir / "target"))
    assert torch.equal(loaded.state_dict()["layers.0.self_attn.k_proj.weight"], k_proj)
    line = refused(workdir, tmp_path / "bad", workdir / "data", "--num-key-value-heads", "3")
    assert "num_key_value_heads must divide the draft's 4 attention heads, got 3" in line


def test_more_depths_trained_than_served_and_a_hard_label_loss(workdir, tmp_path):
    """--num-depths 3 --num-speculative-tokens 2: three depths trained, K=2 declared for
    vLLM, the trained depths kept for check; --hard-label-weight changes the loss only."""
    from speculators.model import SpeculatorModel

    from speculators_peagle_plugin.serving.check import check_checkpoint

    def first_loss(save):
        return json.loads((save / METRICS_FILE).read_text().splitlines()[0])["loss"]

    args = ("--max-steps", "2", "--num-speculative-tokens", "2")
    code, out = run_cli(train_args(workdir, tmp_path / "kl", *args))
    assert code == 0, out
    code, out = run_cli(train_args(workdir, tmp_path / "hard", *args, "--hard-label-weight", "0.5"))
    assert code == 0, out
    final = tmp_path / "hard" / f"{CHECKPOINT_PREFIX}2"
    config = json.loads((final / "config.json").read_text())
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 2
    assert config["num_depths"] == 3
    record = json.loads((tmp_path / "hard" / METRICS_FILE).read_text().splitlines()[0])
    assert len(record["accuracy_per_depth"]) == 3
    assert first_loss(tmp_path / "hard") != pytest.approx(first_loss(tmp_path / "kl"), rel=1e-3)
    SpeculatorModel.from_pretrained(final, verifier=str(workdir / "target"))  # still loads

    def depth_warnings(k):
        findings = check_checkpoint(final, workdir / "target", num_speculative_tokens=k,
                                    device="any", scan_values=False)  # fmt: skip
        return [f for f in findings if f.code == "depth"]

    assert depth_warnings(3) == [] and len(depth_warnings(4)) == 1
    assert "past the 3 depths" in depth_warnings(4)[0].message
    module = build_training(config_for(workdir, tmp_path / "knobs", hard_label_weight=0.25,
                                       tv_weight=0.75)).module  # fmt: skip
    assert (module.hard_label_weight, module.tv_weight) == (0.25, 0.75)


def test_heldout_metrics_are_exact_under_partitioning_and_follow_training(workdir, tmp_path):
    """Held-out figures: every supervised position counted once at depth 0, the same with
    1 or 3 segments (partitioning is exact), repeatable, and better after training."""
    from speculators_peagle_plugin.data import open_training_data
    from speculators_peagle_plugin.training.heldout import heldout_metrics

    for steps in ("1", "20"):
        code, out = run_cli(train_args(workdir, tmp_path / steps, "--max-steps", steps,
                                       "--epochs", "100"))  # fmt: skip
        assert code == 0, out
    config = config_for(workdir, tmp_path / "unused")
    early, late = (checkpoint_dirs(tmp_path / s)[-1] for s in ("1", "20"))
    flat = heldout_metrics(late, config, workdir / "data", seed=5)
    split = heldout_metrics(late, replace(config, sequence_partitions=3), workdir / "data", seed=5)
    assert flat["supervised"] == split["supervised"]
    assert flat["accuracy_per_depth"] == pytest.approx(split["accuracy_per_depth"], abs=1e-12)
    assert flat["loss"] == pytest.approx(split["loss"], rel=1e-5)
    assert heldout_metrics(late, config, workdir / "data", seed=5) == flat
    data = open_training_data(workdir / "data", draft_vocab_size=DRAFT_VOCAB)
    assert flat["supervised"][0] == data.num_loss_tokens
    assert flat["supervised"][0] > flat["supervised"][1] > flat["supervised"][2] > 0
    before = heldout_metrics(early, config, workdir / "data", seed=5)
    assert flat["loss"] < 0.9 * before["loss"]
    assert flat["acceptance_length"] > before["acceptance_length"]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_draft_init_verifier_starts_the_draft_as_the_verifier_layer_after_the_deepest_aux(
    workdir, tmp_path, seed
):
    from transformers import AutoTokenizer, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import repeat_kv

    # the tiny target with norms that are not all ones, so copying them is seen
    gen = torch.Generator().manual_seed(seed)
    target = LlamaForCausalLM.from_pretrained(workdir / "target")
    with torch.no_grad():
        for name, p in target.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5, generator=gen)
    target.save_pretrained(tmp_path / "target")
    AutoTokenizer.from_pretrained(workdir / "target").save_pretrained(tmp_path / "target")
    # the data's aux ids are (1, 2, 3): draft layer 0 starts as verifier layer 3, and
    # 4 key/value heads over the verifier's 2 serve the query heads the verifier's did
    kw = {"num_key_value_heads": 4, "seed": 3 + seed,
          "verifier_name_or_path": str(tmp_path / "target")}  # fmt: skip
    made = {init: build_training(config_for(workdir, tmp_path / init, draft_init=init, **kw))
            for init in ("verifier", "random")}  # fmt: skip
    draft, plain = made["verifier"].draft, made["random"].draft
    verifier = target.model.layers[3]
    ours, attn, theirs = draft.layers[0], draft.layers[0].self_attn, verifier.self_attn
    n = int(torch.randint(3, 17, (1,), generator=gen))
    x, aux = torch.randn(n, 64, generator=gen), torch.randn(n, 3 * 64, generator=gen)
    cat = torch.cat([torch.zeros_like(x), x], dim=-1)  # [embeds, hidden]: the hidden half
    heads = lambda t, h: t.view(1, n, h, 16).transpose(1, 2)  # noqa: E731  [1, h, n, 16]
    with torch.no_grad():
        assert torch.equal(draft.fc(aux), aux[:, 128:])  # the deepest aux (id 3) passes
        assert torch.allclose(attn.q_proj(cat), theirs.q_proj(x), atol=1e-6)
        for proj in ("k_proj", "v_proj"):
            expected = repeat_kv(heads(getattr(theirs, proj)(x), 2), 2)
            assert torch.allclose(heads(getattr(attn, proj)(cat), 4), expected, atol=1e-6)
        assert torch.equal(attn.o_proj(x), theirs.o_proj(x))
        assert torch.equal(ours.mlp(x), verifier.mlp(x))
        assert torch.equal(ours.hidden_norm(x), verifier.input_layernorm(x))
        assert torch.equal(ours.post_attention_layernorm(x), verifier.post_attention_layernorm(x))
    # what the verifier does not supply keeps speculators' start: the embedding half of
    # q/k/v, the embedding-side norm, the embedding and the heads
    for name, value in plain.state_dict().items():
        mine = draft.state_dict()[name]
        if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")):
            assert torch.equal(mine[:, :64], value[:, :64]), name
        elif not name.startswith(("fc.", "layers.0.mlp", "layers.0.self_attn.o_proj",
                                  "layers.0.hidden_norm", "layers.0.post_attention")):  # fmt: skip
            assert torch.equal(mine, value), name


def test_draft_init_verifier_refuses_what_it_cannot_copy(workdir, tmp_path):
    line = refused(workdir, tmp_path / "a", workdir / "data", "--draft-init", "verifier",
                   "--num-layers", "2")  # fmt: skip
    assert "copies verifier layers 3..4 (after aux id 3)" in line and "layers.4" in line, line
    line = refused(workdir, tmp_path / "b", workdir / "data", "--draft-init", "verifier",
                   "--num-key-value-heads", "1")  # fmt: skip
    assert "k_proj heads (1) to be a multiple of the verifier's (2)" in line, line
    # a verifier whose layer lacks a tensor the copy needs is refused, not half-copied
    partial = tmp_path / "partial"
    shutil.copytree(workdir / "target", partial)
    weights = load_file(partial / "model.safetensors")
    del weights["model.layers.3.self_attn.o_proj.weight"]
    save_file(weights, partial / "model.safetensors", metadata={"format": "pt"})
    args = train_args(workdir, tmp_path / "d", "--max-steps", "1", "--draft-init", "verifier")
    args[args.index("--verifier-name-or-path") + 1] = str(partial)
    code, out = run_cli(args)
    assert code == 1 and "has no layers.3.self_attn.o_proj.weight" in out, out
    code, out = run_cli(train_args(workdir, tmp_path / "c", "--max-steps", "2",
                                   "--draft-init", "verifier"))  # fmt: skip
    assert code == 0, out


def test_a_verifier_of_another_hidden_size_is_refused(workdir, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    other = tmp_path / "other"
    LlamaForCausalLM(
        LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=2,
                    num_key_value_heads=1, head_dim=16, num_hidden_layers=4, vocab_size=96)
    ).save_pretrained(other)  # fmt: skip
    tiny_tokenizer().save_pretrained(other)
    args = train_args(workdir, tmp_path / "out", "--max-steps", "1")
    args[args.index("--verifier-name-or-path") + 1] = str(other)
    code, out = run_cli(args)
    assert code == 1 and "hidden" in out.splitlines()[-1], out


def test_train_runs_a_third_party_algorithm_through_its_own_hooks(
    workdir, tmp_path, third_party_algorithm
):
    code, out = run_cli(
        train_args(workdir, tmp_path, "--max-steps", "2", "--algorithm", third_party_algorithm)
    )
    assert code == 0, out
    assert sys.modules["dummy_drafts"].CALLS == ["dummy"]
    assert len(checkpoint_dirs(tmp_path)) == 1
