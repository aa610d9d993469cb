"""Correctness on the chosen device against the float64 CPU oracles of :mod:`.oracles`.

Shapes: ``N`` COD elements of a row, ``L`` tokens, ``nh`` / ``nkv`` heads, ``hd`` head dim.

Every check draws random ragged rows (several packed documents, padding, random
supervision) over several seeds, runs the product on the device (float32, then under
bfloat16 autocast), and compares with a float64 oracle computed on the CPU from the same
inputs. Errors are relative to the reference's largest entry
(:func:`.selftest_report.relative_error`).
"""

from __future__ import annotations

import copy
import traceback
from contextlib import nullcontext

import torch

from ..core.peagle_config import CODConfig
from ..core.peagle_data import generate_cod_sample_indices
from ..kernels import flex
from ..kernels.attention import PEagleMask, peagle_attention
from .oracles import brute_force_mask, dense_reference_loss, masked_attention
from .rows import packed_batch, random_cod_elements
from .selftest_report import FAIL, PASS, Check, verdict
from .selftest_report import relative_error as _error
from .shapes import NARROW_WINDOW, Shape, build_draft, trainer_for

# Tolerances, relative to the reference's largest entry. float32: rounding of float32
# sums over a few hundred keys and a few thousand features stays near 1e-6; a wrong key
# or a wrong scale gives 1e-2 or more. bfloat16: its 8-bit mantissa (2**-8 = 4e-3) on
# the forward's inputs, compounded by a softmax, a decoder layer and the loss.
TOLERANCE = {
    "attention float32": 1e-4,
    "attention bfloat16": 3e-2,
    "step float32": 1e-4,
    "step bfloat16": 5e-2,
    "partitioned": 1e-5,  # same float32 arithmetic, summed in another order
}
WINDOWS = (None, 5)  # full attention, and a window shorter than the rollouts
PARTITIONS = 3


def _autocast(device: torch.device, precision: str):
    if precision == "float32":
        return nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16)


def _oracle_masks(seeds, length: int) -> dict:
    """Per (seed, window): the row's elements and their brute-force mask (CPU, once)."""
    out = {}
    for seed in seeds:
        anchor, depth, doc = random_cod_elements(seed, length=length, num_depths=8)
        lengths = torch.bincount(doc[doc >= 0]).tolist()
        for window in WINDOWS:
            out[seed, window] = (anchor, depth, doc, brute_force_mask(anchor, depth, lengths,
                                                                      length, window))
    return out


def attention_checks(shape: Shape, device: torch.device, seeds, length: int) -> list[Check]:
    """COD attention outputs and ``dq, dk, dv`` on the device vs float64 softmax attention.

    Paths: the one training takes on the device (flex on CUDA, the block-sparse path on
    CPU) and, on CUDA, the block-sparse path forced as well. Each path and precision is
    its own check (an exception in one FAILs it alone). Flex attention that fails to
    compile FAILs its checks, whatever the block-sparse path it falls back to computes:
    training would run that slower path.
    """
    impls = ("flex", "chunked") if device.type == "cuda" else ("chunked",)
    masks = _oracle_masks(seeds, length)
    checks = []
    for impl in impls:
        for precision in ("float32", "bfloat16"):
            name = f"attention {impl} {precision}"
            failed_before = dict(flex.compile_failures)
            try:
                check = _attention_check(name, impl, precision, shape, device, masks)
            except Exception as err:  # noqa: BLE001 - whatever broke is the finding
                why = (str(err).strip().splitlines() or [""])[0]
                check = Check(name, FAIL, f"{type(err).__name__}: {why}",
                              {"traceback": traceback.format_exc()})
            new = flex.failures_since(failed_before)
            if impl == "flex" and new:
                check = Check(name, FAIL, f"did not compile ({new}), so training runs "
                              "the slower exact fallback", check.data)
            checks.append(check)
    return checks


def flex_compile_check() -> Check:
    """CUDA: whether every flex-attention call and block-mask build of the run compiled
    (training's fast path)."""
    if not flex.compile_failures:
        return Check("flex_attention compiled", PASS,
                     "every flex-attention call and block mask compiled")
    why = flex.failures_since({})
    return Check("flex_attention compiled", FAIL, f"{why}; those ran their slower exact "
                 "fallback", {"failures": list(flex.compile_failures.values())})


