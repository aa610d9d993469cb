"""The draft forward and loss as one compiled region (the CUDA step), held on the CPU.

Graph capture does not depend on the device: dynamo traces the same region here, with
AOT autograd's eager backend standing in for Inductor's CUDA kernels (flex attention's
reference implementation runs forward and backward). Oracles: dynamo's own counters
(graph breaks, frames compiled), and the eager block-sparse step in float64.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch._dynamo
import torch._dynamo.testing
import torch.nn.attention.flex_attention as flex_api
from tiny import MASK_TOKEN, TARGET_VOCAB, tiny_draft
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from speculators_peagle_plugin.kernels import flex
from speculators_peagle_plugin.selftest import rows
from speculators_peagle_plugin.training import draft_loss
from speculators_peagle_plugin.training.peagle_trainer import PEagleTrainerModule

K = 4


@pytest.fixture
def region_on_cpu(monkeypatch):
    """The region compiled for the CPU with a counting AOT-eager backend; flex attention's
    CPU guard against training (its compiled CPU kernel has no backward) lifted, as the
    reference implementation this backend runs has one."""
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    monkeypatch.setattr(flex_api, "_validate_device", lambda *args, **kwargs: None)
    monkeypatch.setattr(draft_loss, "REGION_DEVICES", ("cpu",))
    monkeypatch.setattr(draft_loss, "_draft_loss_compiled",
                        torch.compile(draft_loss.draft_loss, backend=counter, dynamic=True))
    monkeypatch.setattr(flex, "compile_failures", {})
    yield counter
    torch._dynamo.reset()


def _module(draft, ids, t2d, seed, partitions=1, **kw):
    return PEagleTrainerModule(draft, ids, t2d, K, MASK_TOKEN, 0.8, 0.3, partitions,
                               generator=torch.Generator().manual_seed(seed), **kw)


def _batch(seed, seq_len, dtype=torch.float32):
    return rows.packed_batch(seed, vocab=TARGET_VOCAB, aux_width=192, hidden=64, batch=2,
                             seq_len=seq_len, n_docs=3, pad=7, dtype=dtype)


def _step(module, batch):
    """The loop's step: one forward and backward per segment; loss and gradients."""
    module.draft.zero_grad()
    total = 0.0
    for segment in module.segments(batch):
        out = module.forward_batch(batch, segment)
        out.loss.backward()
        total = total + out.loss.detach()
    grads = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    return total, grads


def test_the_region_has_no_graph_break_and_compiles_a_bounded_number_of_times(region_on_cpu):
    draft, ids, t2d = tiny_draft(0, num_layers=2, sliding_window=9)
    draft.attention_impl = "flex"
    def steps(lengths, first_seed):
        for i, length in enumerate(lengths):
            seed = first_seed + i
            _step(_module(draft, ids, t2d, seed, partitions=1 + i % 3), _batch(seed, length))

    steps((61, 90, 131, 45, 200, 77), 0)
    warm = region_on_cpu.frame_count
    # the static first frame, its dynamic recompile, and the variants dynamo specialises:
    # a segment of one mask block (size 1), a flat row whose depth-0 count equals its length
    assert 1 <= warm <= 6
    steps((257, 111, 150), 100)  # new lengths, every partition count again
    assert region_on_cpu.frame_count == warm
    assert dict(torch._dynamo.utils.counters["graph_break"]) == {}
    assert flex.compile_failures == {}


@pytest.fixture
def float64_norms(monkeypatch):
    """transformers' RMSNorm computes in float32 whatever its input: the float64 oracle
    needs it in the input's dtype (same formula)."""

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)
                                              + self.variance_epsilon))

    monkeypatch.setattr(LlamaRMSNorm, "forward", forward)


@pytest.mark.parametrize("seed,partitions,weights,checkpointing", [
    (0, 1, (0.0, 0.5), False), (1, 3, (0.3, 0.0), True)])
