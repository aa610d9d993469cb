"""Checkpoint linter and exporter: every rule, its fix, and the CLI's exit codes."""

import json
import shutil

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file
from speculators.model import SpeculatorModel
from tiny import tiny_draft, tiny_target
from tiny_vllm import (
    MASK_TOKEN,
    PROMPTS,
    VOCAB,
    byte_tokenizer,
    tiny_vllm_draft,
)

from speculators_peagle_plugin.cli import main
from speculators_peagle_plugin.engine.reference import ReferenceRuntime
from speculators_peagle_plugin.serving.check import check_checkpoint
from speculators_peagle_plugin.serving.export import export_checkpoint


@pytest.fixture(scope="module")
def clean(target, tmp_path_factory):
    """A valid P-EAGLE checkpoint for ``target`` (K = 3)."""
    path = tmp_path_factory.mktemp("clean") / "draft"
    tiny_vllm_draft(target, 3, seed=0).save_pretrained(path)
    return path


@pytest.fixture
def ckpt(clean, tmp_path):
    """A fresh copy of the clean checkpoint to break."""
    return shutil.copytree(clean, tmp_path / "draft")


def edit_config(path, fn):
    config = json.loads((path / "config.json").read_text())
    fn(config)
    (path / "config.json").write_text(json.dumps(config))


def edit_weights(path, fn):
    file = path / "model.safetensors"
    weights = load_file(str(file))
    fn(weights)
    save_file(weights, str(file))


def codes(findings, severity="error"):
    return {f.code for f in findings if f.severity == severity}


def test_a_clean_checkpoint_has_no_findings(clean, target):
    assert check_checkpoint(clean, target) == []
    assert check_checkpoint(clean) == []  # the verifier path is the local target


# (break the checkpoint, expected code, export kwargs) for every mechanical fix
MECHANICAL = {
    "model-type": (lambda p: edit_config(p, lambda c: c.update(model_type="llama")), {}),
    "layer-type": (
        lambda p: edit_config(p, lambda c: c["transformer_layer_config"].pop("model_type")),
        {},
    ),
    "speculative-tokens": (
        lambda p: edit_config(
            p, lambda c: c["speculators_config"]["proposal_methods"][0].pop("speculative_tokens")
        ),
        {"num_speculative_tokens": 3},
    ),
    "verifier": (
        lambda p: edit_config(p, lambda c: c["speculators_config"]["verifier"].pop("name_or_path")),
        {},
    ),
    "mask-token-id": (
        lambda p: edit_config(p, lambda c: c.pop("mask_token_id")),
        {"mask_token_id": MASK_TOKEN},
    ),
    "draft-vocab": (lambda p: edit_config(p, lambda c: c.pop("draft_vocab_size")), {}),
    "model-prefix": (
        lambda p: edit_weights(p, lambda w: w.update({f"model.{k}": w.pop(k) for k in list(w)})),
        {},
    ),
    "extra-weights": (
        lambda p: edit_weights(
            p, lambda w: w.update({"verifier_lm_head.weight": w["lm_head.weight"].clone()})
        ),
        {},
    ),
}


@pytest.mark.parametrize("code", sorted(MECHANICAL))
def test_mechanical_problems_are_found_and_exported_away(ckpt, clean, target, tmp_path, code):
    breaker, kwargs = MECHANICAL[code]
    breaker(ckpt)
    found = [f for f in check_checkpoint(ckpt, target) if f.severity == "error"]
    assert [f.code for f in found] == [code]
    assert found[0].mechanical and found[0].fix.endswith(".")
    fixed, remaining = export_checkpoint(ckpt, tmp_path / "out", target, **kwargs)
    assert [f.code for f in fixed] == [code] and remaining == []
    assert check_checkpoint(tmp_path / "out", target) == []
    # the fix restores exactly what the clean checkpoint holds
    want, got = (
        load_file(str(clean / "model.safetensors")),
        load_file(str(tmp_path / "out" / "model.safetensors")),
    )
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["transformer_layer_config"]["model_type"] == "llama"
    assert config["mask_token_id"] == MASK_TOKEN and "model_type" not in config
    assert SpeculatorModel.from_pretrained(str(tmp_path / "out")).mask_hidden.shape == (1, 1, 384)


