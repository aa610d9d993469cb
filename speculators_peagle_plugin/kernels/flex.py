"""flex_attention for the P-EAGLE mask: compiled where Inductor supports it, else eager.

Shapes (see :mod:`speculators_peagle_plugin.core`): ``N`` COD elements of the flat
sequence, ``nh`` / ``nkv`` query / key-value heads, ``hd`` head dim.
"""

from __future__ import annotations

import logging

import torch
from torch.nn.attention.flex_attention import flex_attention

logger = logging.getLogger(__name__)

_peagle_flex_attention_compiled = torch.compile(
    flex_attention, mode="max-autotune-no-cudagraphs", dynamic=True
)
_peagle_flex_attention_compile_failed = False


def _peagle_compile_supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether Inductor's flex-attention lowering supports these tensors (CUDA, head dim >= 16)."""
    return all(t.is_cuda for t in (q, k, v)) and min(q.shape[-1], v.shape[-1]) >= 16


def _peagle_flex_attention(q, k, v, block_mask, scale):
    """Run flex attention, compiled where Inductor supports it, else eager.

    Args:
        q: ``[1, nh, N, hd]``; k, v: ``[1, nkv, N, hd]``; block_mask: a flex ``BlockMask``.

    A compile failure is logged once and every later call runs eager.
    """
    global _peagle_flex_attention_compile_failed
    gqa = q.shape[1] != k.shape[1]
    if _peagle_compile_supported(q, k, v) and not _peagle_flex_attention_compile_failed:
        try:
            return _peagle_flex_attention_compiled(
                q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa
            )
        except Exception as err:  # noqa: BLE001 - any Inductor failure falls back
            _peagle_flex_attention_compile_failed = True
            logger.warning("flex_attention compile failed (%s); running eager from now on.", err)
    return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa)
