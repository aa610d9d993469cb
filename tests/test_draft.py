"""Draft checkpoints (both directions with speculators), attention paths, fused loss."""

import json
import logging

import pytest
import torch
from helpers.oracles import masked_attention
from safetensors.torch import load_file
from speculators.model import SpeculatorModel
from speculators.models.peagle.core import PEagleDraftModel as SpeculatorsPEagle
from test_trainer import packed_batch, trainer
from tiny import MASK_TOKEN, tiny_config, tiny_draft, tiny_target
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from speculators_peagle_plugin import generate_cod_sample_indices
from speculators_peagle_plugin.kernels import attention, block_sparse, flex
from speculators_peagle_plugin.kernels.fused_kl import fused_linear_kl
from speculators_peagle_plugin.kernels.fused_ops import _RMSNormFunction, apply_rotary
from speculators_peagle_plugin.model import peagle_draft as draft_module
from speculators_peagle_plugin.model.peagle_draft import PEagleDraftModel, _rms_norm
from speculators_peagle_plugin.training.peagle_trainer import _kl_div_loss


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

    monkeypatch.setattr(flex, "_peagle_compile_supported", lambda q, k, v: True)
    monkeypatch.setattr(flex, "_peagle_flex_attention_compiled", broken)
    monkeypatch.setattr(flex, "_peagle_flex_attention_compile_failed", False)
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    q, k, v = (torch.randn(1, 2, 130, 16) for _ in range(3))
    block = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, 130, 130, device="cpu")
    with caplog.at_level(logging.WARNING):
        first = flex._peagle_flex_attention(q, k, v, block, 0.25)
        second = flex._peagle_flex_attention(q, k, v, block, 0.25)
    assert calls == [1]
    assert sum("compile failed" in r.message for r in caplog.records) == 1
    want = flex_attention(q, k, v, block_mask=block, scale=0.25)
    assert torch.equal(first, want) and torch.equal(second, want)


def test_compile_support_needs_cuda_and_head_dim_16():
    t = torch.zeros(1, 1, 4, 16)
    assert not flex._peagle_compile_supported(t, t, t)


# ------------------------------------------------- block-sparse CPU attention vs dense


def random_cod_elements(seed, length=71, num_depths=5, drop_context=False):
    """A COD sample of a ragged packed row (several documents, padding); optionally
    with random elements removed, so some rows lose their own anchor (an empty
    context band under a short window) and some rollouts have gaps."""
    gen = torch.Generator().manual_seed(seed)
    used = length - int(torch.randint(0, 9, (1,), generator=gen))
    cuts = sorted(torch.randperm(used - 2, generator=gen)[:3].add(1).tolist())
    doc = torch.full((length,), -1, dtype=torch.long)
    for i, (s, e) in enumerate(zip([0, *cuts], [*cuts, used], strict=True)):
        doc[s:e] = i
    loss_mask = (torch.rand(length, generator=gen) < 0.85).long()
    anchor, depth = generate_cod_sample_indices(
        length, loss_mask, num_depths, 0.9, 0.4, document_ids=doc, generator=gen
    )
    if drop_context:  # also leaves gaps in rollouts
        keep = torch.rand(anchor.shape, generator=gen) < torch.where(depth == 0, 0.6, 0.8)
        anchor, depth = anchor[keep], depth[keep]
    return anchor, depth, doc


