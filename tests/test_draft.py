"""Draft checkpoints (both directions with speculators), attention paths, fused loss."""

import json
import logging

import pytest
import torch
from safetensors.torch import load_file
from speculators.model import SpeculatorModel
from speculators.models.peagle.core import PEagleDraftModel as SpeculatorsPEagle
from test_trainer import packed_batch, trainer
from tiny import MASK_TOKEN, tiny_config, tiny_draft, tiny_target

from speculators_peagle_plugin import attention
from speculators_peagle_plugin.draft import PEagleDraftModel
from speculators_peagle_plugin.loss import fused_linear_kl
from speculators_peagle_plugin.trainer import _kl_div_loss


def saved_weights(path):
    return load_file(str(next(path.glob("*.safetensors"))))


def test_our_checkpoint_loads_into_speculators_with_identical_weights(tmp_path):
    ours, _, _ = tiny_draft(1, num_layers=2, verifier_path=tiny_target(tmp_path / "target"))
    tmp_path = tmp_path / "draft"
    ours.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["speculators_model_type"] == "peagle"
    assert config["mask_token_id"] == MASK_TOKEN
    assert "model_type" not in config  # vLLM reads a top-level model_type as a plain model
    weights = saved_weights(tmp_path)
    assert "mask_hidden" in weights and weights["mask_hidden"].shape == (1, 1, 192)
    assert not any(k.startswith("model.") for k in weights)
    theirs = SpeculatorModel.from_pretrained(str(tmp_path))
    assert type(theirs) is SpeculatorsPEagle
    theirs_sd = theirs.state_dict()
    for key, value in weights.items():
        assert torch.equal(theirs_sd[key], value), key


def test_speculators_checkpoint_loads_into_ours_and_trains(tmp_path):
    target = tiny_target(tmp_path / "target")
    tmp_path = tmp_path / "draft"
    torch.manual_seed(7)
    theirs = SpeculatorsPEagle(tiny_config(num_layers=2, verifier_path=target))
    _, ids, t2d = tiny_draft(7)
    theirs.load_vocab_mappings(t2d, ids - torch.arange(ids.shape[0]))
    with torch.no_grad():
        for w in (theirs.embed_tokens.weight, theirs.lm_head.weight):
            w.normal_()
    theirs.save_pretrained(tmp_path)
    ours = PEagleDraftModel.from_pretrained(str(tmp_path))
    assert type(ours) is PEagleDraftModel
    ours_sd = ours.state_dict()
    for key, value in saved_weights(tmp_path).items():
        assert torch.equal(ours_sd[key], value), key
    with torch.no_grad():
        ours.verifier_lm_head.weight.copy_(ours.lm_head.weight)
    trainer(ours, ids, t2d).forward_batch(packed_batch(7, dtype=torch.float32)).loss.backward()
    assert ours.mask_hidden.grad is not None


def test_flex_path_forward_equals_chunked_path_on_cpu():
    draft, ids, t2d = tiny_draft(2, num_layers=2, sliding_window=9)
    batch = packed_batch(2, dtype=torch.float32)
    losses = {}
    with torch.no_grad():  # flex attention has no backward on CPU
        for impl in ("flex", "chunked"):
            draft.attention_impl = impl
            losses[impl] = trainer(draft, ids, t2d, seed=2).forward_batch(batch).loss
    torch.testing.assert_close(losses["flex"], losses["chunked"], rtol=1e-5, atol=0)


def test_unknown_attention_impl_is_a_value_error():
    draft, ids, t2d = tiny_draft(0)
    draft.attention_impl = "sdpa"
    with pytest.raises(ValueError, match="attention_impl must be one of"):
        trainer(draft, ids, t2d).forward_batch(packed_batch(0, dtype=torch.float32))


def test_compile_failure_logs_once_and_falls_back_to_eager(monkeypatch, caplog):
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("inductor says no")

    monkeypatch.setattr(attention, "_peagle_compile_supported", lambda q, k, v: True)
    monkeypatch.setattr(attention, "_peagle_flex_attention_compiled", broken)
    monkeypatch.setattr(attention, "_peagle_flex_attention_compile_failed", False)
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    q, k, v = (torch.randn(1, 2, 130, 16) for _ in range(3))
    block = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, 130, 130, device="cpu")
    with caplog.at_level(logging.WARNING):
        first = attention._peagle_flex_attention(q, k, v, block, 0.25)
        second = attention._peagle_flex_attention(q, k, v, block, 0.25)
    assert calls == [1]
    assert sum("compile failed" in r.message for r in caplog.records) == 1
    want = flex_attention(q, k, v, block_mask=block, scale=0.25)
    assert torch.equal(first, want) and torch.equal(second, want)


def test_compile_support_needs_cuda_and_head_dim_16():
    t = torch.zeros(1, 1, 4, 16)
    assert not attention._peagle_compile_supported(t, t, t)


@pytest.mark.parametrize("weight_grad", [True, False])
def test_fused_linear_kl_matches_plain_kl_and_autograd(monkeypatch, weight_grad):
    from speculators_peagle_plugin import loss

    monkeypatch.setattr(loss, "CHUNK_ROWS", 7)  # several chunks and a ragged tail
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(23, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(11, 8, generator=gen, dtype=torch.float64, requires_grad=weight_grad)
    targets = torch.randn(5, 11, generator=gen, dtype=torch.float64)
    rows = torch.randint(0, 5, (23,), generator=gen)
    kl_sum, hits = fused_linear_kl(hidden, weight, targets, rows)
    (kl_sum * 0.37).backward()
    got = [hidden.grad.clone(), None if not weight_grad else weight.grad.clone()]
    hidden.grad = None
    weight.grad = None
    logits = hidden @ weight.T
    want = _kl_div_loss(logits, targets[rows]).sum()
    (want * 0.37).backward()
    torch.testing.assert_close(kl_sum, want, rtol=1e-12, atol=0)
    torch.testing.assert_close(got[0], hidden.grad, rtol=1e-10, atol=1e-14)
    if weight_grad:
        torch.testing.assert_close(got[1], weight.grad, rtol=1e-10, atol=1e-14)
    assert torch.equal(hits, logits.argmax(-1) == targets[rows].argmax(-1))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_flex_path_matches_chunked_path_with_gradients():
    results = {}
    device = "cuda"  # both paths on one device: COD draws depend on the generator's device
    for impl in ("flex", "chunked"):
        draft, ids, t2d = tiny_draft(3, num_layers=2, sliding_window=17)
        draft = draft.to(device)
        draft.attention_impl = impl
        batch = {k: v.to(device) for k, v in packed_batch(3, dtype=torch.float32).items()}
        module = trainer(draft, ids, t2d, seed=3).to(device)
        module.generator = torch.Generator(device=device).manual_seed(3)
        m = module.forward_batch(batch)
        m.loss.backward()
        results[impl] = (
            m,
            {n: p.grad.cpu() for n, p in draft.named_parameters() if p.grad is not None},
        )
    assert torch.equal(results["flex"][0].valid.cpu(), results["chunked"][0].valid)
