"""Draft checkpoints (both directions with speculators) and the attention paths: flex vs
chunked, block-sparse CPU attention vs a dense float64 oracle, mask slots, autocast."""

import json
import logging

import pytest
import torch
from safetensors.torch import load_file
from speculators.model import SpeculatorModel
from speculators.models.peagle.core import PEagleDraftModel as SpeculatorsPEagle
from test_trainer import packed_batch, trainer
from tiny import MASK_TOKEN, tiny_config, tiny_draft, tiny_target

from speculators_peagle_plugin.kernels import attention, block_sparse, flex
from speculators_peagle_plugin.kernels.fused_ops import _RMSNormFunction
from speculators_peagle_plugin.model import peagle_draft as draft_module
from speculators_peagle_plugin.model.peagle_draft import PEagleDraftModel
from speculators_peagle_plugin.selftest.oracles import masked_attention
from speculators_peagle_plugin.selftest.rows import random_cod_elements


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


def test_compile_failure_logs_once_and_falls_back_to_block_sparse(monkeypatch, caplog):
    """A failed compile is one warning line; that call and every later one run the exact
    block-sparse path (eager flex would materialise every score), never the compiler again."""
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("inductor says no\n  target: flex_attention\n  args[0]: ...")

    monkeypatch.setattr(flex, "_peagle_compile_supported", lambda q, k, v: True)
    monkeypatch.setattr(flex, "_peagle_flex_attention_compiled", broken)
    monkeypatch.setattr(flex, "compile_failures", {})
    monkeypatch.setattr(flex, "_peagle_flex_attention_compile_failed", False)
    anchor, depth, doc = random_cod_elements(4)
    n = anchor.shape[0]
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, h, n, 16, generator=gen) for h in (4, 2, 2))
    flex_mask = attention.PEagleMask(anchor, depth, doc, 5, "flex")
    chunked_mask = attention.PEagleMask(anchor, depth, doc, 5, "chunked")
    with caplog.at_level(logging.WARNING):
        first = attention.peagle_attention(q, k, v, flex_mask, 0.25)
        second = attention.peagle_attention(q, k, v, flex_mask, 0.25)
    assert calls == [1]
    warnings = [r.getMessage() for r in caplog.records if "compile failed" in r.getMessage()]
    assert len(warnings) == 1 and "\n" not in warnings[0]
    assert flex.compile_failures == {("float32", 4, 2, 16, 16): "RuntimeError: inductor says no"}
    assert "float32, 4/2 heads of 16" in warnings[0]
    want = attention.peagle_attention(q, k, v, chunked_mask, 0.25)
    assert torch.equal(first, want) and torch.equal(second, want)
    other = torch.randn(1, 2, n, 16, generator=gen)  # another signature: compiled again
    attention.peagle_attention(other, other, other, flex_mask, 0.25)
    assert calls == [1, 1] and len(flex.compile_failures) == 2
    assert flex._peagle_flex_attention_compile_failed
    from torch.nn.attention.flex_attention import flex_attention

    block = flex_mask.block_mask  # the seed's function itself stays eager flex, as it was
    eager = flex_attention(q, k, v, block_mask=block, scale=0.25, enable_gqa=True)
    assert torch.equal(flex._peagle_flex_attention(q, k, v, block, 0.25), eager)
    assert calls == [1, 1]


@pytest.mark.parametrize("seed", [0, 1])
def test_every_flex_call_gets_contiguous_inputs(monkeypatch, seed):
    """The draft's q, k, v are transposed views; flex attention receives them contiguous, as
    speculators' own P-EAGLE passes them, on each path: the region's ``BlockMask``, the
    compiled kernel, its eager fallback. The results are the exact block-sparse path's."""
    seen = []

    def recording(real):
        def call(q, k, v, *args, **kwargs):
            seen.append([t.is_contiguous() for t in (q, k, v)])
            return real(q, k, v, *args, **kwargs)
        return call

    monkeypatch.setattr(flex, "compile_failures", {})
    anchor, depth, doc = random_cod_elements(seed)
    n = anchor.shape[0]
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, n, h, 16, generator=gen).transpose(1, 2) for h in (4, 2, 2))
    assert not q.is_contiguous()
    flex_mask = attention.PEagleMask(anchor, depth, doc, None, "flex")
    want = attention.peagle_attention(q, k, v, attention.PEagleMask(anchor, depth, doc, None,
                                                                     "chunked"), 0.25)
    real = flex.flex_attention
    monkeypatch.setattr(attention, "flex_attention", recording(real))
    monkeypatch.setattr(flex, "flex_attention", recording(real))
    outs = [attention.peagle_attention(q, k, v, flex_mask.block_mask, 0.25),  # the region's
            attention.peagle_attention(q, k, v, flex_mask, 0.25)]  # eager fallback (CPU)
    monkeypatch.setattr(flex, "_peagle_compile_supported", lambda q, k, v: True)
    monkeypatch.setattr(flex, "_peagle_flex_attention_compiled", recording(real))
    outs.append(attention.peagle_attention(q, k, v, flex_mask, 0.25))  # the compiled kernel
    assert seen == [[True] * 3] * 3
    for out in outs:
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)