def test_the_compiled_region_gives_the_eager_steps_loss_and_gradients(
        region_on_cpu, float64_norms, seed, partitions, weights, checkpointing):
    hard, tv = weights
    draft, ids, t2d = tiny_draft(seed, dtype=torch.float64, num_layers=2)
    if checkpointing:  # activation checkpointing inside the region
        draft.gradient_checkpointing_enable({"use_reentrant": False})
    draft.train()
    batch = _batch(seed, 83, dtype=torch.float64)
    kw = {"hard_label_weight": hard, "tv_weight": tv}
    draft.attention_impl = "chunked"  # the CPU's eager block-sparse step
    want_loss, want = _step(_module(draft, ids, t2d, seed, partitions, **kw), batch)
    draft.attention_impl = "flex"
    got_loss, got = _step(_module(draft, ids, t2d, seed, partitions, **kw), batch)
    assert region_on_cpu.frame_count >= 1  # the region ran
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-10, atol=0)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-8, atol=1e-12, msg=name)


def test_the_region_is_for_cuda_and_flex_only_and_a_failure_is_kept_per_variant(monkeypatch):
    draft, _, _ = tiny_draft(0)
    row = torch.zeros(3, 192)
    key = draft_loss.step_key(draft, row)
    assert key == ("the draft step (float32, 4/2 heads of 16)",)
    assert not draft_loss.region_runs(draft, torch.device("cpu"), key)
    draft.attention_impl = "chunked"
    assert not draft_loss.region_runs(draft, torch.device("cuda"), key)
    draft.attention_impl = "auto"
    assert draft_loss.region_runs(draft, torch.device("cuda"), key)
    monkeypatch.setattr(flex, "compile_failures", {key: "NoValidChoicesError: x"})
    assert not draft_loss.region_runs(draft, torch.device("cuda"), key)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16 = draft_loss.step_key(draft, row)
    assert bf16 == ("the draft step (bfloat16, 4/2 heads of 16)",)
    assert draft_loss.region_runs(draft, torch.device("cuda"), bf16)


def test_a_failed_region_compile_is_logged_once_and_the_step_runs_eagerly(
        region_on_cpu, monkeypatch, caplog):
    calls = []

    def broken(*args):
        calls.append(1)
        raise RuntimeError("inductor says no\n  more")

    monkeypatch.setattr(draft_loss, "_draft_loss_compiled", broken)
    draft, ids, t2d = tiny_draft(0)
    batch = _batch(0, 61)
    draft.attention_impl = "chunked"
    want, _ = _step(_module(draft, ids, t2d, 0), batch)
    draft.attention_impl = "flex"
    with caplog.at_level(logging.WARNING):
        first, _ = _step(_module(draft, ids, t2d, 0), batch)
        second, _ = _step(_module(draft, ids, t2d, 0), batch)
    assert calls == [1]
    key = ("the draft step (float32, 4/2 heads of 16)",)
    assert flex.compile_failures == {key: "RuntimeError: inductor says no"}
    assert [r.getMessage() for r in caplog.records if "compile failed" in r.getMessage()] == [
        "the draft step (float32, 4/2 heads of 16) compile failed (RuntimeError: inductor "
        "says no); it runs eagerly around the attention instead."]
    torch.testing.assert_close(first, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(second, want, rtol=1e-5, atol=1e-6)


def test_no_hand_written_backward_is_traced_into_the_region(region_on_cpu):
    """Inside the region the norms and the rotary are transformers' own ops, for the
    compiler to fuse and differentiate; eagerly (the same float32 step) they are fused."""
    draft, ids, t2d = tiny_draft(0, num_layers=2)
    batch = _batch(0, 61)
    draft.attention_impl = "chunked"
    want_loss, want = _step(_module(draft, ids, t2d, 0, 2), batch)
    draft.attention_impl = "flex"
    got_loss, got = _step(_module(draft, ids, t2d, 0, 2), batch)
    targets = [str(node.target) for gm in region_on_cpu.graphs for node in gm.graph.nodes]
    assert region_on_cpu.frame_count >= 1 and targets
    assert not [t for t in targets if "autograd_function" in t or "Function" in t]
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=0)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)
