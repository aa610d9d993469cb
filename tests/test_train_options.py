"""Training options end to end on a tiny local target: autocast, key/value heads, more
depths trained than served, hard labels, held-out metrics, a draft started from the
verifier, and a verifier the data does not fit."""

import json
import logging
import os
import shutil

import pytest
import torch
from helpers.training import DRAFT_VOCAB, config_for, refused, run_cli, train_args
from safetensors.torch import load_file, save_file
from tiny import tiny_tokenizer
from torch.utils._python_dispatch import TorchDispatchMode

from speculators_peagle_plugin.training.checkpoint import CHECKPOINT_PREFIX, checkpoint_dirs
from speculators_peagle_plugin.training.loop import build_training
from speculators_peagle_plugin.training.progress import METRICS_FILE
from speculators_peagle_plugin.training.step import train_step


@pytest.fixture(scope="module")
def workdir(tiny_workdir_once, tmp_path_factory):
    """A tiny target (with tokenizer and chat template) and 16 generated samples."""
    return shutil.copytree(tiny_workdir_once, tmp_path_factory.mktemp("options") / "workdir")


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


@pytest.mark.parametrize("native", [False, True])
def test_autocast_on_a_cpu_without_native_bfloat16_warns_once(
    workdir, tmp_path, monkeypatch, caplog, native
):
    """Emulated bfloat16 trains many times slower than float32: the run says so at its start
    and names the flag; float32 runs, and CPUs that multiply bfloat16, hear nothing."""
    from speculators_peagle_plugin.training import loop

    monkeypatch.setattr(loop, "cpu_has_bfloat16", lambda: native)
    with caplog.at_level(logging.WARNING, logger=loop.__name__):
        build_training(config_for(workdir, tmp_path / "a"))
        build_training(config_for(workdir, tmp_path / "b", autocast="bfloat16"))
    warned = [r.getMessage() for r in caplog.records if "native bfloat16" in r.getMessage()]
    assert warned == ([] if native else [loop.EMULATED_AUTOCAST])
    assert "--autocast none" in loop.EMULATED_AUTOCAST


def test_num_key_value_heads_shapes_the_draft_and_speculators_loads_it(workdir, tmp_path):
    from speculators.model import SpeculatorModel

    code, out = run_cli(train_args(workdir, tmp_path, "--max-steps", "1",
                                   "--num-key-value-heads", "4"))
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
                                    device="any", scan_values=False)
        return [f for f in findings if f.code == "depth"]

    assert depth_warnings(3) == [] and len(depth_warnings(4)) == 1
    assert "past the 3 depths" in depth_warnings(4)[0].message
    module = build_training(config_for(workdir, tmp_path / "knobs", hard_label_weight=0.25,
                                       tv_weight=0.75, greedy_chains=True)).module
    loss, greedy = module.loss_config, module.peagle.greedy_chains
    assert (loss.hard_label_weight, loss.tv_weight, greedy) == (0.25, 0.75, True)
    assert not build_training(config_for(workdir, tmp_path / "plain")).module.peagle.greedy_chains


def test_heldout_metrics_are_exact_under_partitioning_and_follow_training(workdir, tmp_path):
    """Held-out figures: every supervised position counted once at depth 0, the same with
    1 or 3 segments (partitioning is exact), repeatable, and better after training."""
    from speculators_peagle_plugin.data import open_training_data
    from speculators_peagle_plugin.training.heldout import heldout_metrics

    for steps in ("1", "20"):
        code, out = run_cli(train_args(workdir, tmp_path / steps, "--max-steps", steps,
                                       "--epochs", "100"))
        assert code == 0, out
    config = config_for(workdir, tmp_path / "unused")
    early, late = (checkpoint_dirs(tmp_path / s)[-1] for s in ("1", "20"))
    flat = heldout_metrics(late, config, workdir / "data", seed=5)
    split = heldout_metrics(late, config.replace(sequence_partitions=3), workdir / "data", seed=5)
    assert flat["supervised"] == split["supervised"]
    assert flat["accuracy_per_depth"] == pytest.approx(split["accuracy_per_depth"], abs=1e-12)
    assert flat["loss"] == pytest.approx(split["loss"], rel=1e-5)
    assert heldout_metrics(late, config, workdir / "data", seed=5) == flat
    # a recipe that trained on greedy rollouts is still scored on every rollout
    assert (
        heldout_metrics(late, config.replace(greedy_chains=True), workdir / "data", seed=5) == flat
    )
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
          "verifier_name_or_path": str(tmp_path / "target")}
    made = {init: build_training(config_for(workdir, tmp_path / init, draft_init=init, **kw))
            for init in ("verifier", "random")}
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
                                  "layers.0.hidden_norm", "layers.0.post_attention")):
            assert torch.equal(mine, value), name


