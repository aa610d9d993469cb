"""Reference P-EAGLE runtime: slot layout, acceptance counting, lossless greedy decoding."""

import pytest
import torch
from tiny_vllm import (
    HIDDEN,
    LAYER_IDS,
    MASK_TOKEN,
    PROMPTS,
    VOCAB,
    byte_tokenizer,
    constant_draft,
    constant_target,
    tiny_vllm_draft,
    trained_target_and_draft,
)
from transformers import LlamaForCausalLM

from speculators_peagle_plugin.engine.reference import ReferenceRuntime, stop_token_ids
from speculators_peagle_plugin.selftest.oracles import dense_draft_hidden, rms_norm


def chat_prompts(n=4, offset=0):
    tok = byte_tokenizer()
    return [
        tok.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, return_dict=False
        )
        for p in PROMPTS[offset : offset + n]
    ]


# ------------------------------------------------------------ slot layout, by hand


def slot_oracle_logits(draft, tokens, aux, k):
    """vLLM's parallel-drafting input, written out: slot t = (tokens[t+1], fc(aux[t])) at
    position t, then K-1 (mask token, fc(mask_hidden)) slots; plain causal attention; the
    logits of the last K slots (vllm llama_eagle3 forward, norm_before_residual False)."""
    n_ctx = aux.shape[0]
    ids = torch.cat([tokens[1:], torch.full((k - 1,), MASK_TOKEN)])
    h = torch.cat([draft.fc(aux), draft.fc(draft.mask_hidden[0]).expand(k - 1, -1)])
    pos = torch.arange(ids.shape[0])
    h = dense_draft_hidden(draft, ids, h, pos, pos[:, None] >= pos[None, :])
    return draft.lm_head(rms_norm(draft.norm, h))[n_ctx - 1 :]


@pytest.mark.parametrize("num_layers", [1, 2])
@pytest.mark.parametrize("seed", range(3))
def test_draft_logits_follow_vllm_slot_layout(target, tmp_path, seed, num_layers):
    k = 2 + seed
    tiny_vllm_draft(target, k, seed=seed, num_layers=num_layers).save_pretrained(tmp_path)
    runtime = ReferenceRuntime(target, tmp_path, k)
    gen = torch.Generator().manual_seed(seed)
    n_ctx = 5 + 7 * seed
    tokens = torch.randint(0, 259, (n_ctx + 1,), generator=gen)
    aux = torch.randn(n_ctx, len(LAYER_IDS) * HIDDEN, generator=gen)
    got = runtime.draft_logits(tokens, aux)
    with torch.no_grad():
        want = slot_oracle_logits(runtime.draft, tokens, aux, k)
    assert got.shape == (k, VOCAB)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_draft_ids_map_through_d2t_offsets(target, tmp_path):
    draft_vocab = 100
    gen = torch.Generator().manual_seed(5)
    ids = torch.randperm(VOCAB, generator=gen)[:draft_vocab].sort().values
    draft = tiny_vllm_draft(target, 3, seed=5, draft_vocab=draft_vocab)
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[ids] = True
    draft.load_vocab_mappings(t2d, ids - torch.arange(draft_vocab))
    with torch.no_grad():
        draft.lm_head.weight.copy_(LlamaForCausalLM.from_pretrained(target).lm_head.weight[ids])
    draft.save_pretrained(tmp_path)
    runtime = ReferenceRuntime(target, tmp_path, 3)
    tokens = torch.randint(0, 259, (9,), generator=gen)
    aux = torch.randn(8, len(LAYER_IDS) * HIDDEN, generator=gen)
    assert torch.equal(
        runtime.propose(tokens, aux), ids[runtime.draft_logits(tokens, aux).argmax(-1)]
    )


# ------------------------------------------------------- acceptance bookkeeping


@pytest.mark.parametrize(("k", "seed"), [(1, 0), (3, 1), (5, 2)])
def test_draft_of_the_target_greedy_token_accepts_everything(tmp_path, k, seed):
    token = 20 + 11 * seed
    target = constant_target(tmp_path / "target", token, seed=seed)
    constant_draft(target, token, k, seed=seed).save_pretrained(tmp_path / "right")
    constant_draft(target, token + 1, k, seed=seed).save_pretrained(tmp_path / "wrong")
    prompts, max_new = chat_prompts(3, seed), 17 + seed
    right = ReferenceRuntime(target, tmp_path / "right", k).run(prompts, max_new)
    wrong = ReferenceRuntime(target, tmp_path / "wrong", k).run(prompts, max_new)
    assert right["outputs"] == wrong["outputs"] == [[token] * max_new] * len(prompts)
    c = right["counters"]
    # The prefill gives token 1; each verify step then adds K + 1 tokens.
    assert c["num_drafts"] == len(prompts) * -(-(max_new - 1) // (k + 1))
    assert c["num_accepted_tokens"] == k * c["num_drafts"]
    assert c["accepted_per_pos"] == [c["num_drafts"]] * k
    w = wrong["counters"]
    assert w["num_drafts"] == len(prompts) * (max_new - 1)
    assert w["num_accepted_tokens"] == 0 and w["accepted_per_pos"] == [0] * k


def test_generation_stops_at_the_target_eos(tmp_path):
    eos = byte_tokenizer().eos_token_id
    target = constant_target(tmp_path / "target", eos)
    constant_draft(target, eos, 2).save_pretrained(tmp_path / "draft")
    runtime = ReferenceRuntime(target, tmp_path / "draft", 2)
    stop = stop_token_ids(target, byte_tokenizer())
    assert stop == {eos}
    assert runtime.run(chat_prompts(2), 10, stop)["outputs"] == [[eos], [eos]]
    assert runtime.run(chat_prompts(1), 4)["outputs"] == [[eos] * 4]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A draft trained for a few steps on its target's own replies (shared per session)."""
    return trained_target_and_draft(tmp_path_factory.getbasetemp() / "trained-k3")


@pytest.mark.parametrize("k", [2, 3])
def test_speculative_greedy_output_equals_plain_greedy(trained, k):
    target, draft, _ = trained
    prompts = chat_prompts(4, offset=2)
    model = LlamaForCausalLM.from_pretrained(target).eval()
    want = []
    for p in prompts:  # transformers' own greedy loop (stops after eos, as vLLM does)
        out = model.generate(torch.tensor([p]), max_new_tokens=40, do_sample=False)
        want.append(out[0, len(p) :].tolist())
    stop = stop_token_ids(target, byte_tokenizer())
    got = ReferenceRuntime(target, draft, k).run(prompts, 40, stop)
    assert got["outputs"] == want
    c = got["counters"]
    assert 0 < c["num_accepted_tokens"] < k * c["num_drafts"]  # both paths exercised
    assert c["accepted_per_pos"] == sorted(c["accepted_per_pos"], reverse=True)


def test_reference_without_draft_reports_no_counters(target):
    result = ReferenceRuntime(target).run(chat_prompts(2), 5)
    assert result["counters"] is None and result["output_tokens"] == 10
    with pytest.raises(ValueError, match="num_speculative_tokens must be"):
        ReferenceRuntime(target, "unused", 0)