def _attention_check(name, impl, precision, shape: Shape, device, masks) -> Check:
    nh, nkv, hd = shape.num_attention_heads, shape.num_key_value_heads, shape.head_dim
    errors, elements = {}, 0
    for (seed, window), (anchor, depth, doc, allowed) in masks.items():
        gen = torch.Generator().manual_seed(1000 + seed)
        n = anchor.shape[0]
        elements += n
        q, k, v = (torch.randn(1, h, n, hd, generator=gen, dtype=torch.float64)
                   for h in (nh, nkv, nkv))
        live = allowed.any(-1)  # padding rows see nothing: no output to compare
        grad_out = torch.randn(1, nh, n, hd, generator=gen, dtype=torch.float64)
        grad_out[..., ~live, :] = 0
        leaves = [t.requires_grad_() for t in (q, k, v)]
        want = masked_attention(*leaves, allowed, hd**-0.5)
        wants = (want, *torch.autograd.grad(want, leaves, grad_out))
        mask = PEagleMask(anchor.to(device), depth.to(device), doc.to(device), window, impl)
        ins = [t.detach().float().to(device).requires_grad_() for t in (q, k, v)]
        with _autocast(device, precision):
            out = peagle_attention(*ins, mask, hd**-0.5)
        gots = (out, *torch.autograd.grad(out, ins, grad_out.to(out)))
        for part, got, ref in zip(("out", "dq", "dk", "dv"), gots, wants, strict=True):
            if part == "out":
                got, ref = got[..., live.to(device), :], ref[..., live, :]
            errors[f"seed {seed} window {window} {part}"] = _error(got, ref)
    what = (f"{len(masks)} ragged rows ({elements} elements, {nh}/{nkv} heads of "
            f"{hd}), outputs and gradients vs float64")
    return verdict(name, errors, TOLERANCE[f"attention {precision}"], what)


def _run_step(draft, batch, device, seed, precision="float32", partitions=1):
    """The product's loss and gradients of one step: ``(loss, {name: grad})``."""
    module = trainer_for(draft, partitions, seed)
    draft.model.zero_grad(set_to_none=True)
    loss = 0.0
    for segment in module.segments(batch):
        with _autocast(device, precision):
            metrics = module.forward_batch(batch, peagle_segment=segment)
        metrics.loss.backward()
        loss = loss + metrics.loss.detach()
    grads = {n: p.grad for n, p in draft.model.named_parameters() if p.grad is not None}
    return loss, grads


def _oracle_step(draft, batch64, device, seed):
    """The float64 CPU oracle's loss and gradients on the COD sample the product draws.

    The sample comes from the product's sampler with the same generator (seeded alike,
    on the device, drawn row by row as the trainer draws): the sampler has its own
    oracle in the tests; here it only has to give both sides the same elements.
    """
    cod = CODConfig()
    gen = torch.Generator(device).manual_seed(seed)
    seq_len = batch64["input_ids"].shape[1]
    rows = []
    for b in range(batch64["input_ids"].shape[0]):
        doc = batch64["document_ids"][b]
        anchor, depth = generate_cod_sample_indices(
            seq_len, batch64["loss_mask"][b].to(device), cod.num_depths, cod.down_sample_ratio,
            cod.down_sample_ratio_min, document_ids=doc.to(device), generator=gen,
        )
        anchor, depth = anchor.cpu(), depth.cpu()
        lengths = torch.bincount(doc[doc >= 0]).tolist()
        rows.append((anchor, depth, brute_force_mask(anchor, depth, lengths, seq_len,
                                                     NARROW_WINDOW)))
    oracle = copy.deepcopy(draft.model).to("cpu", torch.float64)
    loss = dense_reference_loss(oracle, batch64, rows, draft.mask_token_id)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in oracle.named_parameters() if p.grad is not None}


def _compare(got, want) -> dict[str, float]:
    loss, grads = got
    want_loss, want_grads = want
    errors = {"loss": _error(loss, want_loss)}
    for name, grad in grads.items():
        ref = want_grads.get(name)
        errors[f"grad {name}"] = float("inf") if ref is None else _error(grad, ref)
    return errors


def step_checks(shape: Shape, device: torch.device, seeds, length: int) -> list[Check]:
    """One training step of a narrow draft of ``shape`` (loss and every gradient):
    float32 and bfloat16 autocast vs the float64 oracle, and partitioned vs flat."""
    narrow = shape.narrow()
    errors = {"step float32": {}, "step bfloat16": {}, "partitioned": {}}
    for seed in seeds:
        draft = build_draft(narrow, device, seed, NARROW_WINDOW)
        batch64 = packed_batch(
            seed, vocab=narrow.vocab_size, seq_len=length, aux_width=draft.model.fc.in_features,
            hidden=narrow.hidden_size,
        )
        batch = {k: (v.float() if v.is_floating_point() else v).to(device)
                 for k, v in batch64.items()}
        want = _oracle_step(draft, batch64, device, seed)
        flat = _run_step(draft, batch, device, seed)
        flat = flat[0], {n: g.clone() for n, g in flat[1].items()}
        for kind, got in (
            ("step float32", flat),
            ("step bfloat16", _run_step(draft, batch, device, seed, "bfloat16")),
            ("partitioned", _run_step(draft, batch, device, seed, partitions=PARTITIONS)),
        ):
            reference = flat if kind == "partitioned" else want
            errors[kind] |= {f"seed {seed} {k}": e for k, e in _compare(got, reference).items()}
    rows = f"{len(seeds)} seeds x 2 ragged rows of {length} tokens"
    whats = {
        "step float32": f"{rows}, loss and gradients vs float64",
        "step bfloat16": f"{rows}, bfloat16 autocast vs float64",
        "partitioned": f"{rows}, {PARTITIONS} segments vs the flat step (float32)",
    }
    names = {"step float32": "training step float32", "step bfloat16": "training step bfloat16",
             "partitioned": "partitioned step == flat step"}
    return [verdict(names[k], errors[k], TOLERANCE[k], whats[k]) for k in errors]
