"""The draft's forward and its loss over one row's elements, as one ``torch.compile`` region.

Shapes (see :mod:`speculators_peagle_plugin.core`): ``L`` tokens of the row, ``N`` COD
elements (``n0`` at depth 0), ``A * H`` the aux states' width, ``R`` charged elements,
``m`` distinct target positions, ``V_d`` draft vocabulary.

speculators compiles its whole P-EAGLE forward on CUDA; here the region is everything
from the aux states to the summed loss: the fc projection, every layer with
``flex_attention`` under the COD ``BlockMask``, ``lm_head`` and the KL. Inductor fuses
the norms, rotary and softmaxes into the matmuls' neighbours, where eagerly each is a pass
over memory. What has data-dependent sizes stays outside, in Python: COD sampling, the
partition plan, the ``BlockMask`` (read off the layout, :mod:`..kernels.cod_block_mask`),
the charged rows and the target logits. So the region has no graph break, and with
``dynamic=True`` a new row length compiles nothing new once the few size specialisations
(a one-block segment, a row all of whose positions are context) have been seen
(tests/test_draft_loss.py counts both on the CPU, where graph capture is as on CUDA).
"""

from __future__ import annotations

import torch

from ..kernels import flex
from ..kernels.attention import resolve_attention_impl
from ..kernels.fused_kl import LossConfig, fused_linear_kl, linear_kl

# The devices the region is compiled for: where flex attention is compiled with its
# backward (Inductor's CPU flex kernel has none in torch 2.13).
REGION_DEVICES = ("cuda",)


def row_loss(draft, sampled_ids, aux_row, context_positions, positions, masks, output_rows,
             targets, target_rows, loss: LossConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`draft_loss` of one row's elements under their ``PEagleMask`` per layer:
    compiled where :func:`region_runs`, else op by op with the fused kernels."""
    weights = (loss.hard_label_weight, loss.tv_weight)
    key = step_key(draft, aux_row)
    if region_runs(draft, sampled_ids.device, key):
        out = compiled_draft_loss(key, draft, sampled_ids, aux_row, context_positions,
                                  positions, [m.block_mask for m in masks], output_rows,
                                  targets, target_rows, *weights)
        if out is not None:
            return out
    return draft_loss(draft, sampled_ids, aux_row, context_positions, positions, masks,
                      output_rows, targets, target_rows, *weights, kl=fused_linear_kl)


def draft_loss(
    draft: torch.nn.Module,
    sampled_ids: torch.Tensor,
    aux_row: torch.Tensor,
    context_positions: torch.Tensor,
    positions: torch.Tensor,
    block_masks: list,
    output_rows: torch.Tensor,
    targets: torch.Tensor,
    target_rows: torch.Tensor,
    hard_label_weight: float = 0.0,
    tv_weight: float = 0.0,
    kl=linear_kl,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of the KL over the charged elements, and their argmax hits.

    Args:
        sampled_ids: ``[N]`` real ids at depth 0, the mask token deeper.
        aux_row: ``[L, A * H]`` the row's captured target states.
        context_positions: ``[n0]`` the depth-0 elements' positions (their aux states).
        positions: ``[N]`` reference positions ``anchor + depth``.
        block_masks: a flex ``BlockMask`` per draft layer (or, eagerly, a ``PEagleMask``).
        output_rows: ``[R]`` the charged elements; targets: ``[m, V_d]`` target logits
            (no grad); target_rows: ``[R]`` each charged element's row of ``targets``.

        kl: the loss of the ``lm_head`` inputs: :func:`linear_kl` for the compiler to fuse,
            or eagerly :func:`fused_linear_kl`, which keeps no ``[R, V_d]`` tensor.

    Returns:
        ``(loss_sum, hits [R])``.

    fc runs on the ``n0`` real rows only; one projected ``mask_hidden`` fills every deeper
    slot and stays in the autograd graph even when there is none (DDP needs every
    parameter used on every rank).
    """
    mask_slots = sampled_ids.shape[0] - context_positions.shape[0]
    projected = torch.cat([
        draft.project_hidden_states(aux_row[context_positions]),
        draft.masked_projected_hidden().expand(mask_slots, -1),
    ])
    hidden = draft.forward_peagle(
        sampled_ids[None], projected[None], positions[None], block_masks,
        mask_slots=mask_slots, output_rows=output_rows,
    )[0]
    return kl(draft.lm_head_inputs(hidden), draft.lm_head.weight, targets, target_rows,
              hard_label_weight, tv_weight)


_draft_loss_compiled = torch.compile(draft_loss, dynamic=True)


def step_key(draft: torch.nn.Module, aux_row: torch.Tensor) -> tuple[str]:
    """What a failed compile of the region is remembered by (its ``compile_failures`` key):
    the compute dtype and the attention's heads, as flex attention's own failures are, so
    one variant failing (float32 at some head layout) leaves the others compiled."""
    attn = draft.layers[0].self_attn
    config = draft.config.transformer_layer_config
    device = aux_row.device.type
    dtype = (torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device)
             else aux_row.dtype)
    return (f"the draft step ({str(dtype).removeprefix('torch.')}, "
            f"{config.num_attention_heads}/{config.num_key_value_heads} heads of "
            f"{attn.head_dim})",)


def region_runs(draft: torch.nn.Module, device: torch.device, key: tuple[str]) -> bool:
    """Whether this step runs as the compiled region: flex attention on a region device,
    and no failed compile of the region for ``key`` (:func:`step_key`) yet."""
    return (device.type in REGION_DEVICES
            and resolve_attention_impl(draft.attention_impl, device) == "flex"
            and key not in flex.compile_failures)


def compiled_draft_loss(key: tuple[str], *args) -> tuple[torch.Tensor, torch.Tensor] | None:
    """:func:`draft_loss` compiled; ``None`` once its compile has failed for ``key``
    (logged once, the step then runs eagerly around compiled flex attention)."""
    return flex._compiled_or_none(key, "it runs eagerly around the attention",
                                  _draft_loss_compiled, *args)