# (break the checkpoint, expected code) where only retraining or the right files help
NOT_MECHANICAL = {
    "mask-hidden": lambda p: edit_weights(p, lambda w: w.pop("mask_hidden")),
    "missing-weights": lambda p: edit_weights(p, lambda w: w.pop("layers.0.mlp.up_proj.weight")),
    "non-finite": lambda p: edit_weights(
        p, lambda w: w["lm_head.weight"].__setitem__(3, torch.nan)
    ),
    "shape": lambda p: edit_weights(p, lambda w: w.update({"norm.weight": torch.ones(64)})),
    "extra-weights": lambda p: edit_weights(p, lambda w: w.update({"foo.weight": torch.ones(2)})),
    "not-peagle": lambda p: edit_config(p, lambda c: c.update(speculators_model_type="eagle3")),
    "not-speculators": lambda p: edit_config(p, lambda c: c.pop("speculators_model_type")),
    "layer-ids": lambda p: edit_config(
        p, lambda c: c.update(eagle_aux_hidden_state_layer_ids=[1, 2, 9])
    ),
}


@pytest.mark.parametrize("code", sorted(NOT_MECHANICAL))
def test_problems_that_need_retraining_stop_the_export(ckpt, target, tmp_path, code):
    NOT_MECHANICAL[code](ckpt)
    found = [f for f in check_checkpoint(ckpt, target) if f.severity == "error"]
    assert code in {f.code for f in found}
    assert not any(f.mechanical for f in found if f.code == code)
    with pytest.raises(ValueError, match=r"cannot fix|not 'peagle'|speculators_model_type"):
        export_checkpoint(ckpt, tmp_path / "out", target)
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["draft"]  # no temporary left behind


def test_mask_token_the_tokenizer_produces_is_an_error(ckpt, target):
    tokenizer = byte_tokenizer()
    for bad, words in [(65, "ordinary vocabulary"), (tokenizer.eos_token_id, "emits")]:
        edit_config(ckpt, lambda c, bad=bad: c.update(mask_token_id=bad))
        found = [f for f in check_checkpoint(ckpt, target) if f.code == "mask-token-id"]
        assert len(found) == 1 and words in found[0].message
    edit_config(ckpt, lambda c: c.update(mask_token_id=VOCAB))
    (found,) = [f for f in check_checkpoint(ckpt, target) if f.code == "mask-token-id"]
    assert f"[0, {VOCAB})" in found.message


def test_unordered_layer_ids_export_to_the_same_drafts(target, tmp_path):
    """vLLM concatenates aux states in ascending layer order; the export permutes fc and
    mask_hidden blocks so that the fixed draft proposes exactly what the original
    (read in its own order by the reference runtime) proposes."""
    draft = tiny_vllm_draft(target, 3, seed=4, layer_ids=(3, 1, 2))
    draft.save_pretrained(tmp_path / "draft")
    assert codes(check_checkpoint(tmp_path / "draft", target)) == {"layer-order"}
    export_checkpoint(tmp_path / "draft", tmp_path / "out", target)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    tok = byte_tokenizer()
    prompts = [
        tok.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, return_dict=False
        )
        for p in PROMPTS[:3]
    ]
    gen = torch.Generator().manual_seed(4)
    tokens, aux = torch.randint(0, 259, (10,), generator=gen), torch.randn(9, 384, generator=gen)
    before = ReferenceRuntime(target, tmp_path / "draft", 3)
    after = ReferenceRuntime(target, tmp_path / "out", 3)
    # the same aux states, laid out in each config's order: layers (3, 1, 2) vs (1, 2, 3)
    blocks = aux.chunk(3, -1)
    torch.testing.assert_close(
        before.draft_logits(tokens, aux),
        after.draft_logits(tokens, torch.cat([blocks[1], blocks[2], blocks[0]], -1)),
        rtol=1e-4,
        atol=1e-4,  # fc sums its input blocks in another order
    )
    a, b = before.run(prompts, 12), after.run(prompts, 12)
    assert a["outputs"] == b["outputs"] and a["counters"] == b["counters"]


