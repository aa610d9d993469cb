"""flex_attention for the P-EAGLE mask, compiled by Inductor where it supports the tensors.

Shapes (see :mod:`speculators_peagle_plugin.core`): ``N`` COD elements of the flat
sequence, ``nh`` / ``nkv`` query / key-value heads, ``hd`` head dim.
"""

from __future__ import annotations

import logging

import torch
from torch.nn.attention.flex_attention import flex_attention

logger = logging.getLogger(__name__)

# Inductor's default mode, as vLLM and attention-gym compile flex attention: max-autotune
# benchmarks every template config at each new shape (minutes on a GPU) and its
# benchmarking broke on torch 2.11 (`speculators-peagle selftest --device cuda`).
_peagle_flex_attention_compiled = torch.compile(flex_attention, dynamic=True)
# Why the compiled kernel failed, in one line, once it has; every later call is refused.
compile_failure: str | None = None


def _peagle_compile_supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether Inductor's flex-attention lowering supports these tensors (CUDA, head dim >= 16)."""
    return all(t.is_cuda for t in (q, k, v)) and min(q.shape[-1], v.shape[-1]) >= 16


def _peagle_flex_attention(q, k, v, block_mask, scale) -> torch.Tensor | None:
    """Flex attention, compiled where Inductor supports the tensors, else eager.

    Args:
        q: ``[1, nh, N, hd]``; k, v: ``[1, nkv, N, hd]``; block_mask: a flex ``BlockMask``.

    Returns ``None`` once compiling has failed (logged once, kept in
    :data:`compile_failure`): eager flex attention materialises every score, which no
    long row fits, so the caller runs its exact block-sparse path instead.
    """
    global compile_failure
    gqa = q.shape[1] != k.shape[1]
    if not _peagle_compile_supported(q, k, v):
        return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa)
    if compile_failure is not None:
        return None
    try:
        return _peagle_flex_attention_compiled(
            q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa
        )
    except torch.OutOfMemoryError:
        raise
    except Exception as err:  # noqa: BLE001 - any Inductor failure falls back
        lines = str(err).strip().splitlines() or [""]
        compile_failure = f"{type(err).__name__}: {lines[0][:300]}"
        logger.warning(
            "flex_attention compile failed (%s); the block-sparse attention runs instead.",
            compile_failure,
        )
        return None