def test_out_of_memory_in_the_compiled_kernel_is_not_a_compile_failure(monkeypatch):
    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(flex, "_peagle_compile_supported", lambda q, k, v: True)
    monkeypatch.setattr(flex, "_peagle_flex_attention_compiled", out_of_memory)
    monkeypatch.setattr(flex, "compile_failures", {})
    q = torch.zeros(1, 1, 4, 16)
    with pytest.raises(torch.OutOfMemoryError):
        flex._peagle_flex_attention(q, q, q, None, 1.0)
    assert flex.compile_failures == {}


def test_recompile_limit_falls_back_to_block_sparse_not_eager(monkeypatch, caplog):
    """Past dynamo's recompile limit the compiled flex function would run eager flex (every
    score materialised) without a word; the limit is a logged compile failure instead, and
    the call runs the exact block-sparse path. Real dynamo, its eager backend (CPU)."""
    from torch.nn.attention.flex_attention import flex_attention

    compiled = torch.compile(flex_attention, backend="eager")
    monkeypatch.setattr(flex, "_peagle_compile_supported", lambda q, k, v: True)
    monkeypatch.setattr(flex, "_peagle_flex_attention_compiled", compiled)
    monkeypatch.setattr(flex, "compile_failures", {})
    monkeypatch.setattr(flex, "_peagle_flex_attention_compile_failed", False)
    torch._dynamo.reset()
    anchor, depth, doc = random_cod_elements(6)
    n = anchor.shape[0]
    gen = torch.Generator().manual_seed(6)
    flex_mask = attention.PEagleMask(anchor, depth, doc, None, "flex")
    chunked_mask = attention.PEagleMask(anchor, depth, doc, None, "chunked")
    with torch._dynamo.config.patch(recompile_limit=1), caplog.at_level(logging.WARNING):
        for dtype in (torch.float32, torch.float64):  # a dtype is a new variant
            q, k, v = (torch.randn(1, h, n, 16, generator=gen, dtype=dtype) for h in (4, 2, 2))
            got = attention.peagle_attention(q, k, v, flex_mask, 0.25)
            want = attention.peagle_attention(q, k, v, chunked_mask, 0.25)
            torch.testing.assert_close(got, want)
    torch._dynamo.reset()
    assert list(flex.compile_failures) == [("float64", 4, 2, 16, 16)]
    assert "recompile" in flex.compile_failures["float64", 4, 2, 16, 16].lower()
    assert any("compile failed for float64" in r.getMessage() for r in caplog.records)


def test_compile_support_needs_cuda_and_head_dim_16():
    t = torch.zeros(1, 1, 4, 16)
    assert not flex._peagle_compile_supported(t, t, t)