@pytest.mark.parametrize("seed,heads", [(0, (4, 2)), (1, (3, 3)), (2, (6, 2)), (3, (4, 1))])
@pytest.mark.parametrize("window", [None, 2, 5, 16])
@pytest.mark.parametrize("band_kernel", ["cpu_flash", "matmul"])  # matmul: other devices
def test_block_sparse_attention_matches_dense_float64(
    monkeypatch, seed, heads, window, band_kernel
):
    monkeypatch.setattr(block_sparse, "CHUNK_ANCHORS", 8)  # many chunks, ragged ones too
    if band_kernel == "matmul":
        monkeypatch.setattr(block_sparse, "_cpu_flash", lambda t: False)
    anchor, depth, doc = random_cod_elements(seed, drop_context=seed % 2 == 1)
    mask = attention.PeagleMask(anchor, depth, doc, window, "chunked")
    n = anchor.shape[0]
    idx = torch.arange(n)
    allowed = mask.mask_mod(None, None, idx[:, None], idx[None, :])
    assert len(mask.chunks) > 3
    gen = torch.Generator().manual_seed(100 + seed)
    n_q, n_kv = heads

    def projected(h):  # the attention module's layout: [1, N, h, D] viewed as [1, h, N, D]
        x = torch.randn(1, n, h, 16, generator=gen, dtype=torch.float64)
        return x.transpose(1, 2).requires_grad_()

    q, k, v = projected(n_q), projected(n_kv), projected(n_kv)
    grad_out = torch.randn(1, n_q, n, 16, generator=gen, dtype=torch.float64)
    got = attention.peagle_attention(q, k, v, mask, 0.3)
    got_grads = torch.autograd.grad(got, (q, k, v), grad_out)
    want = masked_attention(q, k, v, allowed, 0.3)
    want_grads = torch.autograd.grad(want, (q, k, v), grad_out)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-13)
    for name, a, b in zip("qkv", got_grads, want_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=name)
    if seed % 2 == 1:  # the dropped elements really produced the hard rows
        deep_rows_missing_depth_1 = [
            ~c.chain_ok[depth[c.rows] >= 1, 0] for c in mask.chunks if c.chain_ok is not None
        ]
        assert bool(torch.cat(deep_rows_missing_depth_1).any())
        if window == 2:  # deep rows' bands hold only their own anchor, often dropped
            assert any(c.no_band is not None for c in mask.chunks)


@pytest.mark.parametrize("model_type,num_layers,seed", [
    ("llama", 1, 0), ("llama", 2, 1), ("qwen3", 1, 2), ("qwen3", 2, 3),
])  # fmt: skip
def test_mask_slots_project_once_with_identical_output_and_gradients(
    monkeypatch, model_type, num_layers, seed
):
    """Depth >= 1 rows share one first-layer input: with ``mask_slots`` the first layer's
    q/k/v see one row for all of them, and outputs and every gradient are unchanged."""
    # transformers' RMSNorm computes in float32 even for float64 input, which would put
    # float32 rounding on the summed-vs-separate gradients; the fused norm is float64 here.
    monkeypatch.setattr(
        draft_module,
        "_rms_norm",
        lambda norm, x: _RMSNormFunction.apply(x, norm.weight, norm.variance_epsilon),
    )
    draft, _, _ = tiny_draft(seed, torch.float64, model_type=model_type, num_layers=num_layers,
                             sliding_window=6)  # fmt: skip
    anchor, depth, doc = random_cod_elements(seed, num_depths=4)
    n, n0 = depth.shape[0], int((depth == 0).sum())
    gen = torch.Generator().manual_seed(seed)
    ids = torch.where(depth == 0, torch.randint(0, MASK_TOKEN, (n,), generator=gen), MASK_TOKEN)
    aux = torch.randn(n0, draft.fc.in_features, generator=gen, dtype=torch.float64)
    weight = torch.randn(n, 64, generator=gen, dtype=torch.float64)
    masks = draft.build_peagle_block_mask(anchor, depth, torch.bincount(doc[doc >= 0]), len(doc))
    rows_seen = []
    draft.layers[0].self_attn.q_proj.register_forward_hook(
        lambda mod, args, out: rows_seen.append(args[0].shape[1])
    )
    results = {}
    for slots in (0, n - n0):
        draft.zero_grad()
        projected = torch.cat([
            draft.project_hidden_states(aux),
            draft.masked_projected_hidden().expand(n - n0, -1),
        ])  # fmt: skip
        out = draft.forward_peagle(ids[None], projected[None], (anchor + depth)[None], masks,
                                   mask_slots=slots)[0]  # fmt: skip
        (out * weight).sum().backward()
        grads = {k: p.grad.clone() for k, p in draft.named_parameters() if p.grad is not None}
        results[slots] = out.detach(), grads
    assert rows_seen == [n, n0 + 1]
    (out0, grads0), (out1, grads1) = results.values()
    torch.testing.assert_close(out1, out0, rtol=1e-12, atol=1e-12)
    assert grads1.keys() == grads0.keys() and "mask_hidden" in grads0
    for name, grad in grads0.items():
        torch.testing.assert_close(grads1[name], grad, rtol=1e-10, atol=1e-12, msg=name)
    for bad in (-1, n + 1, True, 1.0):
        with pytest.raises(ValueError, match=r"mask_slots must be an integer in \[0, "):
            draft.forward_peagle(ids[None], projected[None], (anchor + depth)[None], masks,
                                 mask_slots=bad)  # fmt: skip


