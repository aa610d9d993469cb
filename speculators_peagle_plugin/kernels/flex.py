"""flex_attention for the P-EAGLE mask, compiled by Inductor where it supports the tensors;
a compile that fails is logged once and has an exact fallback. The ``BlockMask`` it reads
comes from :mod:`.cod_block_mask`.

Shapes (see :mod:`speculators_peagle_plugin.core`): ``N`` COD elements of the flat
sequence, ``nh`` / ``nkv`` query / key-value heads, ``hd`` head dim.
"""

from __future__ import annotations

import logging

import torch
from torch.nn.attention.flex_attention import flex_attention

logger = logging.getLogger(__name__)

# Inductor's default mode and automatic dynamic shapes, as speculators compiles its
# forward: max-autotune benchmarks every template config at each new shape, minutes on a
# GPU. `speculators-peagle selftest --device cuda` checks that this compile succeeds on the
# user's torch (docs/selftest.md says what the first GPU runs found).
_peagle_flex_attention_compiled = torch.compile(flex_attention)
# Why a compile failed, in one line, per call signature (dtype, heads, head dims), or per
# compiled region (a one-string key naming it and its variant) once it has; every later
# call of that key is refused.
compile_failures: dict[tuple, str] = {}
_peagle_flex_attention_compile_failed = False  # True once any compile has failed


def flex_inputs(q, k, v) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``q, k, v`` as every flex call here takes them: contiguous, as speculators' flex
    attention passes its own. The draft's come as transposed views (``[1, N, heads, hd]``
    read as ``[1, heads, N, hd]``), and Inductor's compiled flex backward has written wrong
    key gradients for strided inputs (pytorch/pytorch#146377); inside a compiled region the
    copy fuses into the op that makes each tensor."""
    return q.contiguous(), k.contiguous(), v.contiguous()


def _peagle_compile_supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether Inductor's flex-attention lowering supports these tensors (CUDA, head dim >= 16)."""
    return all(t.is_cuda for t in (q, k, v)) and min(q.shape[-1], v.shape[-1]) >= 16


def _peagle_flex_attention(q, k, v, block_mask, scale) -> torch.Tensor:
    """Run the P-EAGLE flex attention, compiling only when Inductor supports it.

    Args:
        q: ``[1, nh, N, hd]``; k, v: ``[1, nkv, N, hd]``; block_mask: a flex ``BlockMask``.

    Eager where the compiled kernel is unsupported or failed (:func:`compiled_flex_attention`).
    """
    q, k, v = flex_inputs(q, k, v)
    out = compiled_flex_attention(q, k, v, block_mask, scale)
    if out is None:
        gqa = q.shape[1] != k.shape[1]
        out = flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa)
    return out


def compiled_flex_attention(q, k, v, block_mask, scale) -> torch.Tensor | None:
    """Flex attention compiled by Inductor; ``None`` where it is unsupported (CPU, head
    dim < 16) or has failed for this call's :func:`signature` (logged once, kept in
    :data:`compile_failures`): eager flex attention materialises every score, which no
    long row fits, so training runs its exact block-sparse path instead."""
    global _peagle_flex_attention_compile_failed
    key = signature(q, k, v)
    if not _peagle_compile_supported(q, k, v) or key in compile_failures:
        return None
    q, k, v = flex_inputs(q, k, v)
    out = _compiled_or_none(
        key, "the block-sparse attention runs", _peagle_flex_attention_compiled,
        q, k, v, block_mask=block_mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1],
    )
    if out is None:
        _peagle_flex_attention_compile_failed = True
    return out


def _compiled_or_none(key: tuple, instead: str, compiled, *args, **kwargs):
    """``compiled(*args, **kwargs)``, or ``None`` once its compile has failed for ``key``
    (the reason kept in :data:`compile_failures`, one warning line saying what runs instead).
    """
    try:
        # Past dynamo's recompile limit (each dtype, window or head layout is a variant) a
        # compiled function runs eager without a word, and eager flex attention or mask
        # building runs out of memory at any real length: fail instead, and fall back.
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
            return compiled(*args, **kwargs)
    except torch.OutOfMemoryError:
        raise
    except Exception as err:  # noqa: BLE001 - any Inductor failure falls back
        lines = str(err).strip().splitlines() or [""]
        compile_failures[key] = f"{type(err).__name__}: {lines[0][:300]}"
        name, which = (key[0], "") if len(key) == 1 else ("flex_attention", f" for {describe(key)}")
        logger.warning("%s compile failed%s (%s); %s instead.", name, which, compile_failures[key],
                       instead)
        return None


def signature(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple:
    """What a compile failure is remembered by: dtype, query and key-value heads, head dims."""
    return (str(q.dtype).removeprefix("torch."), q.shape[1], k.shape[1], q.shape[-1], v.shape[-1])


def failures_since(before: dict) -> str:
    """The compile failures recorded since ``before`` (a copy of :data:`compile_failures`),
    one line ('' if none)."""
    new = {k: v for k, v in compile_failures.items() if k not in before}
    return "; ".join(f"{describe(k)}: {why}" for k, why in new.items())


def describe(key: tuple) -> str:
    if len(key) == 1:  # a compiled region's name
        return key[0]
    dtype, nh, nkv, hd, hdv = key
    dims = f"{hd}" if hd == hdv else f"{hd}/{hdv}"
    return f"{dtype}, {nh}/{nkv} heads of {dims}"