# ------------------------------------------------- block-sparse CPU attention vs dense


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
    mask = attention.PEagleMask(anchor, depth, doc, window, "chunked")
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
])
def test_mask_slots_and_output_rows_leave_outputs_and_gradients_unchanged(
    monkeypatch, model_type, num_layers, seed
):
    """Depth >= 1 rows share one first-layer input: with ``mask_slots`` the first layer's
    q/k/v see one row for all of them. With ``output_rows`` the last layer's MLP sees only
    those rows. Outputs and every gradient are unchanged either way."""
    # transformers' RMSNorm computes in float32 even for float64 input, which would put
    # float32 rounding on the summed-vs-separate gradients; the fused norm is float64 here.
    monkeypatch.setattr(
        draft_module,
        "_rms_norm",
        lambda norm, x: _RMSNormFunction.apply(x, norm.weight, norm.variance_epsilon),
    )
    draft, _, _ = tiny_draft(seed, torch.float64, model_type=model_type, num_layers=num_layers,
                             sliding_window=6)
    anchor, depth, doc = random_cod_elements(seed, num_depths=4)
    n, n0 = depth.shape[0], int((depth == 0).sum())
    gen = torch.Generator().manual_seed(seed)
    ids = torch.where(depth == 0, torch.randint(0, MASK_TOKEN, (n,), generator=gen), MASK_TOKEN)
    aux = torch.randn(n0, draft.fc.in_features, generator=gen, dtype=torch.float64)
    weight = torch.randn(n, 64, generator=gen, dtype=torch.float64)
    # some rows of every depth, some of each kind left out
    picked = torch.randperm(n, generator=gen)[: n // 2].sort().values
    masks = draft.build_peagle_block_mask(anchor, depth, torch.bincount(doc[doc >= 0]), len(doc))
    rows_seen = {"qkv": [], "mlp": []}
    draft.layers[0].self_attn.q_proj.register_forward_hook(
        lambda mod, args, out: rows_seen["qkv"].append(args[0].shape[1])
    )
    draft.layers[-1].mlp.register_forward_hook(
        lambda mod, args, out: rows_seen["mlp"].append(args[0].shape[1])
    )

    def projected():
        return torch.cat([
            draft.project_hidden_states(aux),
            draft.masked_projected_hidden().expand(n - n0, -1),
        ])

    def run(slots, rows=None, charged=None):
        """Output and gradients of ``sum(out[charged] * weight[charged])``."""
        draft.zero_grad()
        out = draft.forward_peagle(ids[None], projected()[None], (anchor + depth)[None], masks,
                                   mask_slots=slots, output_rows=rows)[0]
        if rows is None and charged is not None:
            out = out[charged]
        (out * (weight if charged is None else weight[charged])).sum().backward()
        grads = {k: p.grad.clone() for k, p in draft.named_parameters() if p.grad is not None}
        return out.detach(), grads

    cases = {
        "each row": run(0), "mask slots once": run(n - n0),
        "all, then picked": run(n - n0, charged=picked),
        "output_rows": run(n - n0, rows=picked, charged=picked),
    }
    assert rows_seen["qkv"] == [n, n0 + 1, n0 + 1, n0 + 1]
    assert rows_seen["mlp"] == [n, n, n, picked.numel()]
    for want, got in (("each row", "mask slots once"), ("all, then picked", "output_rows")):
        (out0, grads0), (out1, grads1) = cases[want], cases[got]
        torch.testing.assert_close(out1, out0, rtol=1e-12, atol=1e-12)
        assert grads1.keys() == grads0.keys() and "mask_hidden" in grads0
        for name, grad in grads0.items():
            torch.testing.assert_close(grads1[name], grad, rtol=1e-10, atol=1e-12, msg=name)
    for bad in (-1, n + 1, True, 1.0):
        with pytest.raises(ValueError, match=r"mask_slots must be an integer in \[0, "):
            draft.forward_peagle(ids[None], projected()[None], (anchor + depth)[None], masks,
                                 mask_slots=bad)


def test_block_sparse_attention_skips_padding_and_empty_rows():
    anchor, depth, doc = random_cod_elements(5, drop_context=True)
    mask = attention.PEagleMask(anchor, depth, doc, None, "chunked")
    idx = torch.arange(anchor.shape[0])
    sees = mask.mask_mod(None, None, idx[:, None], idx[None, :]).any(-1)
    rows = torch.cat([c.rows for c in mask.chunks])
    assert rows.unique().numel() == rows.numel()  # each row in one chunk
    assert torch.equal(rows.sort().values, torch.nonzero(sees).squeeze(1))


@pytest.mark.parametrize("seed", range(3))
def test_under_autocast_cpu_attention_runs_forward_bfloat16_backward_float32(seed):
    """The forward as autocast's SDPA would compute it (bfloat16); float32 gradients."""
    anchor, depth, doc = random_cod_elements(5 + seed)
    mask = attention.PEagleMask(anchor, depth, doc, None, "chunked")
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


@pytest.mark.parametrize("seed", range(3))
def test_block_sparse_matmul_band_runs_bfloat16_inputs(monkeypatch, seed):
    """The band path of other devices (CUDA) on bfloat16 ``q, k, v``, as autocast hands them
    over there: outputs and gradients in bfloat16, within bfloat16 rounding of float64."""
    monkeypatch.setattr(block_sparse, "CHUNK_ANCHORS", 8)
    monkeypatch.setattr(block_sparse, "_cpu_flash", lambda t: False)
    anchor, depth, doc = random_cod_elements(7 + seed)
    mask = attention.PEagleMask(anchor, depth, doc, 3 + seed, "chunked")
    n = anchor.shape[0]
    idx = torch.arange(n)
    allowed = mask.mask_mod(None, None, idx[:, None], idx[None, :])
    gen = torch.Generator().manual_seed(20 + seed)
    q64, k64, v64 = (torch.randn(1, h, n, 32, generator=gen, dtype=torch.float64).requires_grad_()
                     for h in (4, 2, 2))
    grad_out = torch.randn(1, 4, n, 32, generator=gen, dtype=torch.float64)
    q, k, v = (t.detach().bfloat16().requires_grad_() for t in (q64, k64, v64))
    out = attention.peagle_attention(q, k, v, mask, 32**-0.5)
    grads = torch.autograd.grad(out, (q, k, v), grad_out.bfloat16())
    want = masked_attention(q64, k64, v64, allowed, 32**-0.5)
    wants = (want.detach(), *torch.autograd.grad(want, (q64, k64, v64), grad_out))
    for name, got, ref in zip(("out", "dq", "dk", "dv"), (out, *grads), wants, strict=True):
        assert got.dtype == torch.bfloat16, name
        error = float((got.detach().double() - ref).abs().max() / ref.abs().max())
        assert error < 3e-2, (name, error)