def test_llama_draft_with_two_aux_layers_gets_num_aux_hidden_states(target, tmp_path):
    tiny_vllm_draft(target, 3, seed=1, layer_ids=(1, 3)).save_pretrained(tmp_path / "draft")
    assert codes(check_checkpoint(tmp_path / "draft", target)) == {"aux-count"}
    export_checkpoint(tmp_path / "draft", tmp_path / "out", target)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["transformer_layer_config"]["num_aux_hidden_states"] == 2
    assert check_checkpoint(tmp_path / "out", target) == []


def test_fc_norm_is_copied_where_vllm_reads_it(target, tmp_path):
    draft = tiny_vllm_draft(target, 3, seed=2, fc_norm=True)
    draft.save_pretrained(tmp_path / "draft")
    assert codes(check_checkpoint(tmp_path / "draft", target)) == {"fc-norm"}
    export_checkpoint(tmp_path / "draft", tmp_path / "out", target)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["transformer_layer_config"]["fc_norm"] is True
    reloaded = SpeculatorModel.from_pretrained(str(tmp_path / "out"))
    assert reloaded.fc_norm is not None and len(reloaded.fc_norm) == 3


def test_missing_d2t_is_derived_from_t2d(target, tmp_path):
    draft = tiny_vllm_draft(target, 3, seed=3, draft_vocab=100)
    ids = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(3))[:100].sort().values
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[ids] = True
    draft.load_vocab_mappings(t2d, ids - torch.arange(100))
    draft.save_pretrained(tmp_path / "draft")
    assert check_checkpoint(tmp_path / "draft", target) == []
    edit_weights(tmp_path / "draft", lambda w: w.pop("d2t"))
    assert codes(check_checkpoint(tmp_path / "draft", target)) == {"d2t"}
    export_checkpoint(tmp_path / "draft", tmp_path / "out", target)
    assert torch.equal(
        load_file(str(tmp_path / "out" / "model.safetensors"))["d2t"], ids - torch.arange(100)
    )
    edit_weights(tmp_path / "draft", lambda w: w.update(d2t=torch.zeros(100, dtype=torch.long)))
    edit_weights(tmp_path / "draft", lambda w: w["d2t"].__setitem__(5, -5))
    assert "d2t" in codes(check_checkpoint(tmp_path / "draft", target))


def test_target_mismatch_head_dim_and_depth(ckpt, target, tmp_path):
    other = tiny_target(tmp_path / "other")  # hidden 64, vocab 96, head_dim 16
    found = codes(check_checkpoint(ckpt, other, device="cpu"))
    assert {"target-hidden", "target-vocab", "head-dim"} <= found
    small, _, _ = tiny_draft(0, verifier_path=other)
    small.save_pretrained(tmp_path / "small")
    assert "head-dim" in codes(check_checkpoint(tmp_path / "small", other, device="cpu"))
    assert "head-dim" not in codes(check_checkpoint(tmp_path / "small", other, device="cuda"))
    (warning,) = check_checkpoint(ckpt, target, num_speculative_tokens=5)
    assert warning.code == "depth" and warning.severity == "warning"
    assert "positions 4..5" in warning.message


def test_warnings_for_missing_optional_facts(ckpt, tmp_path):
    edit_config(ckpt, lambda c: c["speculators_config"]["verifier"].update(name_or_path="hub/x"))
    edit_config(ckpt, lambda c: c.pop("eagle_aux_hidden_state_layer_ids"))
    edit_weights(ckpt, lambda w: w.pop("embed_tokens.weight"))
    found = check_checkpoint(ckpt)
    assert codes(found) == set()
    assert codes(found, "warning") == {"no-target", "layer-ids", "embed-tokens"}


# --------------------------------------------------------------------------- CLI


def test_check_and_export_commands(ckpt, target, tmp_path):
    runner = CliRunner()
    ok = runner.invoke(main, ["check", str(ckpt), "--target", target])
    assert ok.exit_code == 0 and "OK: vLLM can serve" in ok.output
    edit_config(ckpt, lambda c: c.update(model_type="llama"))
    bad = runner.invoke(main, ["check", str(ckpt), "--target", target])
    assert bad.exit_code == 1
    assert "error [model-type]" in bad.output and "Fix: Remove the top-level" in bad.output
    out = tmp_path / "fixed"
    done = runner.invoke(main, ["export", str(ckpt), str(out), "--target", target])
    assert done.exit_code == 0 and "fixed [model-type]" in done.output
    assert runner.invoke(main, ["check", str(out), "--target", target]).exit_code == 0
    again = runner.invoke(main, ["export", str(ckpt), str(out), "--target", target])
    assert again.exit_code == 1 and "already exists" in again.output