def test_the_state_after_the_last_layer_is_an_aux_layer_a_draft_can_read(workdir, tmp_path):
    """Data of layers (1, 2, 3) of the 4-layer target read as (1, 2, 3, 4): layer 4 is the
    state after the last layer (each sample's last slot), which vLLM captures as aux id 4."""
    from speculators_peagle_plugin.serving.check import check_checkpoint
    from speculators_peagle_plugin.training.heldout import heldout_metrics

    config = config_for(workdir, tmp_path / "run", target_layer_ids=(1, 2, 3, 4),
                        draft_init="verifier", max_steps=2)
    setup = build_training(config)
    fc = setup.draft.fc.weight  # [H, 4H]: id 3 passes (verifier layer 3 reads it), id 4 at zero
    assert fc.shape == (64, 256) and torch.equal(fc[:, 128:192], torch.eye(64))
    assert not fc[:, :128].any() and not fc[:, 192:].any()
    batch = setup.batches.batch(0, 0)
    # slot t holds the aux states at t and the last state at t + 1 (speculators' shift)
    aux4, docs = batch["hidden_states"][0, :, 192:], batch["document_ids"][0]
    last = batch["verifier_last_hidden_states"][0]
    same = (docs[1:] == docs[:-1]) & (docs[1:] >= 0)
    assert same.sum() > 20 and torch.equal(aux4[1:][same], last[:-1][same])
    code, out = run_cli(train_args(workdir, tmp_path / "cli", "--max-steps", "2",
                                   "--target-layer-ids", "1,2,3,4"))
    assert code == 0, out
    final = checkpoint_dirs(tmp_path / "cli")[-1]
    saved = json.loads((final / "config.json").read_text())
    assert saved["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3, 4]
    # vLLM's llama draft sizes fc for 3 aux layers unless the layer config says 4
    assert saved["transformer_layer_config"]["num_aux_hidden_states"] == 4
    findings = check_checkpoint(final, workdir / "target", num_speculative_tokens=3,
                                device="any", scan_values=False)
    assert not [f for f in findings if f.code.startswith(("layer", "aux"))], findings
    held = heldout_metrics(final, config, workdir / "data", seed=5)
    assert held["supervised"][0] > 0 and 0 < held["accuracy_per_depth"][0] <= 1


def test_draft_init_verifier_refuses_what_it_cannot_copy(workdir, tmp_path):
    line = refused(workdir, tmp_path / "a", workdir / "data", "--draft-init", "verifier",
                   "--num-layers", "2")
    assert "copies verifier layers 3..4 (after aux id 3)" in line and "layers.4" in line, line
    line = refused(workdir, tmp_path / "b", workdir / "data", "--draft-init", "verifier",
                   "--num-key-value-heads", "1")
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
                                   "--draft-init", "verifier"))
    assert code == 0, out


def test_a_verifier_of_another_hidden_size_is_refused(workdir, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    other = tmp_path / "other"
    LlamaForCausalLM(
        LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=2,
                    num_key_value_heads=1, head_dim=16, num_hidden_layers=4, vocab_size=96)
    ).save_pretrained(other)
    tiny_tokenizer().save_pretrained(other)
    args = train_args(workdir, tmp_path / "out", "--max-steps", "1")
    args[args.index("--verifier-name-or-path") + 1] = str(other)
    code, out = run_cli(args)
    assert code == 1 and "hidden" in out.splitlines()[-1], out