def test_block_sparse_attention_skips_padding_and_empty_rows():
    anchor, depth, doc = random_cod_elements(5, drop_context=True)
    mask = attention.PeagleMask(anchor, depth, doc, None, "chunked")
    idx = torch.arange(anchor.shape[0])
    sees = mask.mask_mod(None, None, idx[:, None], idx[None, :]).any(-1)
    rows = torch.cat([c.rows for c in mask.chunks])
    assert rows.unique().numel() == rows.numel()  # each row in one chunk
    assert torch.equal(rows.sort().values, torch.nonzero(sees).squeeze(1))


@pytest.mark.parametrize("weight_grad", [True, False])
def test_fused_linear_kl_matches_plain_kl_and_autograd(monkeypatch, weight_grad):
    from speculators_peagle_plugin.kernels import fused_kl as loss

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


@pytest.mark.parametrize(("seed", "w"), [(0, 0.3), (1, 0.9), (2, 1.0)])
def test_fused_linear_kl_with_hard_labels_is_the_kl_to_the_mixed_target(monkeypatch, seed, w):
    """Oracle: KL((1-w) p + w onehot(argmax p) || q) in float64 through autograd, which is
    (1-w) KL(p || q) + w CE(argmax p, q) up to a constant of the target alone."""
    from speculators_peagle_plugin.kernels import fused_kl as loss

    monkeypatch.setattr(loss, "CHUNK_ROWS", 5)
    gen = torch.Generator().manual_seed(seed)
    n, m, vocab = int(torch.randint(9, 31, (1,), generator=gen)), 6, 13
    hidden = torch.randn(n, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(vocab, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    targets = torch.randn(m, vocab, generator=gen, dtype=torch.float64) * 2
    rows = torch.randint(0, m, (n,), generator=gen)
    kl_sum, hits = fused_linear_kl(hidden, weight, targets, rows, w)
    kl_sum.backward()
    got_h, got_w = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None

    p = torch.softmax(targets, -1)
    mixed = (1 - w) * p + w * torch.nn.functional.one_hot(p.argmax(-1), vocab).double()
    log_q = torch.log_softmax(hidden @ weight.T, -1)
    want = (torch.special.xlogy(mixed[rows], mixed[rows]) - mixed[rows] * log_q).sum()
    want.backward()
    torch.testing.assert_close(kl_sum, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_h, hidden.grad, rtol=1e-10, atol=1e-13)
    torch.testing.assert_close(got_w, weight.grad, rtol=1e-10, atol=1e-13)
    ce = -log_q.gather(-1, p.argmax(-1)[rows, None]).sum()
    plain = fused_linear_kl(hidden.detach(), weight.detach(), targets, rows)[0]
    entropy_gap = (torch.special.xlogy(mixed, mixed) - (1 - w) * torch.special.xlogy(p, p))
    torch.testing.assert_close(
        kl_sum - (1 - w) * plain - w * ce, entropy_gap.sum(-1)[rows].sum(), rtol=1e-9, atol=1e-9
    )
    assert torch.equal(hits, (hidden @ weight.T).argmax(-1) == targets[rows].argmax(-1))


@pytest.mark.parametrize(("seed", "t", "w"), [(0, 0.5, 0.0), (1, 2.0, 0.0), (2, 1.0, 0.4)])
def test_fused_linear_kl_with_a_tv_term_matches_its_float64_oracle(monkeypatch, seed, t, w):
    """Oracle: sum KL(p || q) + t * sum |p - q| / 2 through autograd in float64 (``p`` the
    hard-label-mixed target where ``w > 0``)."""
    from speculators_peagle_plugin.kernels import fused_kl as loss

    monkeypatch.setattr(loss, "CHUNK_ROWS", 4)
    gen = torch.Generator().manual_seed(seed)
    n, vocab = int(torch.randint(7, 25, (1,), generator=gen)), 11
    hidden = torch.randn(n, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(vocab, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    targets = torch.randn(5, vocab, generator=gen, dtype=torch.float64) * 2
    rows = torch.randint(0, 5, (n,), generator=gen)
    got, _ = fused_linear_kl(hidden, weight, targets, rows, w, t)
    got.backward()
    got_h, got_w = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None

    p = torch.softmax(targets, -1)
    p = (1 - w) * p + w * torch.nn.functional.one_hot(p.argmax(-1), vocab).double()
    p = p[rows]
    log_q = torch.log_softmax(hidden @ weight.T, -1)
    want = (torch.special.xlogy(p, p) - p * log_q).sum() + t / 2 * (log_q.exp() - p).abs().sum()
    want.backward()
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_h, hidden.grad, rtol=1e-10, atol=1e-13)
    torch.testing.assert_close(got_w, weight.grad, rtol=1e-10, atol=1e-13)
    plain = fused_linear_kl(hidden.detach(), weight.detach(), targets, rows, w)[0]
    assert float(got - plain) > 1e-3  # the term is there


def test_fused_linear_kl_under_autocast_runs_its_matmuls_in_bfloat16():
    """Mixed precision: the lm_head products in bfloat16 (as nn.Linear's under autocast),
    the softmax / KL in float32, float32 gradients; oracle: float64 on the same roundings."""
    from speculators_peagle_plugin.kernels import fused_kl as loss

    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(30, 64, generator=gen, requires_grad=True)
    weight = (torch.randn(50, 64, generator=gen) / 4).requires_grad_()
    targets = torch.randn(6, 50, generator=gen) * 3
    rows = torch.randint(0, 6, (30,), generator=gen)

    def bf16(t):  # a bfloat16 rounding, carried on in float64
        return t.bfloat16().double()

    hb, wb = bf16(hidden.detach()), bf16(weight.detach())
    z = bf16(hb @ wb.T).requires_grad_()  # the bfloat16 logits, as the matmul returns them
    want = _kl_div_loss(z, targets.double()[rows]).sum()
    (g,) = torch.autograd.grad(want, z)
    want_grad_h, want_grad_w = bf16(bf16(g) @ wb), bf16(g).T @ hb
    with torch.no_grad():
        plain = fused_linear_kl(hidden, weight, targets, rows)[0]  # float32 matmuls
    with torch.autocast("cpu", dtype=torch.bfloat16):
        kl_sum, _ = fused_linear_kl(hidden, weight, targets, rows)
    kl_sum.backward()
    assert kl_sum.dtype == hidden.grad.dtype == weight.grad.dtype == torch.float32
    torch.testing.assert_close(kl_sum.double(), want, rtol=2e-5, atol=0)
    assert abs(float(plain) - want.item()) > 1e-4 * want.item()  # the check can tell
    torch.testing.assert_close(hidden.grad.double(), want_grad_h, rtol=1e-2, atol=1e-5)
    torch.testing.assert_close(weight.grad.double(), want_grad_w, rtol=2e-2, atol=1e-4)
    assert loss.CHUNK_ROWS >= 30  # one chunk: the weight gradient is one rounded product


@pytest.mark.parametrize("seed", range(3))
def test_under_autocast_cpu_attention_runs_forward_bfloat16_backward_float32(seed):
    """The forward as autocast's SDPA would compute it (bfloat16); float32 gradients."""
    anchor, depth, doc = random_cod_elements(5 + seed)
    mask = attention.PeagleMask(anchor, depth, doc, None, "chunked")
    n = anchor.shape[0]
    idx = torch.arange(n)
    allowed = mask.mask_mod(None, None, idx[:, None], idx[None, :])
    gen = torch.Generator().manual_seed(6 + seed)
    q, k, v = (
        torch.randn(1, n, h, 64, generator=gen).transpose(1, 2).requires_grad_() for h in (4, 2, 2)
    )
    grad_out = torch.randn(1, 4, n, 64, generator=gen)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = attention.peagle_attention(q, k, v, mask, 0.125)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    with torch.no_grad():
        bf16_forward = attention._chunked_attention(*(t.bfloat16() for t in (q, k, v)), mask, 0.125)
    assert out.dtype == torch.float32 and torch.equal(out, bf16_forward.float())
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    want = masked_attention(q64, k64, v64, allowed, 0.125)
    want_grads = torch.autograd.grad(want, (q64, k64, v64), grad_out.double())
    names, wants = ["out", "dq", "dk", "dv"], (want.detach(), *want_grads)
    for name, got, ref in zip(names, (out, *grads), wants, strict=True):
        assert got.dtype == torch.float32, name
        error = float((got.detach().double() - ref).abs().max() / ref.abs().max())
        assert error < 2e-2, (name, error)  # bfloat16 forward rounding, nothing worse
        if name != "out":  # a bfloat16 backward would leave bfloat16 values
            assert not torch.equal(got, got.bfloat16().float()), name


def test_under_autocast_fused_norm_stays_float32_bit_for_bit():
    """Autocast would lower the norm's products; the fused norm opts out."""
    gen = torch.Generator().manual_seed(6)
    norm = LlamaRMSNorm(64)
    x = torch.randn(3, 50, 64, generator=gen, requires_grad=True)
    results = []
    for enabled in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled):
            y = _rms_norm(norm, x)
        results.append((y, *torch.autograd.grad((y * y).sum(), (x, norm.weight))))
    for a, b in zip(*results, strict=True):
        assert a.dtype == torch.float32 and torch.equal(a, b)


# ------------------------------------------------------ fused norm and rotary helpers


@pytest.mark.parametrize("norm_cls", [LlamaRMSNorm, Qwen3RMSNorm])
@pytest.mark.parametrize("seed", range(2))
def test_fused_rms_norm_matches_transformers_forward_and_grads(norm_cls, seed):
    gen = torch.Generator().manual_seed(seed)
    norm = norm_cls(48, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(48, generator=gen))
    x = torch.randn(2, 37, 48, generator=gen, requires_grad=True)
    grad_y = torch.randn(2, 37, 48, generator=gen)
    got = _rms_norm(norm, x)
    got_grads = torch.autograd.grad(got, (x, norm.weight), grad_y)
    want = norm(x)  # transformers' own forward, float32
    want_grads = torch.autograd.grad(want, (x, norm.weight), grad_y)
    assert got.grad_fn is not None and "RMSNorm" in type(got.grad_fn).__name__
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for a, b in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # the same formula in float64, against autograd through the plain expression
    x64 = x.detach().double().requires_grad_()
    w64 = norm.weight.detach().double().requires_grad_()
    fused = type(got.grad_fn)._forward_cls.apply(x64, w64, 1e-5)
    plain = w64 * x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5)
    grads = [torch.autograd.grad(y, (x64, w64), grad_y.double()) for y in (fused, plain)]
    torch.testing.assert_close(fused, plain, rtol=1e-13, atol=1e-14)
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fused_rotary_matches_transformers_forward_and_grads(dtype):
    gen = torch.Generator().manual_seed(3)
    # the attention module's layouts: heads-strided q, k; [1, N, D] cos / sin
    q = torch.randn(1, 29, 4, 16, generator=gen, dtype=dtype).transpose(1, 2).requires_grad_()
    k = torch.randn(1, 29, 2, 16, generator=gen, dtype=dtype).transpose(1, 2).requires_grad_()
    angle = torch.rand(1, 29, 8, generator=gen, dtype=dtype) * 6
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
    grads = [torch.randn(t.shape, generator=gen, dtype=dtype) for t in (q, k)]
    got = apply_rotary(q, k, cos, sin)
    want = apply_rotary_pos_emb(q, k, cos, sin)
    tol = dict(rtol=1e-12, atol=1e-13) if dtype == torch.float64 else {}
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, **tol)
    got_grads = torch.autograd.grad(got, (q, k), grads)
    want_grads = torch.autograd.grad(want, (q, k), grads)
    for a, b in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(a, b, **tol)


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