@pytest.mark.parametrize(
    ("args", "sentence"),
    [
        (["check", "/nonexistent/draft"], "is not a directory"),
        (["check", "{ckpt}", "--target", "/nonexistent/target"], "is not a local model directory"),
        (["export", "/nonexistent/draft", "{tmp}/out"], "is not a directory"),
    ],
)
def test_bad_paths_are_one_sentence_and_exit_1(ckpt, tmp_path, args, sentence):
    args = [a.format(ckpt=ckpt, tmp=tmp_path) for a in args]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1
    assert sentence in result.output and "Traceback" not in result.output
    assert result.output.count("\n") == 1


# ------------------------------------------------------- what a draft carries, where it goes


def test_check_names_the_code_a_draft_ships_and_runs_none_of_it(ckpt, target, tmp_path):
    # speculators' save_pretrained copies config.py in and names it under no Auto class
    assert json.loads((ckpt / "config.json").read_text())["auto_map"] == {
        "": "config.PEagleSpeculatorConfig"}
    assert (ckpt / "config.py").is_file() and "remote-code" not in codes(
        check_checkpoint(ckpt, target), "warning")
    ran = tmp_path / "ran"
    (ckpt / "configuration_x.py").write_text(f"open({str(ran)!r}, 'w')\n")
    edit_config(ckpt, lambda c: c["auto_map"].update(
        AutoConfig="configuration_x.XConfig", AutoModel="other/repo--modeling_x.XModel",
        AutoTokenizer=["tokenization_x.XTokenizer", None]))
    (found,) = [f for f in check_checkpoint(ckpt, target) if f.code == "remote-code"]
    assert found.severity == "warning"
    assert "configuration_x.py, modeling_x.py of other/repo, tokenization_x.py:" in found.message
    assert ("ships code that neither this package nor vLLM runs without --trust-remote-code"
            in found.message)
    result = CliRunner().invoke(main, ["check", str(ckpt), "--target", target])
    assert result.exit_code == 0 and "warning [remote-code]" in result.output
    assert not ran.exists()


def test_check_warns_for_a_model_card_that_is_not_plain_yaml(ckpt, target, tmp_path):
    ran = tmp_path / "ran"
    (ckpt / "README.md").write_text(
        f"---\nbase_model: !!python/object/apply:os.system ['touch {ran}']\npeagle: {{}}\n---\n"
        "# a card\n"
    )
    (found,) = check_checkpoint(ckpt, target)
    assert (found.code, found.severity) == ("model-card-yaml", "warning")
    assert "not plain YAML" in found.message and "python/object" in found.message
    export_checkpoint(ckpt, tmp_path / "out", target)  # copied as it is, never loaded
    assert (tmp_path / "out" / "README.md").read_text() == (ckpt / "README.md").read_text()
    assert not ran.exists()


def listing(path):
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def test_export_into_its_own_source_or_over_it_is_refused(ckpt, target, tmp_path):
    link = tmp_path / "link"
    link.symlink_to(ckpt)
    before = listing(tmp_path)
    inside = [ckpt / "copy", link / "copy", ckpt / ".." / "draft" / "copy", ckpt, link]
    cases = [(str(out), "is the checkpoint") for out in inside] + [
        (str(tmp_path), "is inside the output")]
    for out, sentence in cases:
        result = CliRunner().invoke(main, ["export", str(ckpt), out, "--target", target])
        assert result.exit_code == 1, out
        assert sentence in result.output and result.output.count("\n") == 1, result.output
    result = CliRunner().invoke(main, ["export", str(link), str(ckpt / "copy"), "--target", target])
    assert result.exit_code == 1 and "is the checkpoint" in result.output
    assert listing(tmp_path) == before
